"""EngineCore: the synchronous, in-process engine (tokenizer, model runner, scheduler, radix
cache, sampler, detokenizer). The HTTP server drives it from its own loop; `Engine` wraps it
for offline use.

    core = EngineCore(ServerConfig())
    core.add_request(GenerateReq(...))      # validates; raises InvalidRequestError
    while core.has_work():
        for out in core.step():             # at most one forward per step
            ...                             # ReqOutput deltas
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import numpy as np
import torch

from lmserver.config import ServerConfig
from lmserver.engine.builder import EngineBuilder
from lmserver.engine.constrained.grammar import STUCK_MESSAGE
from lmserver.engine.detokenizer import IncrementalDetokenizer, OutputText
from lmserver.engine.overlap import Launched, chain_ready, next_input_ids, row_ok
from lmserver.engine.req_state import ReqState
from lmserver.engine.step_trace import StepTrace
from lmserver.io_struct import GenerateReq, InvalidRequestError, ReqOutput, TokenLogprob
from lmserver.runner.host_tensors import to_device
from lmserver.runner.sampler import SamplingInfo, apply_penalties, sample, sample_tensor, takes_argmax
from lmserver.scheduler import Req, ReqStatus, ScheduleDecision

logger = logging.getLogger(__name__)

# While requests run, a step spends at most about this much host time moving requests whose grammar
# compiled into the scheduler (grammar objects, the jump-forward at admission); the rest wait for the
# next steps. A storm's quick compiles finish together: all at once they were one long gap.
GRAMMAR_ADMIT_BUDGET_S = 0.004


def _valid_token_ids(ids: list[int], vocab_size: int) -> bool:
    """Every entry a Python or numpy integer in [0, vocab_size): one numpy pass (an all-bool
    prompt is rejected; bools among integers count as 0/1, as `isinstance(t, int)` allowed)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":  # floats, bools, objects (huge ints, None)
        return False
    return bool(arr.min() >= 0 and arr.max() < vocab_size)


class EngineCore:
    def __init__(self, config: ServerConfig | None = None) -> None:
        """Builds the engine's parts from `config` (`EngineBuilder`: the config resolved and logged once)."""
        parts = EngineBuilder(config or ServerConfig()).build()
        self.model_path = parts.model_path
        self.model_config = parts.model_config
        self.resolved_config = parts.config
        self.device = parts.device
        self.dtype = parts.dtype
        assert parts.config.context_length is not None  # resolved
        self.context_length: int = parts.config.context_length
        self.vocab_size = parts.model_config.vocab_size
        self.tokenizer = parts.tokenizer
        self.lowlat = parts.lowlat
        self.model = parts.model
        self.tp = parts.tp  # lmserver.runner.tp_engine.TPContext when tp_size > 1 (this is rank 0)
        self.kv_manager = parts.kv_manager
        self.kv_pool = parts.kv_pool
        self.host_kv = parts.host_kv
        self.req_to_token = parts.req_to_token
        self.runner = parts.runner
        self.mm = parts.mm  # images / videos (a model with a vision encoder)
        self.scheduler = parts.scheduler
        self.eos_token_ids = parts.eos_token_ids
        self.constrained = parts.constrained
        self.spec = parts.spec  # speculative decoding (engine/speculative.py)
        # the overlap scheduler (engine/overlap.py); a plain attribute, so benchmarks can flip it
        self.overlap = parts.overlap
        self.states: dict[str, ReqState] = {}
        self._pending: list[ReqOutput] = []
        self._arrivals = 0
        self._started = time.monotonic()
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0, "cached_tokens": 0, "requests": 0,
                          "forward_tokens": 0, "forwards": 0,
                          # prefill forwards (extend batches) and their wall time, forward to sampled tokens
                          # on the host: the share of a run that a prefix cache can shorten. NOTE: an extend
                          # that samples nothing (a middle chunk of a long prompt) is timed to its launch only
                          "extend_forwards": 0, "extend_time_s": 0.0,
                          "overlap_steps": 0, "overlap_discarded_tokens": 0,  # chained launches, rows thrown away
                          "overlap_grammar_steps": 0}  # chained launches sampled after the landing (grammar rows)
        self._recent: list[tuple[float, int]] = []  # (time, generated tokens) per step, last 10 s
        self._inflight: Launched | None = None  # the decode launched and not landed yet
        # compiled (or failed) grammars polled and not admitted yet (GRAMMAR_ADMIT_BUDGET_S)
        self._compiled: collections.deque[tuple[str, Any]] = collections.deque()
        # (step number, end time) of the last paced mixed step: back-to-back paced steps are timed
        # end to end, so the pacer sees the running requests' whole gap between two tokens (the
        # loop's messaging and scheduling included), not only the forward
        self._steps = 0
        self._paced_end = (-1, 0.0)
        # the running requests' gaps between two tokens and what filled them (engine/step_trace.py)
        self.trace = StepTrace(keep=parts.config.step_trace)
        self._decode_rows = 0  # rows of the current step that got a token after their first
        self._receive_s = 0.0  # the grammar dispatcher's receive time already given to the trace
        self._mask_fill_s = 0.0  # the batch masker's fill time already given to the trace

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, req: GenerateReq) -> None:
        """Validates and queues `req` (n must be 1; see io_struct.expand_n).

        Raises InvalidRequestError for bad input. Mutates the waiting queue.
        """
        start = time.perf_counter()
        try:
            self._add_request(req)
        finally:
            self.trace.add_request(time.perf_counter() - start)

    def _add_request(self, req: GenerateReq) -> None:
        p = req.sampling_params
        if p.n != 1:
            raise InvalidRequestError("EngineCore takes n == 1 requests; split them with io_struct.expand_n")
        if req.rid in self.states:
            raise InvalidRequestError(f"duplicate request id {req.rid!r}")
        p.validate(self.vocab_size)
        ids = req.input_ids
        if not ids:
            raise InvalidRequestError("the prompt is empty (no input tokens)")
        if not _valid_token_ids(ids, self.vocab_size):
            raise InvalidRequestError(f"input_ids must be token ids in [0, {self.vocab_size})")
        limit = self.context_length if p.max_new_tokens == 0 else self.context_length - 1
        if len(ids) > limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this model's context length is {self.context_length} "
                f"(prompt + output); shorten the prompt"
            )
        if req.mm_items:
            if self.mm is None:
                raise InvalidRequestError("this model is text-only: it takes no images or videos")
            self.mm.check(ids, req.mm_items)
        grammar = self.constrained.grammar_key(p)  # raises GrammarError (an InvalidRequestError) for ebnf, bad JSON
        if req.return_logprob and req.logprob_start_len >= len(ids):
            raise InvalidRequestError(f"logprob_start_len must be < the prompt length ({len(ids)})")
        max_new = min(p.max_new_tokens, self.context_length - len(ids))
        self._arrivals += 1
        sreq = Req(
            req.rid, ids, p, max_new, arrival=self._arrivals, extra_key=req.extra_key,
            logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
            mm_items=tuple(req.mm_items),
        )
        sreq.need_input_logprobs = req.return_logprob and req.logprob_start_len >= 0
        seed = p.sampling_seed if p.sampling_seed is not None else self.resolved_config.random_seed * 1_000_003 + self._arrivals
        generator = torch.Generator().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF)
        stop_ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids)))
        state = ReqState(
            req=req,
            sreq=sreq,
            detok=IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens, p.spaces_between_special_tokens),
            out=OutputText(p.stop, p.stop_regex, p.no_stop_trim),
            info=SamplingInfo(p, generator, sreq.input_ids, sreq.output_ids, stop_ids),
        )
        self.states[req.rid] = state
        if grammar is not None:
            self.constrained.submit(req.rid, grammar)  # joins the scheduler once compiled
        else:
            self.scheduler.add(sreq)
        self._counters["requests"] += 1

    def abort_request(self, rid: str) -> None:
        """Aborts `rid` at any stage, freeing everything it held; its final ReqOutput (finish
        reason "abort") comes with the next `step()`. Unknown ids are ignored."""
        state = self.states.pop(rid, None)
        if state is None:
            return
        self.scheduler.abort(rid)
        self.constrained.drop(rid)
        if self._compiled:
            self._compiled = collections.deque(entry for entry in self._compiled if entry[0] != rid)
        if self.spec is not None:
            self.spec.forget(rid)
        self._pending.append(self._output(state, finished=True, reason={"type": "abort", "message": "aborted"}))

    def has_work(self) -> bool:
        # NOTE: a launch whose requests all ended is not work: the next step lands it first
        return (self.scheduler.has_work() or bool(self._pending) or self.constrained.num_waiting > 0
                or bool(self._compiled)
                or (self._inflight is not None and self._inflight.alive(self.states)))

    # --- the loop ---------------------------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        """One scheduling round with at most one forward; returns the outputs that progressed.

        With the overlap schedule a decode's tokens come with the next call (engine/overlap.py)."""
        trace = self.trace
        if not self.scheduler.running and self._inflight is None:
            trace.idle()  # no running request waits: no gap across this
        start = time.perf_counter()
        self._decode_rows = 0
        try:
            return self._step()
        finally:
            end = time.perf_counter()
            pool = self.constrained.backend.pool_stats
            if pool is not None and pool.receive_s != self._receive_s:
                trace.receive(pool.receive_s - self._receive_s)
                self._receive_s = pool.receive_s
            fill_s = self.constrained.masker.fill_time_s
            if fill_s != self._mask_fill_s:
                trace.mask(fill_s - self._mask_fill_s)
                self._mask_fill_s = fill_s
            rec = trace.step(start, end, self._decode_rows)
            if rec is not None and self.scheduler.admission is not None:
                self.scheduler.admission.observe(rec.decode_rows, rec.prefill_rows, rec.gap_s)

    def _step(self) -> list[ReqOutput]:
        outputs, self._pending = self._pending, []
        prev, self._inflight = self._inflight, None
        self._steps += 1
        if prev is not None:
            blockers = self.constrained.num_chain_blockers() + len(self._compiled)
            if self.overlap and chain_ready(self.scheduler, prev, self.states, blockers):
                rounds, ratio = self.scheduler.num_rounds, self.scheduler.new_token_ratio
                decision = self.constrained.schedule(self.scheduler)
                assert decision.mode == "decode" and not decision.retracted, decision.mode
                ids = next_input_ids(prev, [item.rid for item in decision.items])
                self._inflight = self._launch(decision, ids, rounds, ratio)  # before prev lands
                self._counters["overlap_steps"] += 1
            # NOTE: a chained launch holds a row of every running request: no jump-forward may move one
            self.constrained.hold_jumps = self._inflight is not None
            try:
                outputs.extend(self._land(prev))
            finally:
                self.constrained.hold_jumps = False
            nxt = self._inflight
            if nxt is not None and nxt.needs_sampling:  # grammar rows: masks from the landed tokens
                self._sample_launched(nxt)
            if nxt is not None and not nxt.alive(self.states):  # prev finished every request of nxt
                self._inflight = None
                self._land(nxt)  # nothing to overlap with: lands now (and undoes its schedule)
            # NOTE: a landed launch's tokens go out before any other forward runs: the next call
            # schedules. A mixed step run here would give its rows a second token in the same
            # call, so an abort or a client between the two could no longer stop the second.
            return outputs
        if self.constrained.num_waiting or self._compiled:
            admit_start = time.perf_counter()
            admitted, slowest = self._admit_constrained(outputs)
            self.trace.admission(admitted, time.perf_counter() - admit_start, slowest)
        decision = self.constrained.schedule(self.scheduler)  # = scheduler.schedule() without jump-forward
        if decision.mode == "idle":
            return outputs
        if self.overlap and decision.mode == "decode" and all(
                row_ok(self.states[item.rid], chained=False) for item in decision.items):
            self._inflight = self._launch(decision)
            return outputs
        if self.spec is not None and decision.mode == "decode":
            proposed = self.spec.drafts(decision, self.states)
            drafts = proposed
            if proposed:
                decision, drafts = self.scheduler.add_drafts(decision, proposed)
                self.spec.settle([rid for rid in proposed if rid not in drafts], self.states)
            if drafts:
                return outputs + self._verify(decision, drafts)
        start = time.perf_counter()
        prefill = [item for item in decision.items if decision.mode == "extend"
                   and self.scheduler.reqs[item.rid].status == ReqStatus.PREFILLING]
        mm_rows = self.mm.rows(decision, lambda rid: self.states[rid].sreq) \
            if self.mm is not None and decision.mode == "extend" else []
        # NOTE: mm_rows only when there are some: a TP-wrapped runner (no images) takes no such argument
        logits = self.runner.forward(decision, mm_rows=mm_rows) if mm_rows else self.runner.forward(decision)
        if self.spec is not None:  # an EAGLE head reads the features of every computed token
            self.spec.observe(decision, self.runner.last_hidden)
        self._counters["forwards"] += 1
        self._counters["forward_tokens"] += decision.num_tokens
        outputs.extend(self._process(decision, logits))  # NOTE: waits for the sampled tokens
        self.trace.forward(time.perf_counter() - start, len(prefill), sum(len(item.token_ids) for item in prefill))
        if decision.paced_prefill_tokens and self.scheduler.pacer is not None:
            now = time.perf_counter()
            last_step, last_end = self._paced_end
            self.scheduler.pacer.observe(decision.paced_prefill_tokens,
                                         now - (last_end if last_step == self._steps - 1 else start))
            self._paced_end = (self._steps, now)
        if decision.mode == "extend":
            self._counters["extend_forwards"] += 1
            self._counters["extend_time_s"] += time.perf_counter() - start
        return outputs

    def _verify(self, decision: ScheduleDecision, drafts: dict[str, list[int]]) -> list[ReqOutput]:
        """Runs a verify forward (a decode CUDA graph of one row per new token where one fits,
        else the eager extend forward) and accepts the drafts (Speculator.verify)."""
        assert self.spec is not None
        # NOTE: not under TP: the followers mirror the broadcast decision with an eager forward of their own
        graphs = self.runner.cuda_graph if self.tp is None else None
        states = [self.states[item.rid] for item in decision.items]
        logits: torch.Tensor | None = None
        argmax: torch.Tensor | None = None
        if graphs is not None and graphs.can_verify(decision):
            # NOTE: every row's token is its raw argmax (greedy drafted rows, greedy plain rows, nothing masking or
            # recording them): the graph's own argmax, no logits copied out
            if all(takes_argmax(s.info) and s.grammar is None and not s.req.return_logprob for s in states):
                argmax = graphs.forward_verify(decision, greedy=True)
            else:
                logits = graphs.forward_verify(decision, greedy=False)
        else:
            logits = self.runner.forward(decision)
        self._counters["forwards"] += 1
        self._counters["forward_tokens"] += decision.num_tokens

        def sample_plain(rows: list[int], plain: list[Any]) -> list[ReqOutput]:
            if logits is not None:
                return self._sample_rows(logits, rows, plain)
            assert argmax is not None
            tokens = argmax.index_select(0, to_device(rows, torch.long, argmax.device)).tolist()
            return self._append_sampled(list(zip(plain, tokens, strict=True)))

        rows = logits if logits is not None else argmax
        assert rows is not None
        return self.spec.verify(decision, drafts, rows, self.states,
                                self.scheduler, sample_plain, lambda state, token: self._append_sampled([(state, token)]),
                                argmax=argmax is not None, hidden=self.runner.last_hidden,
                                record_logprobs=lambda state, row, token: self._record_output_logprobs(
                                    row, [state], [token]),
                                mask_rows=self.constrained.mask_rows)

    def _launch(self, decision: ScheduleDecision, input_ids: torch.Tensor | None = None,
                rounds_before: int = 0, ratio_before: float = 0.0) -> Launched:
        """Runs a decode forward and samples on the device without waiting for it. With
        `input_ids` (a chained launch) the previous launch has not landed: its requests' KV is one
        slot ahead of their host tokens until it does."""
        states = [self.states[item.rid] for item in decision.items]
        infos = [s.info for s in states]
        graphs = self.runner.cuda_graph
        masked = any(s.grammar is not None for s in states)
        ids = None
        if not masked and graphs is not None and graphs.can_run(decision) and all(takes_argmax(info) for info in infos):
            ids = graphs.forward_greedy(decision, input_ids)  # the graph's own argmax: no logits copied out
        chained = input_ids is not None
        if ids is None:
            logits = self.runner.forward(decision, input_ids=input_ids)
            if masked:  # sampled once the grammars saw the previous tokens: at once unless chained
                self._counters["forwards"] += 1
                self._counters["forward_tokens"] += decision.num_tokens
                self.scheduler.commit(decision)
                launched = Launched.unsampled(decision, states, logits, chained, rounds_before, ratio_before)
                if not chained:
                    self._sample_launched(launched)
                else:
                    self._counters["overlap_grammar_steps"] += 1
                return launched
            ids = sample_tensor(apply_penalties(logits, infos), infos)
        self._counters["forwards"] += 1
        self._counters["forward_tokens"] += decision.num_tokens
        self.scheduler.commit(decision)  # a decode: nothing to insert (kept for the call order)
        return Launched.start(decision, states, ids, chained, rounds_before, ratio_before)

    def _sample_launched(self, launched: Launched) -> None:
        """Delayed sampling of a launch with grammar rows (engine/overlap.py): penalties and masks
        from the host state now (the previous launch landed), then sampling on the device and the
        tokens' host copy. Rows of requests that ended meanwhile are sampled unmasked (thrown
        away when the launch lands)."""
        logits = launched.logits
        assert logits is not None
        states = launched.states
        live = [self.states.get(s.req.rid) is s for s in states]
        infos = [s.info for s in states]
        grammars = [s.grammar if ok else None for s, ok in zip(states, live, strict=True)]
        with torch.inference_mode():  # masked in place: the forward's own logits
            processed = apply_penalties(logits, infos)
            if any(g is not None for g in grammars):
                self.constrained.mask_rows(processed, grammars)
            launched.set_ids(sample_tensor(processed, infos))

    def _land(self, launched: Launched) -> list[ReqOutput]:
        """Appends a launched decode's tokens on the host; rows of requests that ended since the
        launch (finished by the previous step, aborted) are thrown away."""
        tokens = launched.tokens()
        live = [(s, t) for s, t in zip(launched.states, tokens, strict=True) if self.states.get(s.req.rid) is s]
        self._counters["overlap_discarded_tokens"] += len(tokens) - len(live)
        if not live:
            if launched.chained:
                launched.undo_phantom(self.scheduler)
            return []
        return self._append_sampled(live)

    def _append_sampled(self, rows: list[tuple[ReqState, int]]) -> list[ReqOutput]:
        """Appends one sampled token per (request, token) row; counts them; returns the outputs."""
        self._recent.append((time.monotonic(), len(rows)))
        self._counters["generation_tokens"] += len(rows)
        outputs: list[ReqOutput] = []
        for state, token in rows:
            self._decode_rows += len(state.sreq.output_ids) > 0  # not its first token
            out = self._append_token(state, token)
            if out is not None:
                outputs.append(out)
        return outputs

    def _admit_constrained(self, outputs: list[ReqOutput]) -> tuple[int, tuple[str, float] | None]:
        """Moves requests whose grammar compiled from the grammar stage to the scheduler (after
        a jump-forward over text forced from the start); failed grammars finish with an error
        (appended to `outputs`). Returns how many requests left the grammar stage, and the slowest
        one's (request id, seconds) for the step trace. While requests run, stops after
        GRAMMAR_ADMIT_BUDGET_S (at least one each step); the rest wait in order. (The masks an
        admission reads were computed off this thread: compile_worker.warm_admission.)"""
        done = 0
        slowest: tuple[str, float] | None = None
        if self.constrained.num_waiting:
            wait_s = 0.0 if self.scheduler.has_work() or self._compiled else 0.005
            self._compiled.extend(self.constrained.poll(wait_s))
        end = time.perf_counter() + GRAMMAR_ADMIT_BUDGET_S if self.scheduler.running else float("inf")
        while self._compiled:
            if done and time.perf_counter() >= end:
                break
            rid, result = self._compiled.popleft()
            state = self.states.get(rid)
            if state is None:
                continue
            done += 1
            start = time.perf_counter()
            self._admit_one(outputs, state, result)
            spent = time.perf_counter() - start
            if slowest is None or spent > slowest[1]:
                slowest = (rid, spent)
        return done, slowest

    def _admit_one(self, outputs: list[ReqOutput], state: ReqState, result: Any) -> None:
        """`_admit_constrained` of one request: fails it, finishes it, or hands it to the scheduler."""
        rid = state.req.rid
        if isinstance(result, Exception):
            self.states.pop(rid, None)
            outputs.append(self.constrained.error_output(rid, result))
            return
        state.grammar = self.constrained.make_grammar(result, allow_jump_forward=not state.req.return_logprob)
        if state.grammar.is_stuck():  # nothing this vocabulary spells matches the start: a bad request
            self.states.pop(rid, None)
            outputs.append(self.constrained.error_output(rid, ValueError(f"{STUCK_MESSAGE} (at its start)")))
            return
        reason = self.constrained.advance_jump(self.scheduler, state)
        if reason is None and state.sreq.max_new_tokens > 0 and state.sreq.remaining_new_tokens == 0:
            reason = {"type": "length", "length": state.sreq.max_new_tokens}
        if reason is not None:
            outputs.append(self._finish(state, reason))
        else:
            self.scheduler.add(state.sreq)

    def _process(self, decision: ScheduleDecision, logits: torch.Tensor) -> list[ReqOutput]:
        row = 0
        sample_rows: list[int] = []
        sample_states: list[ReqState] = []
        input_lp_rows: list[tuple[ReqState, int, int]] = []  # (state, logits row, token position)
        for item in decision.items:
            state = self.states[item.rid]
            sreq = state.sreq
            n_rows = len(item.logit_offsets)
            samples = item.prefix_len + len(item.token_ids) == sreq.fill_len
            for k, off in enumerate(item.logit_offsets):
                pos = item.prefix_len + off
                if sreq.need_input_logprobs and pos + 1 < len(sreq.input_ids):
                    input_lp_rows.append((state, row + k, pos + 1))
            if samples and sreq.remaining_new_tokens > 0:
                sample_rows.append(row + n_rows - 1)
                sample_states.append(state)
            row += n_rows
        masked = any(s.grammar is not None for s in sample_states)
        if masked:
            # NOTE: the masks are filled (and copied) here, while the device runs the forward:
            # nothing before sampling's read-back waits for the device
            self.constrained.prepare_masks(sample_states, logits.device)
        completed = self.scheduler.commit(decision)
        if input_lp_rows:
            self._record_input_logprobs(logits, input_lp_rows)
        outputs: list[ReqOutput] = []
        if sample_rows:
            outputs.extend(self._sample_rows(logits, sample_rows, sample_states, masks_ready=True))
        for sreq in completed:
            done_state = self.states.get(sreq.rid)
            if done_state is None:
                continue
            grammar = done_state.grammar  # a jump-forward re-prefill is not a new prompt either
            if sreq.num_retractions == 0 and (grammar is None or grammar.num_prefills == 0):
                self._counters["prompt_tokens"] += len(sreq.input_ids)
                self._counters["cached_tokens"] += sreq.cached_tokens
            if grammar is not None:
                grammar.num_prefills += 1
            if sreq.max_new_tokens == 0 and not done_state.finished:
                outputs.append(self._finish(done_state, {"type": "length", "length": 0}))
        return outputs

    def _sample_rows(self, logits: torch.Tensor, rows: list[int], states: list[ReqState],
                     masks_ready: bool = False) -> list[ReqOutput]:
        """Samples one token for each state from its logits row (penalties, grammar masks,
        logprobs) and appends it; returns the outputs."""
        masked = any(s.grammar is not None for s in states)
        if masked and not masks_ready:
            self.constrained.prepare_masks(states, logits.device)
        # NOTE: a list index would copy it from pageable memory, which waits for the forward
        raw = logits if len(rows) == logits.shape[0] else logits.index_select(
            0, to_device(rows, torch.long, logits.device))
        infos = [s.info for s in states]
        processed = apply_penalties(raw, infos)
        want_lp = [s for s in states if s.req.return_logprob]
        if masked:
            if processed is raw and want_lp:
                processed = raw.clone()  # logprobs stay those of the model
            with torch.inference_mode():  # masked in place: `raw` may be the forward's logits
                self.constrained.apply_masks(processed, states)
        next_ids = sample(processed, infos)
        if want_lp:
            self._record_output_logprobs(raw, states, next_ids)
        return self._append_sampled(list(zip(states, next_ids, strict=True)))

    def _record_input_logprobs(self, logits: torch.Tensor, rows: list[tuple[ReqState, int, int]]) -> None:
        idx = [r for _, r, _ in rows]
        tokens = [s.sreq.input_ids[p] for s, _, p in rows]
        lp = torch.log_softmax(logits[idx], dim=-1)
        chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None]).squeeze(1).tolist()
        tops = self._top_logprobs(lp, [s.req.top_logprobs_num for s, _, _ in rows], [s.req for s, _, _ in rows])
        for (state, _, pos), value, top in zip(rows, chosen, tops, strict=True):
            state.input_logprobs.append(self._lp_entry(value, state.sreq.input_ids[pos], state.req))
            state.input_top.append(top)

    def _record_output_logprobs(self, raw: torch.Tensor, states: list[ReqState], next_ids: list[int]) -> None:
        lp = torch.log_softmax(raw, dim=-1)
        chosen = lp.gather(1, torch.tensor(next_ids, device=lp.device)[:, None]).squeeze(1).tolist()
        tops = self._top_logprobs(lp, [s.req.top_logprobs_num for s in states], [s.req for s in states])
        for state, token, value, top in zip(states, next_ids, chosen, tops, strict=True):
            if state.req.return_logprob:
                state.out_logprobs.append(self._lp_entry(value, token, state.req))
                state.out_top.append(top)

    def _top_logprobs(self, lp: torch.Tensor, nums: list[int], reqs: list[GenerateReq]) -> list[list[TokenLogprob] | None]:
        k = max(nums, default=0)
        if k <= 0:
            return [None] * len(nums)
        values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        values_l, ids_l = values.tolist(), ids.tolist()
        out: list[list[TokenLogprob] | None] = []
        for i, n in enumerate(nums):
            out.append([self._lp_entry(v, t, reqs[i]) for v, t in zip(values_l[i][:n], ids_l[i][:n], strict=True)] if n > 0 else None)
        return out

    def _lp_entry(self, value: float | None, token: int, req: GenerateReq) -> TokenLogprob:
        text = str(self.tokenizer.decode([token])) if req.return_text_in_logprobs else None
        return (value, int(token), text)

    def _append_token(self, state: ReqState, token: int) -> ReqOutput | None:
        sreq = state.sreq
        p = sreq.sampling_params
        sreq.output_ids.append(token)
        num_out = len(sreq.output_ids)
        reason: dict[str, Any] | None = None
        can_stop = num_out >= p.min_new_tokens
        if can_stop and token in state.info.stop_ids:
            reason = {"type": "stop", "matched": token}
            if p.no_stop_trim:
                state.out.append(state.detok.add(token), check_stop=False)
        else:
            matched = state.out.append(state.detok.add(token), check_stop=can_stop)
            if matched is not None:
                reason = {"type": "stop", "matched": matched}
        if reason is None and state.grammar is not None:
            reason = self.constrained.after_token(self.scheduler, state, token)  # may jump forward
        if reason is None and len(sreq.output_ids) >= sreq.max_new_tokens:
            reason = {"type": "length", "length": sreq.max_new_tokens}
        if reason is not None:
            return self._finish(state, reason)
        return self._output(state, finished=False)

    def _finish(self, state: ReqState, reason: dict[str, Any]) -> ReqOutput:
        ahead = self._inflight
        row = ahead.row_of.get(state.req.rid) if ahead is not None and ahead.chained else None
        if ahead is not None and row is not None and ahead.states[row] is state:
            # NOTE: the in-flight decode took a slot for this request's last token; give it back
            # first, so the release caches what the serial path would (see engine/overlap.py)
            sreq = state.sreq
            sreq.kv_len -= 1
            sreq.table_valid_len = min(sreq.table_valid_len, sreq.kv_len)
        if state.out.stopped is None:
            # held-back text (an incomplete UTF-8 tail) is final now; it may complete a stop string
            can_stop = len(state.sreq.output_ids) >= state.sreq.sampling_params.min_new_tokens
            state.out.append(state.detok.flush(), check_stop=can_stop and reason["type"] == "length")
            if state.out.stopped is not None:
                reason = {"type": "stop", "matched": state.out.stopped}
        self.scheduler.finish(state.sreq, reason)
        if self.mm is not None:
            self.mm.record_finished(state.sreq)
        if self.spec is not None:
            self.spec.forget(state.req.rid)
        self.states.pop(state.req.rid, None)
        return self._output(state, finished=True, reason=reason)

    def _output(self, state: ReqState, finished: bool, reason: dict[str, Any] | None = None) -> ReqOutput:
        state.finished = finished
        sreq = state.sreq
        new_ids = sreq.output_ids[state.sent_tokens :]
        state.sent_tokens = len(sreq.output_ids)
        out = ReqOutput(
            rid=state.req.rid,
            new_token_ids=new_ids,
            new_text=state.out.take(final=finished),
            finished=finished,
            finish_reason=reason,
            prompt_tokens=len(sreq.input_ids),
            completion_tokens=len(sreq.output_ids),
            cached_tokens=sreq.cached_tokens,
            output_token_logprobs=state.out_logprobs,
            output_top_logprobs=state.out_top,
            jump_forward_tokens=state.grammar.jump_forward_tokens if state.grammar is not None else 0,
            rollback_tokens=state.rollback_tokens,
            grammar_approximations=state.grammar.take_approximations() if state.grammar is not None else None,
        )
        state.out_logprobs, state.out_top, state.rollback_tokens = [], [], 0
        if state.req.return_logprob and not state.input_sent:
            # NOTE: the first output of a request comes after its prefill completed (or at abort)
            if state.req.logprob_start_len == 0:  # the first prompt token has no logprob
                state.input_logprobs.insert(0, self._lp_entry(None, sreq.input_ids[0], state.req))
                state.input_top.insert(0, None)
            out.input_token_logprobs = state.input_logprobs
            out.input_top_logprobs = state.input_top
            state.input_sent = True
            sreq.need_input_logprobs = False
            sreq.logprob_start_len = -1  # lifts the prefix-reuse cap after a retraction
        return out

    # --- maintenance ------------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Empties the radix cache (and the vision-encoder cache); False (nothing done) while
        requests run or wait."""
        flushed = self.scheduler.flush_cache()
        if flushed and self.mm is not None:
            self.mm.cache.clear()
        return flushed

    def check_memory_invariant(self) -> None:
        """Raises MemoryInvariantError when idle and free + cached != total KV slots."""
        if not self.states:
            self.scheduler.check_memory_invariant()

    def get_step_trace(self) -> dict[str, Any]:
        """The last `step_trace` records of the running requests' gaps (engine/step_trace.py), as
        rows of their field names (none with step_trace 0)."""
        return self.trace.rows()

    def get_stats(self) -> dict[str, Any]:
        """Scheduler state, token counters, cache hit rate and recent generation throughput."""
        now = time.monotonic()
        self._recent = [(t, n) for t, n in self._recent if now - t <= 10.0]
        window = min(10.0, max(now - self._started, 1e-6))
        c = self._counters
        stats = dict(self.scheduler.stats())
        stats.update(c)
        stats["cache_hit_rate"] = c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
        stats["gen_throughput"] = sum(n for _, n in self._recent) / window
        stats["context_length"] = self.context_length
        pool = self.kv_pool
        stats["kv_pool_bytes"] = pool.num_slots * pool.bytes_per_slot(pool.num_layers, pool.num_kv_heads,
                                                                      pool.head_dim, pool.dtype)
        stats.update(self.constrained.stats)
        stats.update(self.constrained.mask_time_stats())
        stats.update(self.trace.stats())
        if self.mm is not None:
            stats.update(self.mm.stats())
        if self.spec is not None:
            stats.update(self.spec.stats())
        if self.lowlat is not None:
            rep = self.lowlat.report()
            stats["lowlat_plugin_steps"] = rep["plugin_steps"]
            stats["lowlat_fallback_steps"] = sum(rep["fallbacks"].values())
            for kind, n in rep["plugin_steps_by_kind"].items():
                stats[f"lowlat_plugin_steps_{kind}"] = n
        graphs = self.runner.cuda_graph
        if graphs is not None:
            stats["cuda_graph_replays"] = graphs.num_replays
            stats["cuda_graph_verify_replays"] = graphs.num_verify_replays
            stats["cuda_graph_extend_replays"] = graphs.num_extend_replays
        prefill_graphs = getattr(self.runner, "prefill_graph", None)  # NOTE: a TP-wrapped runner has none
        if prefill_graphs is not None:
            stats["prefill_graph_replays"] = prefill_graphs.num_replays
            stats["prefill_graph_image_replays"] = prefill_graphs.num_image_replays
        return stats
