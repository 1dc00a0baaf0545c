"""Fakes and oracles for tests of code that uses `radixcache` (DESIGN.md, principle 9).

`NaivePrefixCache` is the reference model: a plain dict from every cached page-aligned prefix
to the slots of its last page. It is deliberately slow and obviously right.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import numpy.typing as npt

from radixcache.keys import KeyLike, as_key

_Prefix = tuple[Hashable, tuple[int, ...]]


def chunk_pool(page_size: int) -> list[list[int]]:
    """Four token chunks for random keys of property tests: at page size 1 four distinct tokens; else
    whole pages of one token, and a page that shares its first half with another (partial-page matches)."""
    if page_size == 1:
        return [[0], [1], [2], [3]]
    half = page_size // 2
    return [[0] * page_size, [0] * half + [1] * half, [1] * page_size, [2] * page_size]


class NaivePrefixCache:
    """A set of cached prefixes (namespace, token ids), one entry per whole page."""

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self._pages: dict[_Prefix, tuple[int, ...]] = {}  # prefix ending at a page -> its page's slots
        self._owner: dict[int, _Prefix] = {}  # slot -> prefix holding it

    @property
    def total_size(self) -> int:
        return len(self._pages) * self.page_size

    def slots(self) -> set[int]:
        return set(self._owner)

    def longest_prefix(self, key: KeyLike, extra_key: Hashable = None) -> tuple[int, list[int]]:
        """(length, slots) of the longest cached page-aligned prefix of `key`."""
        toks = as_key(key).tolist()
        ps = self.page_size
        out: list[int] = []
        length = 0
        while length + ps <= len(toks):
            page = self._pages.get((extra_key, tuple(toks[: length + ps])))
            if page is None:
                break
            out.extend(page)
            length += ps
        return length, out

    def insert(self, key: KeyLike, value: KeyLike, extra_key: Hashable = None) -> int:
        """Cache the page-aligned part of `key`; returns the already-cached prefix length."""
        toks = as_key(key).tolist()
        vals = as_key(value).tolist()
        ps = self.page_size
        prefix_len, _ = self.longest_prefix(toks, extra_key)
        for end in range(prefix_len + ps, len(toks) - len(toks) % ps + 1, ps):
            pre = (extra_key, tuple(toks[:end]))
            self._pages[pre] = tuple(vals[end - ps : end])
            for s in vals[end - ps : end]:
                if s in self._owner:
                    raise AssertionError(f"slot {s} would be cached twice")
                self._owner[s] = pre
        return prefix_len

    def remove_slots(self, slots: npt.ArrayLike) -> list[_Prefix]:
        """Drop the pages holding `slots`; checks each page goes whole and that what is left
        stays prefix-closed (no cached page without its parent page). Returns the removed prefixes."""
        gone: set[_Prefix] = set()
        want = {int(s) for s in np.asarray(slots).reshape(-1)}
        for s in want:
            if s not in self._owner:
                raise AssertionError(f"slot {s} freed by evict was not cached")
            gone.add(self._owner[s])
        for pre in gone:
            for s in self._pages.pop(pre):
                if s not in want:
                    raise AssertionError(f"page {pre} evicted only in part (slot {s} kept)")
                del self._owner[s]
        ps = self.page_size
        for ns, toks in self._pages:
            if len(toks) > ps and (ns, toks[:-ps]) not in self._pages:
                raise AssertionError(f"cached prefix of length {len(toks)} lost its parent page")
        return sorted(gone, key=lambda p: len(p[1]))

    def reset(self) -> None:
        self._pages.clear()
        self._owner.clear()


class FakeKVTransfer:
    """A `KVTransfer` over two dicts standing for the engine's pools: `device[slot]` and
    `host[slot]` hold whatever the test wrote as a slot's KV (e.g. the token prefix it encodes).
    `offload` and `load` copy entries, and raise `AssertionError` when a source slot holds none
    (a copy of KV that was never computed). Counts the tokens each way."""

    def __init__(self) -> None:
        self.device: dict[int, object] = {}
        self.host: dict[int, object] = {}
        self.offloaded = 0
        self.loaded = 0

    def offload(self, device_slots: npt.NDArray[np.int64], host_slots: npt.NDArray[np.int64]) -> None:
        assert len(device_slots) == len(host_slots), "offload of unequal slot lists"
        for d, h in zip(device_slots.tolist(), host_slots.tolist(), strict=True):
            if d not in self.device:
                raise AssertionError(f"offload of device slot {d}, which holds no KV")
            self.host[h] = self.device[d]
        self.offloaded += len(device_slots)

    def load(self, host_slots: npt.NDArray[np.int64], device_slots: npt.NDArray[np.int64]) -> None:
        assert len(device_slots) == len(host_slots), "load of unequal slot lists"
        for h, d in zip(host_slots.tolist(), device_slots.tolist(), strict=True):
            if h not in self.host:
                raise AssertionError(f"load of host slot {h}, which holds no KV")
            self.device[d] = self.host[h]
        self.loaded += len(device_slots)
