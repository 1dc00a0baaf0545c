"""StepTrace: where the time between two tokens of the running requests goes.

The running requests' gap between two tokens is the time between two `EngineCore.step()` calls
that give them a token. Everything the engine process does in between lands in that gap: the
steps that gave no token (a prefill that samples nothing), the forward of the step itself, the
admission of requests whose grammar compiled (grammar objects, jump-forward at admission), the
requests added by the serving loop (`add_request`: validation, JSON Schema parsing), and
whatever else holds the interpreter (the grammar pool's dispatcher thread receiving compiled
indexes), and the cyclic garbage collector's pauses (any thread's allocations can start one;
a full collection walks every tracked object of the process). `StepTrace` closes one record per
such gap (`GapRecord`) with those parts measured,
keeps the longest ones and the recent ones, and names the largest part (`GapRecord.cause`).

Always on: a record costs a few microseconds per step. `EngineCore.get_stats` reports the
longest gap and the records of the longest gaps (`step_gaps_top`); `keep > 0` also keeps the
last `keep` records (`StepTrace.records`; `EngineCore.get_step_trace`, the server's
`/get_step_trace`, as rows of `FIELDS`: not in the stats, which the serving loop sends every
second). No torch.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import heapq
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["GapRecord", "StepTrace"]

TOP_GAPS = 8  # the longest gaps kept
# a record as one row (`StepTrace.rows`): its fields, then its outside time and cause
FIELDS = ("end", "gap_s", "steps", "step_s", "decode_rows", "extend_forwards", "prefill_rows", "prefill_tokens",
          "forward_s", "admitted", "admit_s", "added", "add_s", "receive_s", "gc_s", "gc_full", "admit_max_s",
          "admit_max_rid", "mask_s", "outside_s", "cause")


@dataclass
class GapRecord:
    """One gap between two token-giving steps (seconds; `end` is `time.perf_counter()`)."""

    end: float = 0.0
    gap_s: float = 0.0
    steps: int = 0  # step() calls in the gap (the closing one included)
    step_s: float = 0.0  # time inside those calls
    decode_rows: int = 0  # rows of the closing step that got a token
    extend_forwards: int = 0  # forwards with prefill rows in the gap
    prefill_rows: int = 0  # prompt (or re-prefill) rows computed in the gap
    prefill_tokens: int = 0
    forward_s: float = 0.0  # time of the forwards run by steps in the gap (serial path: forward + sampling)
    admitted: int = 0  # requests whose grammar compiled, moved to the scheduler in the gap
    admit_s: float = 0.0  # time admitting them (grammar objects, jump-forward at admission)
    added: int = 0  # requests added (add_request) in the gap
    add_s: float = 0.0
    receive_s: float = 0.0  # CPU time the grammar dispatcher thread spent receiving results in the gap
    gc_s: float = 0.0  # garbage-collector pauses in the gap (any thread; inside the parts above too)
    gc_full: int = 0  # of which oldest-generation collections
    admit_max_s: float = 0.0  # the slowest single admission in the gap (inside admit_s)
    admit_max_rid: str = ""  # its request id
    mask_s: float = 0.0  # host time filling grammar masks in the gap (inside forward_s or the step's other time)

    @property
    def outside_s(self) -> float:
        """The part of the gap outside step() and add_request (the serving loop, other threads)."""
        return max(self.gap_s - self.step_s - self.add_s, 0.0)

    @property
    def cause(self) -> str:
        """The largest measured part of the gap: garbage-collection (when its pauses are the
        largest part: they fall inside the others), forward-extend, forward-decode,
        grammar-admission, add-request, other-in-step, or outside-step; grammar-mask when the host's
        mask fills (first use of a parser configuration walks the vocabulary) are the largest part."""
        forward = "forward-extend" if self.extend_forwards else "forward-decode"
        parts = {forward: self.forward_s, "grammar-admission": self.admit_s, "add-request": self.add_s,
                 "other-in-step": max(self.step_s - self.forward_s - self.admit_s, 0.0),
                 "outside-step": self.outside_s}
        cause = max(parts, key=lambda k: parts[k])
        if self.gc_s >= parts[cause]:
            return "garbage-collection"
        return "grammar-mask" if self.mask_s >= parts[cause] else cause

    def as_row(self) -> list[Any]:
        """The record's values in `FIELDS` order."""
        return [self.end, self.gap_s, self.steps, self.step_s, self.decode_rows, self.extend_forwards,
                self.prefill_rows, self.prefill_tokens, self.forward_s, self.admitted, self.admit_s, self.added,
                self.add_s, self.receive_s, self.gc_s, self.gc_full, self.admit_max_s, self.admit_max_rid,
                self.mask_s, self.outside_s, self.cause]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["outside_s"] = self.outside_s
        out["cause"] = self.cause
        return out


class StepTrace:
    """Accumulates the parts of the current gap; `close` ends it at a token-giving step."""

    def __init__(self, keep: int = 0, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self.records: collections.deque[GapRecord] = collections.deque(maxlen=keep if keep > 0 else 1)
        self.keep = keep
        self._top: list[tuple[float, int, GapRecord]] = []  # min-heap of the longest gaps
        self._n = 0
        self._last_end: float | None = None
        self._cur = GapRecord()
        self.max_gap_s = 0.0
        self.gc_s = 0.0  # all collections' pauses since start
        self.gc_full = 0
        self._gc_start = 0.0
        gc.callbacks.append(_gc_callback(weakref.ref(self)))

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = self.clock()
            return
        seconds = self.clock() - self._gc_start
        full = info.get("generation") == 2
        self.gc_s += seconds
        self.gc_full += full
        self._cur.gc_s += seconds
        self._cur.gc_full += full

    # --- parts of the current gap ---------------------------------------------------------------------

    def add_request(self, seconds: float) -> None:
        self._cur.added += 1
        self._cur.add_s += seconds

    def admission(self, count: int, seconds: float, slowest: tuple[str, float] | None = None) -> None:
        """`count` requests admitted in `seconds`; `slowest`: (request id, seconds) of the slowest one."""
        cur = self._cur
        cur.admitted += count
        cur.admit_s += seconds
        if slowest is not None and slowest[1] >= cur.admit_max_s:
            cur.admit_max_rid, cur.admit_max_s = slowest

    def mask(self, seconds: float) -> None:
        self._cur.mask_s += seconds

    def forward(self, seconds: float, prefill_rows: int, prefill_tokens: int) -> None:
        cur = self._cur
        cur.forward_s += seconds
        if prefill_rows:
            cur.extend_forwards += 1
            cur.prefill_rows += prefill_rows
            cur.prefill_tokens += prefill_tokens

    def receive(self, seconds: float) -> None:
        self._cur.receive_s += seconds

    # --- steps ---------------------------------------------------------------------------------------

    def step(self, start: float, end: float, decode_rows: int) -> GapRecord | None:
        """A step() call from `start` to `end`; `decode_rows` > 0: it gave that many running
        requests a token, which closes the gap (returned). The first token-giving step only
        starts the clock (None)."""
        cur = self._cur
        cur.steps += 1
        cur.step_s += end - start
        if decode_rows <= 0:
            return None
        last, self._last_end = self._last_end, end
        self._cur = GapRecord()
        if last is None:
            return None
        cur.end, cur.gap_s, cur.decode_rows = end, end - last, decode_rows
        self.max_gap_s = max(self.max_gap_s, cur.gap_s)
        if self.keep > 0:
            self.records.append(cur)
        self._n += 1
        if len(self._top) < TOP_GAPS:
            heapq.heappush(self._top, (cur.gap_s, self._n, cur))
        elif cur.gap_s > self._top[0][0]:
            heapq.heapreplace(self._top, (cur.gap_s, self._n, cur))
        return cur

    def idle(self) -> None:
        """Nothing runs: the next token-giving step starts a new clock (no gap across idle time)."""
        self._last_end = None
        self._cur = GapRecord()

    def top(self) -> list[GapRecord]:
        """The longest gaps so far, longest first."""
        return [rec for _, _, rec in sorted(self._top, key=lambda t: (-t[0], t[1]))]

    def stats(self) -> dict[str, Any]:
        """The longest gap, the number of gaps, the longest gaps' records (cheap: for the stats)."""
        return {"step_gap_max_s": self.max_gap_s, "step_gaps": self._n, "gc_pause_s": self.gc_s,
                "gc_full_collections": self.gc_full, "step_gaps_top": [r.as_dict() for r in self.top()]}

    def rows(self) -> dict[str, Any]:
        """The kept records as rows of `FIELDS` (empty with keep=0)."""
        return {"fields": list(FIELDS), "records": [r.as_row() for r in self.records] if self.keep > 0 else []}


def _gc_callback(ref: weakref.ReferenceType[StepTrace]) -> Any:
    """A `gc.callbacks` entry feeding the trace behind `ref`; it removes itself once the trace is gone."""

    def callback(phase: str, info: dict[str, int]) -> None:
        trace = ref()
        if trace is None:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(callback)
            return
        trace._gc(phase, info)

    return callback
