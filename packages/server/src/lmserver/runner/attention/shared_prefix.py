"""Which rows of a decode batch share a prefix of KV slots (for cascade decode attention).

`SharedPrefixPlanner` keeps a host mirror of the request-to-token table, fed with the same writes
as the device table (`record`, `record_decode`), and groups a decode batch's rows whose table
rows are equal on [0, P): the radix cache hands the same slots to every request of a prompt
group. Correctness never depends on a guess: every P is a common prefix of the mirrored slots,
which equal the device table's, and P <= each member's length.

Host cost: a decode step's table writes are appends (the new token's slot, never shared with
another running request) and are not mirrored; only a write over mirrored columns is. A step
whose rows and mirror are those of the last plan gets the cached plan (a tuple compare); a step
that only lost rows (finished requests) gets the last plan restricted to its rows; anything
else (new requests, after an extend) is planned again: sort the rows by a few probe columns,
the longest common prefix of sorted neighbours, and a split of the sorted order into groups
that maximizes the KV tokens not read again. No torch here (numpy only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["PrefixGroups", "SharedPrefixPlanner"]


class _TableWrite(Protocol):  # the fields of scheduler.ForwardItem that write req_to_token
    @property
    def req_pool_idx(self) -> int: ...
    @property
    def table_start(self) -> int: ...
    @property
    def table_slots(self) -> list[int]: ...


@dataclass(frozen=True, eq=False)
class PrefixGroups:
    """Groups of one decode batch (plain data; compared by identity: a cached plan is the same
    object, so its device copy can be skipped)."""

    groups: tuple[tuple[tuple[int, ...], int], ...]  # (batch rows, shared prefix length), >= 2 rows each
    saved_tokens: int  # KV tokens per layer and KV head not read again: sum (rows - 1) * prefix


class SharedPrefixPlanner:
    """Host mirror of `req_to_token` (num_rows, width) prefixes and the decode grouping.

    `min_prefix_len`: the shortest prefix worth a group; `group_cost_tokens`: the cost of one
    more group, in KV tokens read (a work item, partials to merge); `min_saved_tokens`: below
    this many saved tokens `plan` returns None (the plain decode kernel runs). On the H200, 8 rows
    sharing 2,048 tokens (14,336 saved) ran 0.91x the plain kernel and 64 rows in groups of 16
    (122,880 saved) 1.91x (benchmarks/RESULTS.md, bench_shared_prefix_decode.py).
    """

    def __init__(self, num_rows: int, width: int, min_prefix_len: int = 32, group_cost_tokens: int = 64,
                 min_saved_tokens: int = 16384) -> None:
        # NOTE: np.zeros: pages of rows never written are never touched (no memory)
        self.table = np.zeros((num_rows, width), dtype=np.int32)
        self.lens = [0] * num_rows  # table[row, :lens[row]] equals the device table's row
        self.epoch = 0  # bumped by every mirror change
        self.min_prefix_len = max(1, min_prefix_len)
        self.group_cost_tokens = group_cost_tokens
        self.min_saved_tokens = min_saved_tokens
        self._key: tuple[int, ...] | None = None
        self._key_epoch = -1
        self._result: PrefixGroups | None = None
        self.num_plans = 0  # full plans made (for tests and logs)

    def record(self, row: int, start: int, slots: Sequence[int], append: bool = True) -> None:
        """Mirrors the write of `slots` to table row `row` at column `start`. A write past the
        mirrored columns is dropped (the mirror keeps its exact columns), a write at their end
        only when `append`. Mutates the mirror."""
        n = self.lens[row]
        k = len(slots)
        if k == 0 or start > n or (start == n and not append):
            return
        self.table[row, start : start + k] = slots
        self.lens[row] = max(n, start + k)
        self.epoch += 1

    def record_decode(self, items: Sequence[_TableWrite]) -> None:
        """Mirrors a decode step's table writes: only those over mirrored columns (a decode
        write is normally the new token's own slot at the row's end). Mutates the mirror."""
        lens = self.lens
        for it in items:
            if it.table_start < lens[it.req_pool_idx]:
                self.record(it.req_pool_idx, it.table_start, it.table_slots, append=False)

    def plan(self, rows: Sequence[int], seq_lens: Sequence[int]) -> PrefixGroups | None:
        """Groups of the batch whose row i is table row `rows[i]` with `seq_lens[i]` tokens, or
        None when sharing saves fewer than `min_saved_tokens`. Mutates only the plan cache."""
        key = tuple(rows)
        if self._key_epoch == self.epoch and self._key is not None:
            if key == self._key:
                return self._result
            if self._result is not None and set(key) <= set(self._key):
                self._result = self._restrict(self._result, self._key, key)
                self._key = key
                return self._result
        self._key, self._key_epoch = key, self.epoch
        self._result = self._plan(np.asarray(rows, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64))
        self.num_plans += 1
        return self._result

    def _done(self, groups: list[tuple[tuple[int, ...], int]]) -> PrefixGroups | None:
        saved = sum((len(g) - 1) * p for g, p in groups)
        return PrefixGroups(tuple(groups), saved) if groups and saved >= self.min_saved_tokens else None

    def _restrict(self, old: PrefixGroups, old_rows: tuple[int, ...], rows: tuple[int, ...]) -> PrefixGroups | None:
        # NOTE: the same epoch: every kept row holds the same request and slots, whose length only
        # grew, so each old prefix is still common to the members that remain
        where = {r: i for i, r in enumerate(rows)}
        groups = []
        for members, p in old.groups:
            kept = tuple(where[old_rows[i]] for i in members if old_rows[i] in where)
            if len(kept) >= 2:
                groups.append((kept, p))
        return self._done(groups)

    def _plan(self, rows: npt.NDArray[np.int64], seq_lens: npt.NDArray[np.int64]) -> PrefixGroups | None:
        lens = np.minimum(np.asarray(self.lens, dtype=np.int64)[rows], seq_lens)
        cand = np.flatnonzero(lens >= self.min_prefix_len)
        if len(cand) < 2:
            return None
        top = int(lens[cand].max())
        probes = np.unique(np.minimum((1 << np.arange(top.bit_length() + 1)) - 1, top - 1))
        keys = self.table[rows[cand][:, None], probes[None, :]].astype(np.int64)  # (c, probes)
        keys[probes[None, :] >= lens[cand][:, None]] = -1
        order = cand[np.lexsort(keys.T[::-1])]  # rows sharing a long prefix become neighbours
        lcp = self._neighbour_lcp(rows[order], lens[order])  # (c - 1,)
        groups = []
        for lo, hi in _best_segments(lcp, self.min_prefix_len, self.group_cost_tokens):
            p = int(lcp[lo:hi].min())
            groups.append((tuple(sorted(int(i) for i in order[lo : hi + 1])), p))
        return self._done(groups)

    def _neighbour_lcp(self, rows: npt.NDArray[np.int64], lens: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Longest common prefix of mirrored rows i and i + 1, capped at both lengths."""
        cap = np.minimum(lens[:-1], lens[1:])
        width = int(cap.max())
        g = self.table[rows, :width]  # (n, width): one gather; neighbours are views of it
        diff = g[:-1] != g[1:]  # (n - 1, width)
        first = diff.argmax(axis=1)  # the first differing column, or 0 when none differs
        full = np.where(diff[np.arange(len(first)), first], first, width)
        # NOTE: equal on [0, lcp): columns past a row's cap never count
        return np.minimum(full, cap).astype(np.int64)


def _best_segments(lcp: npt.NDArray[np.int64], min_prefix: int, cost: int) -> list[tuple[int, int]]:
    """Segments [lo, hi] (sorted positions, hi > lo) maximizing sum((hi - lo) * min(lcp[lo:hi]) - cost)
    over splits at a segment's smallest lcp (a Cartesian-tree recursion); segments whose prefix
    is below `min_prefix` or do not pay are left out."""
    out: list[tuple[int, int]] = []
    cuts = [-1, *np.flatnonzero(lcp < min_prefix).tolist(), len(lcp)]  # no group spans these
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        if b - a >= 2:  # positions a + 1 .. b, lcps lcp[a + 1 : b]
            out += _segments_in(lcp, a + 1, b, cost)
    return out


def _segments_in(lcp: npt.NDArray[np.int64], lo0: int, hi0: int, cost: int) -> list[tuple[int, int]]:
    """`_best_segments` of positions [lo0, hi0] whose lcps are all >= the minimum prefix."""
    best: dict[tuple[int, int], tuple[int, list[tuple[int, int]]]] = {}
    stack: list[tuple[int, int, bool]] = [(lo0, hi0, False)]  # post-order: a segment after its halves
    while stack:
        lo, hi, expanded = stack.pop()
        if hi <= lo:
            best[(lo, hi)] = (0, [])
            continue
        part = lcp[lo:hi]
        i = lo + int(np.argmin(part))
        p = int(lcp[i])
        whole = (hi - lo) * p - cost
        if not expanded:
            if p == int(part.max()):  # NOTE: equal lcps: any split only loses rows and adds a cost
                best[(lo, hi)] = (whole, [(lo, hi)]) if whole > 0 else (0, [])
                continue
            stack += [(lo, hi, True), (lo, i, False), (i + 1, hi, False)]
            continue
        left, right = best.pop((lo, i)), best.pop((i + 1, hi))
        if whole > left[0] + right[0] and whole > 0:
            best[(lo, hi)] = (whole, [(lo, hi)])
        else:
            best[(lo, hi)] = (left[0] + right[0], left[1] + right[1])
    return best[(lo0, hi0)][1]
