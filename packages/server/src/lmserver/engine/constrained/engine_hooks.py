"""`ConstrainedDecoding`: what `EngineCore` calls for constrained requests.

- a grammar stage: a constrained request waits here (not in the scheduler) until its grammar is
  compiled; a bad grammar or a compile timeout finishes it with `ReqOutput.error`;
- the batch bitmask on the sampling rows (unconstrained rows untouched);
- after each sampled token: advance the guide, finish when the grammar is complete, and
  jump-forward: retokenize, roll back to the common token prefix, and put the request back into
  prefill (its kept prefix is a radix-cache hit) with the detokenizer and stop checks resynced;
- the jump-forward policy (`policy.JumpPolicy`): a jump that needs an extend round of its own
  is made only when it saves enough decode rounds; such jumps wait for `schedule()`, which
  weighs all of a round's jumps together (they share one extend round).

The engine-side request state is duck-typed (`EngineCore`'s `ReqState`): `req`, `sreq`,
`detok`, `out`, `grammar`, `sent_tokens`, `rollback_tokens`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from lmserver.engine.constrained.backend import (
    DEFAULT_MAX_LENGTH,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    GrammarTicket,
    grammar_key,
)
from lmserver.engine.constrained.bitmask import BatchMasker
from lmserver.engine.constrained.grammar import STUCK_MESSAGE, JumpForward, ReqGrammar
from lmserver.engine.constrained.policy import JumpPolicy, parse_min_tokens
from lmserver.io_struct import ReqOutput, SamplingParams
from lmserver.scheduler import Req, ReqStatus, ScheduleDecision, Scheduler

__all__ = ["ConstrainedDecoding"]

logger = logging.getLogger(__name__)

IndexOrError = Any  # cfsm.Index (ready) or GrammarError (failed)

# the detokenizer re-decodes this many kept tokens before a jump to find the new text
_DECODE_CONTEXT = 4
# forced texts whose jump size is remembered (ConstrainedDecoding._sizes)
_SIZE_CACHE = 4096


class ConstrainedDecoding:
    """Grammar stage, masks and jump-forward for one `EngineCore`. Single-threaded use (the
    compile workers live inside `GrammarBackend`)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *,
                 disable_jump_forward: bool = False, compile_timeout_s: float = 30.0,
                 jump_forward_min_tokens: int | str = "auto", device: str | torch.device | None = None,
                 compile_workers: int = -1, max_pending_compiles: int = 256, strict: bool = False,
                 max_grammar_length: int = DEFAULT_MAX_LENGTH) -> None:
        self.backend = GrammarBackend(tokenizer, vocab_size, eos_token_ids, compile_timeout_s=compile_timeout_s,
                                      compile_workers=compile_workers, max_pending=max_pending_compiles)
        self.strict = strict  # the default of a request's json_schema_strict
        self.max_grammar_length = max_grammar_length
        self.masker = BatchMasker(vocab_size)
        self.jump_forward = not disable_jump_forward
        parse_min_tokens(jump_forward_min_tokens)  # raises ValueError now, not at the first jump
        self.jump_forward_min_tokens = jump_forward_min_tokens
        self._device_type = None if device is None else torch.device(device).type
        self._policy: JumpPolicy | None = None
        self._policy_key: tuple[int | str, str | None] | None = None
        self._waiting: dict[str, GrammarTicket] = {}
        self._rewound: set[str] = set()  # requests sent back to prefill by a jump-forward
        # jumps the policy left to the next schedule(): rid -> (state, plan or None (planned
        # there), its net new tokens (estimated without a plan), len(output_ids) at the decision)
        self._deferred: dict[str, tuple[Any, JumpForward | None, int, int]] = {}
        # (id of the grammar index, forced text) -> (net new tokens, the grammar ends after it),
        # from earlier plans; only for estimates (an evicted index's id may come back)
        self._sizes: OrderedDict[tuple[int, str], tuple[int, bool]] = OrderedDict()
        # True while the engine lands a decode with a chained launch in flight (engine/overlap.py):
        # that launch holds a row of every running request, so no jump may move one (declined)
        self.hold_jumps = False
        self.stats = {"jump_forward_tokens": 0, "jump_forward_steps": 0, "jump_forward_declined": 0,
                      "grammar_errors": 0}

    @property
    def policy(self) -> JumpPolicy:
        """The jump-forward policy; "auto" is resolved by the device of the logits (known from
        the first mask, which comes before any decision that depends on it)."""
        key = (self.jump_forward_min_tokens, self._device_type)
        if self._policy is None or self._policy_key != key:  # NOTE: the bench changes the option live
            self._policy = JumpPolicy.for_device(self.jump_forward_min_tokens, self._device_type or "cpu")
            self._policy_key = key
        return self._policy

    # --- grammar stage ----------------------------------------------------------------------------

    def grammar_key(self, params: SamplingParams) -> GrammarKey | None:
        """The grammar of a request, with this server's defaults (`backend.grammar_key`). Raises
        GrammarError for a bad one. Pure."""
        return grammar_key(params, strict=self.strict, max_length=self.max_grammar_length)

    def submit(self, rid: str, key: GrammarKey) -> None:
        """Queues `rid` until `key` is compiled (a refused compile, e.g. a full queue, comes back
        failed from `poll`). Mutates the grammar queue."""
        self._waiting[rid] = self.backend.submit(key)

    def drop(self, rid: str) -> None:
        """Forgets `rid` (abort at any stage). Mutates the grammar queue and deferred jumps."""
        self._waiting.pop(rid, None)
        self._deferred.pop(rid, None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def num_chain_blockers(self) -> int:
        """Grammar-stage events the next schedule must see (a chained launch would skip them):
        deferred jumps, plus 1 when some request's compile ended (ready, failed or past its
        deadline). Compiles still running block nothing. Pure (reads the futures and the clock)."""
        n = len(self._deferred)
        if self._waiting:
            now = self.backend.clock()
            n += any(t.future.done() or now >= t.deadline for t in self._waiting.values())
        return n

    def mask_time_stats(self) -> dict[str, float]:
        """The batch masker's host-time counters (seconds) and row counts, and the compile pool's
        counters (`compile_*`: workers started / killed / died, compiles done / failed, the
        dispatcher's CPU seconds receiving results, its longest receive, compiles queued or running),
        for `get_stats`. Pure."""
        m = self.masker
        out: dict[str, float] = {
            "mask_prepare_s": m.prepare_time_s, "mask_apply_s": m.apply_time_s, "mask_fill_s": m.fill_time_s,
            "mask_rows": m.num_masked_rows, "mask_stale_rows": m.num_stale_rows}
        pool = self.backend.pool_stats
        if pool is not None:
            out.update({"compile_workers_started": pool.started, "compile_workers_killed": pool.killed,
                        "compile_workers_died": pool.died, "compile_done": pool.compiled, "compile_failed": pool.failed,
                        "compile_receive_s": pool.receive_s, "compile_max_receive_s": pool.max_receive_s,
                        "compile_pending": self.backend.num_pending})
        return out

    def poll(self, wait_s: float = 0.0) -> list[tuple[str, IndexOrError]]:
        """Requests whose grammar is ready (index) or failed (GrammarError), in arrival order;
        waits up to `wait_s` for a first one. Mutates the grammar queue."""
        if wait_s > 0 and self._waiting:
            self.backend.wait(list(self._waiting.values()), wait_s)
        done: list[tuple[str, IndexOrError]] = []
        for rid, ticket in list(self._waiting.items()):
            try:
                index = self.backend.result(ticket)
            except GrammarError as exc:
                self.stats["grammar_errors"] += 1
                done.append((rid, exc))
                del self._waiting[rid]
                continue
            if index is not None:
                done.append((rid, index))
                del self._waiting[rid]
        return done

    def make_grammar(self, index: Any, *, allow_jump_forward: bool = True) -> ReqGrammar:
        """A fresh per-request grammar over a compiled index."""
        return ReqGrammar(index, self.backend.encode, jump_forward=self.jump_forward and allow_jump_forward)

    @staticmethod
    def error_output(rid: str, error: Exception) -> ReqOutput:
        msg = str(error)
        return ReqOutput(rid=rid, new_token_ids=[], new_text="", finished=True,
                         finish_reason={"type": "abort", "message": msg}, error=msg,
                         error_status=int(getattr(error, "status", 400)))

    def shutdown(self) -> None:
        """Stops the grammar compile workers (requests still waiting for a grammar fail)."""
        self.backend.shutdown()

    # --- scheduling ----------------------------------------------------------------------------------

    def schedule(self, scheduler: Scheduler) -> ScheduleDecision:
        """`scheduler.schedule()`, after the deferred jumps of the last round were made or
        declined (`JumpPolicy.batch`); while jump-forward requests wait for their extend and
        others decode, the round is a mixed batch (their new tokens ride along with the decodes)
        instead of an extend round that pauses every other request. Mutates as
        `Scheduler.schedule`, and the requests that jump."""
        if self._deferred:
            self._run_deferred(scheduler)
        if self._rewound:
            self._rewound &= {r.rid for r in scheduler.prefilling}
        if not self._rewound or not scheduler.running or scheduler.enable_mixed_chunk:
            return scheduler.schedule()
        scheduler.enable_mixed_chunk = True
        try:
            return scheduler.schedule()
        finally:
            scheduler.enable_mixed_chunk = False

    # --- sampling -----------------------------------------------------------------------------------

    def prepare_masks(self, states: Sequence[Any], device: torch.device) -> None:
        """Fills the mask of the sampling rows `states` (and on CUDA starts its copy) while the
        device runs the forward; `apply_masks` on the same rows then only launches the apply.
        The grammar states are final here: tokens were accepted and jumps made (`after_token`,
        `schedule()`) before the forward was scheduled; a row whose state still moves is
        refilled by `apply_masks` (BatchMasker's invariant)."""
        self._device_type = device.type
        self.masker.prepare([s.grammar for s in states], device)

    def mask_rows(self, logits: torch.Tensor, grammars: Sequence[ReqGrammar | None]) -> torch.Tensor:
        """Fills and applies the masks of `grammars` (row i of `logits` (B, V); None: unmasked)
        at once: the delayed sampling of a chained launch, whose forward already runs. Mutates
        `logits` in place; returns it."""
        self._device_type = logits.device.type
        self.masker.prepare(grammars, logits.device)
        return self.masker.apply(logits, grammars)

    def apply_masks(self, logits: torch.Tensor, states: Sequence[Any]) -> torch.Tensor:
        """Masks the rows of constrained `states` in `logits` (B, V), in place; returns it."""
        self._device_type = logits.device.type
        return self.masker.apply(logits, [s.grammar for s in states])

    # --- after a sampled token ----------------------------------------------------------------------

    def after_token(self, scheduler: Scheduler, state: Any, token: int) -> dict[str, Any] | None:
        """Advances the guide over `token` (already appended to the output) and jumps forward.

        Returns a finish reason (grammar complete, stop string in forced text, rejected token)
        or None. Mutates the grammar, the request's tokens and KV placement, and its text.
        """
        g: ReqGrammar = state.grammar
        if not g.accept(token):
            logger.warning("request %s: grammar rejected sampled token %d", state.req.rid, token)
            return {"type": "abort", "message": f"the grammar rejected sampled token {token}"}
        return self.advance_jump(scheduler, state)

    def advance_jump(self, scheduler: Scheduler, state: Any) -> dict[str, Any] | None:
        """Jump-forward from the guide's state if text is forced and the policy makes the jump
        now (also at admission, before any token); a jump the policy defers waits for the next
        `schedule()`. Returns a finish reason or None. Mutates as `after_token`."""
        g: ReqGrammar = state.grammar
        self._deferred.pop(state.req.rid, None)
        if g.is_finished():
            return {"type": "stop", "matched": None}
        if g.is_stuck():  # the output so far is valid; a sampled token could only be rejected
            return {"type": "abort", "message": STUCK_MESSAGE}
        if not g.jump_forward_enabled:  # nothing is ever forced (a per-token fast path)
            return None
        sreq = state.sreq
        p = sreq.sampling_params
        decoding = sreq.status == ReqStatus.RUNNING
        if decoding and self.hold_jumps:  # a chained launch holds its row: the mask forces the text instead
            return None
        deferrable = not (p.stop or p.stop_regex)
        extend_pending = bool(scheduler.prefilling)
        remaining = sreq.max_new_tokens - len(sreq.output_ids)
        if decoding and deferrable and not extend_pending and not self.policy.always:
            # NOTE: a jump that may be declined is not retokenized (about 0.1-0.3 ms of host
            # time) when its size is known: the rest of this request's declined forced text, or
            # the same forced text planned before (a batch over one schema); it is planned when
            # a round's jumps are made. Estimates never change what is appended.
            estimate = self._estimate_after_decline(g, len(sreq.output_ids))
            if estimate is None:
                known = self._sizes.get((id(g.index), g.forced_text()))
                if known is not None and not known[1]:
                    estimate = min(known[0], remaining - 1)
            if estimate is not None:
                if estimate >= 1:
                    self._defer(scheduler, state, None, estimate)
                return None
        jump = g.plan_jump(sreq.output_ids, remaining)
        if jump is None:
            return None
        self._remember_size(g, jump)
        ends = jump.ends_request(remaining)
        decision = self.policy.now(jump.num_new_tokens, decoding=decoding, ends_request=ends,
                                   extend_pending=extend_pending, deferrable=deferrable)
        if decision == "defer":
            if not self._defer(scheduler, state, jump, jump.num_new_tokens):
                g.declined = (g.forced_text(), jump.num_new_tokens, len(sreq.output_ids))  # later steps estimate
            return None
        if decision == "skip":
            self.stats["jump_forward_declined"] += 1
            g.declined = (g.forced_text(), jump.num_new_tokens, len(sreq.output_ids))
            return None
        return self._jump(scheduler, state, jump)

    def _defer(self, scheduler: Scheduler, state: Any, jump: JumpForward | None, new_tokens: int) -> bool:
        """Leaves a running request's jump to the next `schedule()` (True), unless the SLO admission's
        credit cannot pay for an extend round of its own now (False: the mask forces the text token by
        token). NOTE: a deferred jump stops the overlap chain for a step; one the credit would decline
        anyway, deferred again at each token of its forced text, kept every such step serial."""
        budget = scheduler.admission
        if budget is not None and not scheduler.prefilling and not budget.extend_affordable(
                len(scheduler.running), len(self._deferred) + 1):
            return False
        self._deferred[state.sreq.rid] = (state, jump, new_tokens, len(state.sreq.output_ids))
        return True

    def _remember_size(self, g: ReqGrammar, jump: JumpForward) -> None:
        """Records the net tokens of the jump over `jump.text` and whether it ends the grammar.
        Mutates the size cache (bounded)."""
        key = (id(g.index), jump.text)
        self._sizes[key] = (jump.num_new_tokens, jump.finishes)
        self._sizes.move_to_end(key)
        if len(self._sizes) > _SIZE_CACHE:
            self._sizes.popitem(last=False)

    @staticmethod
    def _estimate_after_decline(g: ReqGrammar, num_output: int) -> int | None:
        """Net new tokens of a jump now, estimated from the last declined jump when the forced
        text is still the rest of that one (each token written since covers at least one of its
        tokens), or None (plan it). Clears a stale record. Mutates `g.declined`."""
        if g.declined is None:
            return None
        forced = g.forced_text()
        text, n, n_out = g.declined
        if forced and len(forced) < len(text) and text.endswith(forced) and num_output > n_out:
            return n - (num_output - n_out)
        g.declined = None
        return None

    def _run_deferred(self, scheduler: Scheduler) -> None:
        """Makes or declines (all together) the jumps deferred in the last round. Mutates the
        deferred set and, for the jumps made, as `_jump`."""
        deferred, self._deferred = self._deferred, {}
        # NOTE: a deferred request may have finished (length) or been aborted since its plan
        live = [(st, j, n) for st, j, n, n_out in deferred.values() if self._unchanged(scheduler, st.sreq, n_out)]
        if not live:
            return
        waiting_admissible = bool(scheduler.waiting) and scheduler.can_admit
        extend_pending = bool(scheduler.prefilling) or waiting_admissible
        budget = scheduler.admission  # SLO admission: a jump's own extend round must be paid for, as an admission's
        unpaid = (budget is not None and not extend_pending
                  and not budget.extend_affordable(len(scheduler.running), len(live)))
        if unpaid or not self.policy.batch([n for _, _, n in live], len(scheduler.running),
                                           extend_pending=extend_pending):
            self.stats["jump_forward_declined"] += len(live)
            for st, _, n in live:
                if st.grammar.declined is None:  # later steps of its forced text estimate from it
                    st.grammar.declined = (st.grammar.forced_text(), n, len(st.sreq.output_ids))
            return
        for st, j, _ in live:
            st.grammar.declined = None
            if j is None:
                sreq = st.sreq
                remaining = sreq.max_new_tokens - len(sreq.output_ids)
                j = st.grammar.plan_jump(sreq.output_ids, remaining)
                if j is not None:
                    self._remember_size(st.grammar, j)
                if j is None or j.ends_request(remaining):
                    continue  # NOTE: an ending jump must come with a sampled token (EngineCore finishes it)
            reason = self._jump(scheduler, st, j)
            # NOTE: deferrable jumps neither end the grammar nor match stops; one that leaves it stuck (a pattern
            # character no token spells) is reported here and the request ends at its next token
            if reason is not None:  # pragma: no cover
                logger.warning("request %s: deferred jump-forward ended it (%s); it ends at its next token",
                               st.req.rid, reason)

    @staticmethod
    def _unchanged(scheduler: Scheduler, sreq: Req, num_output: int) -> bool:
        """True when `sreq` still runs with the `num_output` output tokens its plan was made on."""
        return (scheduler.reqs.get(sreq.rid) is sreq and sreq.status == ReqStatus.RUNNING
                and len(sreq.output_ids) == num_output)

    def _jump(self, scheduler: Scheduler, state: Any, jump: JumpForward) -> dict[str, Any] | None:
        """Applies `jump` to the request: guide, tokens (and KV placement via `Scheduler.rewind`),
        detokenizer and text. Returns a finish reason or None."""
        g: ReqGrammar = state.grammar
        sreq = state.sreq
        old = list(sreq.output_ids)
        kept = len(old) - jump.num_rollback
        new = old[:kept] + list(jump.token_ids)
        g.apply_jump(jump)
        if sreq.status == ReqStatus.RUNNING:
            self._rewound.add(sreq.rid)
        scheduler.rewind(sreq, new)
        self.stats["jump_forward_tokens"] += jump.num_new_tokens
        self.stats["jump_forward_steps"] += 1
        delta = self._resync_text(state, old, new, kept, jump)
        if state.sent_tokens > kept:
            state.rollback_tokens += state.sent_tokens - kept
            state.sent_tokens = kept
        matched = state.out.append(delta, check_stop=len(new) >= sreq.sampling_params.min_new_tokens)
        if matched is not None:
            return {"type": "stop", "matched": matched}
        if g.is_finished():
            return {"type": "stop", "matched": None}
        if g.is_stuck():  # the jumped-over text is valid; nothing may follow it
            return {"type": "abort", "message": STUCK_MESSAGE}
        return None

    @staticmethod
    def _resync_text(state: Any, old: list[int], new: list[int], kept: int, jump: JumpForward) -> str:
        """The text the new tokens add, with the detokenizer window moved onto `new`."""
        detok = state.detok
        pending = detok.flush()
        start = max(kept - _DECODE_CONTEXT, 0)
        old_text = detok._decode(old[start:])
        new_text = detok._decode(new[start:])
        if new_text.startswith(old_text):
            delta = new_text[len(old_text):]
        else:  # pragma: no cover - byte-level tokenizers decode by concatenation
            logger.warning("jump-forward: decoded text diverged after retokenization; using the forced text")
            delta = jump.text
        surround = len(detok.ids) - len(old)
        detok.ids = detok.ids[:surround] + list(new)
        detok.read_offset = len(detok.ids)
        detok.prefix_offset = max(detok.read_offset - 1, 0)
        return pending + delta

