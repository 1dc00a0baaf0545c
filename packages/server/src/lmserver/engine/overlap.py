"""The overlap scheduler (`--enable-overlap-schedule`): the host handles decode step N's tokens
while the device runs step N+1.

A decode forward is *launched*: its tokens are sampled on the device (`sampler.sample_tensor`)
and copied to pinned host memory without waiting (a CUDA event marks the copy). `EngineCore.step`
then, while the batch is *quiet* (`chain_ready`), schedules and launches step N+1 with its input
ids read on the device from step N's sampled ids, and only then *lands* step N: waits for its
event, appends the tokens, detokenizes, checks stops and finishes requests. Host-to-device
copies on the way come from pinned memory (`model_runner.host_tensor`): one from pageable memory
may wait for the forward already queued. On the CPU torch is synchronous, so nothing overlaps,
but the same code runs (the tests compare it with the serial path).

Invariant (which tokens the host holds when): between `step()` calls at most one `Launched`
decode is in flight. Its requests' `output_ids` lack exactly its token; their KV (`kv_len`)
covers every token the host holds, plus, for a *chained* launch, the slot of the previous
step's token, which that launch writes. So while step N is landed with N+1 in flight, each
request of N+1 is one KV slot ahead of its host tokens; landing N appends N's token and makes
them equal again, except for a request N finished (EOS, stop token or string, length): it gets
its extra slot taken back (`EngineCore._finish` lowers `kv_len` by one before the release), so
the radix cache and the allocator see what the serial path would, and its row of N+1 is thrown
away when N+1 lands. Aborts free every slot anyway; their rows are thrown away too.

A launch is *chained* only when the serial path would schedule the same decode: no prefilling
request, no compiled grammar waiting for admission and no deferred jump-forward (requests whose
compile is still running do not stop it: their compile's end is an arrival); no waiting request
either, unless none can be admitted: every request-table row taken and no request of the
previous launch can finish with its token (a finish frees a row; a grammar row always may), or
rows free and the SLO admission refusing (its next answer may differ: admitted a step later);
every running request in the previous launch and `row_ok` (no penalties reading host tokens, no
logprobs, and no min-new-tokens mask that turns off at this very token); and the decode's new
slots come from free slots (no eviction or retraction, whose choices depend on finishes the host
has not seen). Otherwise the previous launch lands first and the step runs as in serial.

Grammar rows chain with *delayed sampling* (what SGLang's overlap does for constrained requests):
the launch runs the forward only; its logits wait on the device while the previous launch lands
(the host accepts its tokens into the grammars), then the masks are filled from the grammars'
states, applied, and the tokens sampled and copied (`Launched.needs_sampling`,
`EngineCore._sample_launched`). A jump-forward cannot move a request that a launch in flight
holds a row of: while a chained launch is in flight the landing's jumps are declined
(`ConstrainedDecoding.hold_jumps`; the mask forces the same text token by token), so the tokens
of a request with forced text may differ from the serial path's, the text stays in the grammar. A chained launch whose requests all ended by the time it lands is
one the serial path never scheduled: the scheduler's round counter and new-token ratio are
restored (`undo_phantom`).

Events between `step()` calls (an arrival, an abort) reach the serial path's next schedule but
come after the overlap's, which already ran: the two then batch differently for a step (the
same tokens where the model's rows do not depend on their batch-mates, as the tests assume).

Tensor parallelism keeps it off: followers mirror rank 0's host decisions, which do not carry
the device token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lmserver.runner.host_tensors import to_device
from lmserver.scheduler import ScheduleDecision, Scheduler

if TYPE_CHECKING:
    from lmserver.engine.req_state import ReqState

__all__ = ["Launched", "chain_ready", "may_finish", "next_input_ids", "row_ok"]


@dataclass
class Launched:
    """A decode forward in flight whose sampled ids the host has not read."""

    decision: ScheduleDecision
    states: list[ReqState]  # one per row, in the decision's order
    ids: torch.Tensor | None  # (bs,) int64 sampled ids on the device (None: logits wait for their masks)
    host_ids: torch.Tensor | None  # (bs,) int64 host copy (pinned on CUDA), valid once `event` completed
    event: torch.cuda.Event | None  # None on the CPU (the copy is done)
    chained: bool  # scheduled before the previous launch landed (its requests are a slot ahead)
    rounds_before: int = 0  # scheduler.num_rounds / new_token_ratio before this schedule (chained)
    ratio_before: float = 0.0
    row_of: dict[str, int] = field(default_factory=dict)
    logits: torch.Tensor | None = None  # (bs, V) of a launch with grammar rows, until sampled (delayed sampling)

    def __post_init__(self) -> None:
        self.row_of = {item.rid: i for i, item in enumerate(self.decision.items)}

    @classmethod
    def start(cls, decision: ScheduleDecision, states: list[ReqState], ids: torch.Tensor, chained: bool,
              rounds_before: int = 0, ratio_before: float = 0.0) -> Launched:
        """Starts the non-blocking host copy of `ids` (no host sync). `ids` may be a view of a graph's
        static output that the next replay overwrites: the copy is queued (or, on the CPU, made) first."""
        launched = cls(decision, states, None, None, None, chained, rounds_before, ratio_before)
        launched.set_ids(ids)
        return launched

    @classmethod
    def unsampled(cls, decision: ScheduleDecision, states: list[ReqState], logits: torch.Tensor, chained: bool,
                  rounds_before: int = 0, ratio_before: float = 0.0) -> Launched:
        """A launch whose `logits` wait for their masks (`set_ids` once sampled)."""
        return cls(decision, states, None, None, None, chained, rounds_before, ratio_before, logits=logits)

    @property
    def needs_sampling(self) -> bool:
        return self.ids is None

    def set_ids(self, ids: torch.Tensor) -> None:
        """The sampled ids of this launch: starts their host copy (see `start`). Mutates self."""
        self.logits = None
        self.ids = ids
        if ids.device.type != "cuda":
            self.host_ids = ids.clone()
            return
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()
        self.host_ids = host

    def tokens(self) -> list[int]:
        """The sampled ids on the host (waits for this launch's forward and copy only)."""
        assert self.host_ids is not None, "a launch is sampled before it lands"
        if self.event is not None:
            self.event.synchronize()
        return [int(t) for t in self.host_ids.tolist()]

    def alive(self, states: dict[str, ReqState]) -> bool:
        """True while some row's request is still live (its token will be used). Pure."""
        return any(states.get(s.req.rid) is s for s in self.states)

    def undo_phantom(self, scheduler: Scheduler) -> None:
        """Restores the scheduler's round counter and new-token ratio to before this launch's
        schedule (a chained decode whose requests all ended before it landed)."""
        scheduler.num_rounds = self.rounds_before
        scheduler.new_token_ratio = self.ratio_before


def row_ok(state: ReqState, chained: bool) -> bool:
    """True when a request's next token can be sampled on the device without host tokens. With
    `chained`, its previous token is not on the host yet (`output_ids` is one short). Pure."""
    p = state.sreq.sampling_params
    if state.req.return_logprob:
        return False
    if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        return False
    # NOTE: apply_penalties masks stop ids while len(output_ids) < min_new_tokens; one short,
    # it is wrong exactly at the token where the mask turns off
    return not (chained and state.info.stop_ids and len(state.sreq.output_ids) + 1 == p.min_new_tokens)


def may_finish(state: ReqState) -> bool:
    """True when the token in flight (not on the host yet) can end the request. Pure."""
    sreq = state.sreq
    p = sreq.sampling_params
    n = len(sreq.output_ids) + 1  # with the token in flight
    if state.grammar is not None:  # the grammar may end with any token
        return True
    return n >= sreq.max_new_tokens or (n >= p.min_new_tokens and bool(state.info.stop_ids or p.stop or p.stop_regex))


def chain_ready(scheduler: Scheduler, prev: Launched, states: dict[str, ReqState], grammar_blocks: int) -> bool:
    """True when the next round, scheduled now (before `prev` lands), is the decode the serial
    path would schedule after it, plus rows for the requests `prev` finishes. `grammar_blocks`:
    compiled grammars waiting for admission plus deferred jumps
    (`ConstrainedDecoding.num_chain_blockers`). Pure but for `Scheduler.refresh_admission` (which the
    next schedule() makes anyway)."""
    if grammar_blocks or scheduler.prefilling or not scheduler.running:
        return False
    if scheduler.waiting:  # admission must stay impossible after prev lands
        # NOTE: the SLO admission's refusal counts as impossible: its answer after prev lands (a new
        # measurement, a finish that frees its rows) may differ, and the request is then admitted one
        # step later than serially. So only where every request-table row is taken does a finish
        # (which frees a row) stop the chain; where rows are free the admission is what refuses, and
        # a grammar row (which may always finish) no longer makes every step serial while requests wait
        # NOTE: the protected start batch as the next schedule() sets it: a protected request that the last
        # landing finished may have lifted the target (a stale refusal chained a launch that admitted: an extend)
        scheduler.refresh_admission()
        if scheduler.can_admit:
            return False
        if not scheduler.has_free_row and any(may_finish(states[r.rid]) for r in scheduler.running
                                              if r.rid in states):
            return False
    for req in scheduler.running:
        state = states.get(req.rid)
        if state is None or req.rid not in prev.row_of or not row_ok(state, chained=True):
            return False
    need = sum(scheduler.kv.slots_needed(r, 1) for r in scheduler.running)
    return need <= scheduler.kv.allocator.available


def next_input_ids(prev: Launched, items: Sequence[str]) -> torch.Tensor:
    """Input ids of a chained decode with rows `items` (request ids), read on the device from
    `prev`'s sampled ids (no host sync)."""
    ids = prev.ids
    assert ids is not None, "a launch is sampled before the next one chains on it"
    src = [prev.row_of[rid] for rid in items]
    if src == list(range(len(prev.states))):
        return ids
    return ids.index_select(0, to_device(src, torch.int64, ids.device))
