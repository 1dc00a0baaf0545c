"""Scheduler: queues + radix cache + budgets -> one ScheduleDecision per round. No torch.

Each round is either an EXTEND batch (prefill chunks of admitted requests, plus the running
decodes when mixed batches are on) or a DECODE batch of every running request. Prefill goes
first (new requests join the running batch as soon as memory allows, as in SGLang); with mixed
batches the running requests decode in every round, and a `PrefillPacer` sizes the prefill part
so that such a round keeps their gap between two tokens near its target.

Call order per round: `schedule()` -> (caller runs the forward) -> `commit(decision)` ->
(caller appends sampled tokens to `req.output_ids`) -> `finish(req, reason)` for finished ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmserver.scheduler.admission import StepBudget
from lmserver.scheduler.kv import KVManager
from lmserver.scheduler.pacer import PrefillPacer
from lmserver.scheduler.policy import order_waiting
from lmserver.scheduler.req import MMSpan, Req, ReqStatus

# A waiting request sharing this many uncached tokens with one admitted in the same round, or
# with one still prefilling, waits until that request's chunks are cached, then reuses its KV
# (in-batch prefix dedup; SGLang compares within the round only).
IN_BATCH_PREFIX_THRESHOLD = 32
# Decode-memory reserve per running request: min(remaining tokens, clip) * new_token_ratio.
RESERVE_CLIP_TOKENS = 4096
NEW_TOKEN_RATIO_INIT = 0.7
NEW_TOKEN_RATIO_MIN = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
NEW_TOKEN_RATIO_RETRACT_STEP = 0.1


def _first_token(req: Req) -> int:
    """fill_ids[0] of a request with fill_len > 0."""
    return req.input_ids[0] if req.input_ids else req.output_ids[0]


@dataclass(frozen=True)
class ForwardItem:
    """One request's part of a forward (plain data for the model runner)."""

    rid: str
    req_pool_idx: int
    prefix_len: int  # tokens of this request already in the KV cache; positions start here
    token_ids: list[int]  # new tokens
    out_slots: list[int]  # KV slots of the new tokens
    table_start: int  # write table_slots to req_to_token[req_pool_idx, table_start:...]
    table_slots: list[int]
    logit_offsets: list[int]  # offsets into token_ids whose logits the caller needs
    completes_prefill: bool  # after this forward the request's KV covers all of fill_ids
    mm_spans: tuple[MMSpan, ...] = ()  # image / video rows among token_ids (their embeddings replace the tokens')


@dataclass(frozen=True)
class ScheduleDecision:
    mode: str  # "extend" | "decode" | "idle"
    items: list[ForwardItem] = field(default_factory=list)
    retracted: list[str] = field(default_factory=list)
    # prompt tokens of a mixed step sized by the pacer (0: not paced); the caller reports the
    # step's duration to `Scheduler.pacer.observe`
    paced_prefill_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(item.token_ids) for item in self.items)


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        *,
        max_running_requests: int,
        max_prefill_tokens: int = 16384,
        chunked_prefill_size: int = 8192,
        schedule_policy: str = "lpm",
        aging_rounds: int = 64,
        enable_mixed_chunk: bool = False,
        init_new_token_ratio: float = NEW_TOKEN_RATIO_INIT,
        min_new_token_ratio: float = NEW_TOKEN_RATIO_MIN,
        pacer: PrefillPacer | None = None,
        admission: StepBudget | None = None,
    ) -> None:
        self.kv = kv
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size if chunked_prefill_size > 0 else 1 << 62
        self.schedule_policy = schedule_policy
        self.aging_rounds = aging_rounds
        self.enable_mixed_chunk = enable_mixed_chunk
        # sizes the prefill of mixed steps (None: full chunks); only while requests decode
        self.pacer = pacer
        # SLO admission (scheduler/admission.py): while requests decode, admits only what keeps their
        # step within its target; the caller reports each measured gap to `admission.observe`
        self.admission = admission
        self.reqs: dict[str, Req] = {}
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.prefilling: list[Req] = []  # admitted, prefill not complete (at most one is chunked)
        self.free_rows = list(range(max_running_requests - 1, -1, -1))
        # fraction of each running request's remaining tokens reserved at admission; it decays
        # while decodes succeed and rises after a retraction
        self.new_token_ratio = init_new_token_ratio
        self.min_new_token_ratio = min_new_token_ratio
        self.num_retractions = 0
        self.num_rounds = 0

    # --- queue --------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Queues `req` (status WAITING). Mutates the waiting queue."""
        if req.rid in self.reqs:
            raise ValueError(f"duplicate request id {req.rid!r}")
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> Req | None:
        """Removes `rid` at any stage, freeing its KV (nothing is cached). Returns it, or None."""
        req = self.reqs.pop(rid, None)
        if req is None:
            return None
        if req.status == ReqStatus.WAITING:
            self.waiting.remove(req)
        else:
            self._drop(req, cache_tokens=False)
        req.status = ReqStatus.FINISHED
        return req

    def finish(self, req: Req, reason: dict[str, Any]) -> None:
        """Marks `req` finished: its tokens go into the radix cache, everything else is freed."""
        req.finish_reason = reason
        self.reqs.pop(req.rid, None)
        self._drop(req, cache_tokens=True)
        req.status = ReqStatus.FINISHED

    def _drop(self, req: Req, cache_tokens: bool) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        row = req.req_pool_idx
        self.kv.release(req, cache_tokens=cache_tokens)
        if row is not None:
            self.free_rows.append(row)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def has_free_row(self) -> bool:
        """True when one more request can be admitted now (under max_running_requests, a free
        request-table row). Pure."""
        return self.num_active < self.max_running_requests and bool(self.free_rows)

    def admission_limit(self) -> int | None:
        """How many waiting requests the SLO admission lets in this round (None: no limit beyond
        rows and memory). Pure."""
        if self.admission is None:
            return None
        return self.admission.admit_limit(self.num_active, len(self.running))

    @property
    def can_admit(self) -> bool:
        """True when a waiting request could be admitted now as far as rows and the SLO admission
        go (memory aside). Pure."""
        return self.has_free_row and self.admission_limit() != 0

    def refresh_admission(self) -> None:
        """Brings the SLO admission's protected start batch up to date with the active requests
        (what `schedule` does first), so that `can_admit` answers as the next `schedule` will
        (engine/overlap.py's chain test asks between a finish and that schedule). Mutates the
        admission's target (and credit: see `StepBudget.protect`)."""
        if self.admission is not None and self.admission.relative:
            self.admission.protect(self._protected_base_rows())

    # --- scheduling -----------------------------------------------------------------------

    def schedule(self) -> ScheduleDecision:
        """Picks the next forward. Mutates: queues, request KV (allocation, eviction, retraction)."""
        self.num_rounds += 1
        self.refresh_admission()
        if self.enable_mixed_chunk and self.running:
            # decodes get their slots first; prefill chunks use what is left
            decode_items, retracted = self._schedule_decode()
            cap = self.pacer.tokens if self.pacer is not None else None
            items = self._schedule_extend(cap)
            if items:
                paced = sum(len(item.token_ids) for item in items) if cap is not None else 0
                return ScheduleDecision("extend", items + decode_items, retracted, paced_prefill_tokens=paced)
            return ScheduleDecision("decode", decode_items, retracted)
        items = self._schedule_extend()
        if items:
            return ScheduleDecision("extend", items)
        if self.running:
            decode_items, retracted = self._schedule_decode()
            return ScheduleDecision("decode", decode_items, retracted)
        return ScheduleDecision("idle")

    def _reserve(self, reqs: list[Req]) -> int:
        ratio = self.new_token_ratio
        return int(sum(min(r.remaining_new_tokens, RESERVE_CLIP_TOKENS) * ratio for r in reqs))

    def _schedule_extend(self, cap: int | None = None) -> list[ForwardItem]:
        """Prefill chunks of at most `cap` tokens in all (None: the chunk and prefill budgets)."""
        items: list[ForwardItem] = []
        chunk_left = self.chunked_prefill_size if cap is None else min(self.chunked_prefill_size, cap)
        prefill_left = self.max_prefill_tokens if cap is None else min(self.max_prefill_tokens, cap)
        # 1. continue requests whose prefill is not complete (chunked prefill)
        for req in list(self.prefilling):
            n = min(req.fill_len - req.kv_len, chunk_left, max(prefill_left, 1))
            if n <= 0 or not self.kv.extend(req, n):
                break
            items.append(self._extend_item(req, req.kv_len - n, n))
            chunk_left -= n
            prefill_left -= n
        # NOTE: with no free row nothing can be admitted, so the waiting queue is not ordered
        # (its lpm peeks and LRU touches skipped) until a row frees up, as SGLang skips its
        # prefix matching while the batch is full
        if chunk_left <= 0 or prefill_left <= 0 or not self.waiting or not self.has_free_row:
            return items
        limit = self.admission_limit()
        if limit == 0:  # NOTE: as with no free row, the waiting queue is not ordered
            assert self.admission is not None
            self.admission.num_deferred += 1
            return items
        # 2. admit waiting requests in policy order
        admitted: list[Req] = []
        # requests whose prompt KV is not all cached yet (admitted this round, or still prefilling
        # in chunks) by (namespace, first token): only these can share an uncached prefix with req,
        # which then waits for their chunks to reach the cache instead of computing the same KV
        by_first: dict[tuple[str | None, int], list[Req]] = {}
        for req in self.prefilling:
            if req.fill_len:
                by_first.setdefault((req.extra_key, _first_token(req)), []).append(req)
        for req in order_waiting(self.waiting, self.kv, self.schedule_policy, self.aging_rounds):
            if not self.has_free_row:
                break
            if limit is not None and len(admitted) >= limit:
                assert self.admission is not None
                self.admission.num_deferred += 1
                break
            if chunk_left <= 0 or prefill_left <= 0:
                break
            if by_first and self._shares_uncached_prefix(req, by_first):
                continue
            prefix = self.kv.admit(req)
            extend_total = req.fill_len - prefix
            n = min(extend_total, chunk_left, prefill_left)
            others = self.running + self.prefilling
            if others:
                need = self.kv.slots_needed(req, extend_total) + self._reserve([*others, req])
                fits = need <= self.kv.available
            else:
                fits = self.kv.slots_needed(req, extend_total) <= self.kv.available
            if not fits or not self.kv.extend(req, n):
                self.kv.release(req, cache_tokens=False)
                break
            if not req.admitted_once:
                req.admitted_once = True
                req.cached_tokens = prefix
            req.req_pool_idx = self.free_rows.pop()
            req.table_valid_len = 0
            req.status = ReqStatus.PREFILLING
            self.waiting.remove(req)
            self.prefilling.append(req)
            admitted.append(req)
            if req.fill_len:
                by_first.setdefault((req.extra_key, _first_token(req)), []).append(req)
            items.append(self._extend_item(req, prefix, n))
            chunk_left -= n
            prefill_left -= n
            if n < extend_total:
                break  # at most one chunked request per round
        if admitted:
            for req in self.waiting:
                req.wait_rounds += 1
            if self.admission is not None and self.admission.relative and not self.waiting:
                # started with nothing waiting: protected, by the batch it starts in
                for req in admitted:
                    if req.slo_base_rows is None:
                        req.slo_base_rows = self.num_active
        return items

    def _protected_base_rows(self) -> int | None:
        """The smallest start batch of the active protected requests (SLO admission, relative
        target); None: none is active. Pure."""
        rows = [r.slo_base_rows for r in self.running if r.slo_base_rows is not None]
        rows += [r.slo_base_rows for r in self.prefilling if r.slo_base_rows is not None]
        return min(rows, default=None)

    def _shares_uncached_prefix(self, req: Req, by_first: dict[tuple[str | None, int], list[Req]]) -> bool:
        if self.schedule_policy == "fcfs" or self.kv.disable_radix_cache or not req.fill_len:
            return False
        others = by_first.get((req.extra_key, _first_token(req)))
        if not others:  # no admitted request starts with req's first token (no sharing: no peek)
            return False
        # True iff some admitted request shares at least `cached + THRESHOLD` leading tokens with
        # req: only that many tokens are compared (fill_key_range: the prompt converted once)
        need = self.kv.peek_prefix_len(req) + IN_BATCH_PREFIX_THRESHOLD
        if req.fill_len < need:
            return False
        ids = req.fill_key_range(0, need)
        for other in others:
            if other.fill_len >= need and np.array_equal(ids, other.fill_key_range(0, need)):
                return True
        return False

    def _extend_item(self, req: Req, prefix: int, n: int) -> ForwardItem:
        end = prefix + n
        fill = req.fill_ids
        table_start = min(req.table_valid_len, prefix)
        req.table_valid_len = end
        offsets: list[int] = []
        if req.need_input_logprobs:
            first = max(prefix, req.logprob_start_len - 1, 0)
            last = min(end, len(req.input_ids) - 1)
            offsets = [j - prefix for j in range(first, last)]
        completes = end == req.fill_len
        if completes and (not offsets or offsets[-1] != n - 1):
            offsets.append(n - 1)
        return ForwardItem(
            rid=req.rid,
            req_pool_idx=int(req.req_pool_idx),  # type: ignore[arg-type]
            prefix_len=prefix,
            token_ids=fill[prefix:end],
            out_slots=req.kv[prefix:end].tolist(),
            table_start=table_start,
            table_slots=req.kv[table_start:end].tolist(),
            logit_offsets=offsets,
            completes_prefill=completes,
            mm_spans=req.mm_spans(prefix, end) if req.mm_items else (),
        )

    def _schedule_decode(self) -> tuple[list[ForwardItem], list[str]]:
        retracted: list[str] = []
        while True:
            need = sum(self.kv.slots_needed(r, 1) for r in self.running)
            # NOTE: the last running request is never retracted; partial prefills may be
            candidates = self.prefilling + (self.running if len(self.running) > 1 else [])
            if need <= self.kv.available or not candidates:
                break
            victim = min(candidates, key=lambda r: (len(r.output_ids), -r.arrival))
            self._retract(victim)
            retracted.append(victim.rid)
        items = []
        failed = self.kv.extend_all(self.running, 1)
        if failed is not None:
            raise MemoryError(f"no KV slot for the decode of {failed!r} even after retraction")
        for req in self.running:
            pos = req.kv_len - 1
            table_start = min(req.table_valid_len, pos)
            req.table_valid_len = pos + 1
            items.append(
                ForwardItem(
                    rid=req.rid,
                    req_pool_idx=int(req.req_pool_idx),  # type: ignore[arg-type]
                    prefix_len=pos,
                    token_ids=[req.output_ids[-1] if req.output_ids else req.input_ids[-1]],
                    out_slots=[int(req.kv[pos])],
                    table_start=table_start,
                    table_slots=req.kv[table_start : pos + 1].tolist(),
                    logit_offsets=[0],
                    completes_prefill=False,
                )
            )
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, self.min_new_token_ratio)
        return items, retracted

    def add_drafts(self, decision: ScheduleDecision,
                   drafts: dict[str, list[int]]) -> tuple[ScheduleDecision, dict[str, list[int]]]:
        """A decode `decision` turned into a verify forward (mode "extend"): each request with
        drafts gets its last token and the drafts as new tokens, with a KV slot each and every
        row's logits. Returns (the decision, the drafts that got slots). Mutates the requests' KV
        and the allocator (a request whose slots cannot be found keeps its plain decode row)."""
        items: list[ForwardItem] = []
        used: dict[str, list[int]] = {}
        for item in decision.items:
            d = drafts.get(item.rid)
            req = self.reqs.get(item.rid)
            if not d or req is None or not self.kv.extend(req, len(d)):
                items.append(item)
                continue
            pos = item.prefix_len
            end = pos + 1 + len(d)
            req.table_valid_len = end
            used[item.rid] = d
            items.append(dataclasses.replace(
                item, token_ids=[*item.token_ids, *d], out_slots=req.kv[pos:end].tolist(),
                table_slots=req.kv[item.table_start : end].tolist(), logit_offsets=list(range(len(d) + 1))))
        if not used:
            return decision, used
        return ScheduleDecision("extend", items, decision.retracted), used

    def keep_kv(self, req: Req, kv_len: int) -> None:
        """After a verify forward: `req` keeps the KV of its first `kv_len` tokens (the accepted
        ones), the rest is freed (KVManager.shrink)."""
        self.kv.shrink(req, kv_len)

    def _retract(self, req: Req) -> None:
        """Preempts `req`: its written KV goes into the tree (so its re-prefill mostly hits the
        cache), everything else is freed, and it goes back to the front of the waiting queue."""
        self._drop(req, cache_tokens=True)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        req.wait_rounds = self.aging_rounds  # served first when memory frees up
        self.waiting.insert(0, req)
        self.num_retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + NEW_TOKEN_RATIO_RETRACT_STEP)

    def rewind(self, req: Req, new_output_ids: Sequence[int]) -> None:
        """Replaces `req.output_ids` (in place) and, for a running request, moves it back to prefill
        (jump-forward: the retokenized forced text replaces the tail of its output).

        Its written KV goes into the radix tree first (keyed by the old tokens), then the new token
        sequence is matched against the tree, so the kept prefix is reused and only the new tokens
        are computed by the next extend round. Mutates: the request, the tree, the allocator and
        the running / prefilling lists.
        """
        if req.status != ReqStatus.RUNNING:
            req.output_ids[:] = list(new_output_ids)
            return
        # NOTE: the same steps as _retract, but the request keeps its request-table row and goes
        # to `prefilling` (served by the next extend round) instead of the waiting queue.
        row = req.req_pool_idx
        self.kv.release(req, cache_tokens=True)
        req.output_ids[:] = list(new_output_ids)
        self.kv.admit(req)
        req.req_pool_idx = row
        req.table_valid_len = 0
        self.running.remove(req)
        self.prefilling.append(req)
        req.status = ReqStatus.PREFILLING

    def commit(self, decision: ScheduleDecision) -> list[Req]:
        """After the forward of `decision`: inserts prefill chunks into the tree and moves
        completed prefills to the running batch. Returns the requests whose prefill completed."""
        completed = []
        for item in decision.items:
            req = self.reqs.get(item.rid)
            if req is None or req.status != ReqStatus.PREFILLING:
                continue
            if self.kv.checkpoint(req):
                req.table_valid_len = 0
            if item.completes_prefill:
                self.prefilling.remove(req)
                self.running.append(req)
                req.status = ReqStatus.RUNNING
                completed.append(req)
        return completed

    # --- maintenance -------------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Empties the radix cache; refused (False) while any request runs or waits."""
        if self.reqs:
            return False
        self.kv.flush()
        return True

    def check_memory_invariant(self) -> None:
        """Raises MemoryInvariantError when idle and free + cached != total."""
        if self.reqs:
            return
        self.kv.check_invariant()
        assert len(self.free_rows) == self.max_running_requests, "request-table rows leaked"

    def stats(self) -> dict[str, Any]:
        total = self.kv.num_slots
        used = total - self.kv.allocator.available - self.kv.cache.evictable_size
        return {
            "num_running_reqs": len(self.running) + len(self.prefilling),
            "num_waiting_reqs": len(self.waiting),
            "kv_total_slots": total,
            "kv_free_slots": self.kv.allocator.available,
            "kv_cached_slots": self.kv.cache.total_size,
            "kv_usage": used / total if total else 0.0,
            "num_retractions": self.num_retractions,
            "new_token_ratio": self.new_token_ratio,
            # host time of the KVManager: radix-tree work (matching, locking, insertion, eviction,
            # lpm peeks) and slot bookkeeping (allocation, request slot buffers; also without cache)
            "radix_time_s": self.kv.radix_time_s,
            "slot_time_s": self.kv.slot_time_s,
            # the prompt tokens of the next mixed step and how many steps sized it (None: no pacer)
            "prefill_pacer_tokens": self.pacer.tokens if self.pacer is not None else None,
            "prefill_paced_steps": self.pacer.num_observed if self.pacer is not None else 0,
            **(self.admission.stats() if self.admission is not None else {}),
            **self.kv.host_stats(),  # the host KV tier's hits, loads, offloads, usage (when on)
        }
