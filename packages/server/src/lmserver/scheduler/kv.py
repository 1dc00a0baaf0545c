"""KVManager: the adapter from requests to radixcache (tree + slot allocator), torch-free.

It follows the ownership protocol of the radixcache README: a slot is free in the allocator,
held by one tree node, or held by one request. Every method says what it mutates.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from lmserver.scheduler.req import Req
from radixcache import RadixCache, SlotAllocator

F = TypeVar("F", bound=Callable[..., Any])


def _timed(method: F) -> F:
    """Adds the method's wall time to `self.radix_time_s` (the radix management time the paper
    reports: prefix matching, locking, insertion, eviction and the slot bookkeeping around them)."""

    @functools.wraps(method)
    def wrapper(self: KVManager, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.radix_time_s += time.perf_counter() - start

    return wrapper  # type: ignore[return-value]


class MemoryInvariantError(AssertionError):
    """KV slots leaked or were double-counted (free + cached != total while idle)."""


class KVManager:
    def __init__(self, num_slots: int, page_size: int = 1, disable_radix_cache: bool = False) -> None:
        num_slots -= num_slots % page_size
        self.page_size = page_size
        self.allocator = SlotAllocator(num_slots, page_size)
        self.cache = RadixCache(page_size=page_size, eviction="lru")
        self.disable_radix_cache = disable_radix_cache
        self.radix_time_s = 0.0  # accumulated by the @_timed methods

    @property
    def num_slots(self) -> int:
        """Usable slots (the KV buffer needs `buffer_size` rows: slot 0 is padding)."""
        return self.allocator.num_slots

    @property
    def buffer_size(self) -> int:
        return self.allocator.buffer_size

    @property
    def available(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.allocator.available + self.cache.evictable_size

    @_timed
    def peek_prefix_len(self, req: Req, touch: bool = False) -> int:
        """Cached prefix length `req` would reuse (capped). With `touch`, refreshes the LRU clock
        of that prefix (so what waiting requests will reuse is evicted last); else mutates nothing."""
        if self.disable_radix_cache:
            return 0
        if touch:
            length = self.cache.touch_prefix(req.fill_ids, req.extra_key)
        else:
            length = self.cache.peek_prefix_len(req.fill_ids, req.extra_key)
        return min(length, req.prefix_cap(self.page_size))

    @_timed
    def admit(self, req: Req) -> int:
        """Matches and locks the cached prefix of `req`; returns the reused length.

        Mutates: req.kv/kv_len/cached_len/last_node, the tree's lock counts (and may split a node).
        """
        assert req.kv_len == 0 and req.last_node is None, f"admit of a request holding KV: {req!r}"
        cap = req.prefix_cap(self.page_size)
        if self.disable_radix_cache or cap == 0:
            req.last_node = self.cache.root
            return 0
        m = self.cache.match_prefix(req.fill_ids, req.extra_key)
        self.cache.lock(m.last_node)
        req.last_node = m.last_node
        length = min(m.length, cap)
        req.kv = np.array(m.indices[:length], dtype=np.int64)
        req.kv_len = length
        req.cached_len = length
        return length

    @_timed
    def extend(self, req: Req, num_tokens: int) -> bool:
        """Reserves slots for `num_tokens` more tokens of `req` (evicting if needed).

        Returns False (and changes nothing) when not enough slots can be found. Mutates:
        req.kv/kv_len, the allocator, the tree (eviction).
        """
        new_len = req.kv_len + num_tokens
        missing = new_len - len(req.kv)
        if missing > 0:
            slots = self._alloc(missing)
            if slots is None:
                return False
            req.kv = np.concatenate([req.kv, slots]) if len(req.kv) else slots
        req.kv_len = new_len
        return True

    def slots_needed(self, req: Req, num_tokens: int) -> int:
        """Fresh slots `extend(req, num_tokens)` would allocate (whole pages)."""
        missing = req.kv_len + num_tokens - len(req.kv)
        if missing <= 0:
            return 0
        return -(-missing // self.page_size) * self.page_size

    def _alloc(self, num_tokens: int) -> np.ndarray | None:
        slots = self.allocator.alloc(num_tokens)
        if slots is None:
            need = -(-num_tokens // self.page_size) * self.page_size - self.allocator.available
            freed = self.cache.evict(need)
            if len(freed):
                self.allocator.free(freed)
            slots = self.allocator.alloc(num_tokens)
        return slots

    @_timed
    def checkpoint(self, req: Req) -> bool:
        """Inserts the written prefix of `req` into the tree and re-locks at its end.

        Returns True when some of the request's slots were replaced by the tree's own copies
        (the caller must rewrite the request-to-token row). Mutates: the tree, the allocator
        (frees duplicates), req.kv/cached_len/last_node.
        """
        if self.disable_radix_cache:
            return False
        key = req.fill_ids[: req.kv_len]
        r = self.cache.insert(key, req.kv[: req.kv_len], req.extra_key)
        replaced = False
        if r.prefix_len > req.cached_len:
            self.allocator.free(req.kv[req.cached_len : r.prefix_len])
            replaced = True
        m = self.cache.match_prefix(key, req.extra_key)
        self.cache.lock(m.last_node)
        self.cache.unlock(req.last_node)
        req.last_node = m.last_node
        if replaced:
            req.kv[: m.length] = m.indices
        req.cached_len = m.length
        return replaced

    @_timed
    def release(self, req: Req, cache_tokens: bool = True) -> None:
        """Gives back everything `req` holds: its written prefix goes into the tree (unless
        `cache_tokens` is False or the cache is disabled), other slots to the allocator, the lock
        is dropped. Mutates: tree, allocator, and resets req's KV fields."""
        if req.last_node is None:
            req.reset_kv()
            return
        if cache_tokens and not self.disable_radix_cache and req.kv_len > 0:
            key = req.fill_ids[: req.kv_len]
            r = self.cache.insert(key, req.kv[: req.kv_len], req.extra_key)
            if r.prefix_len > req.cached_len:
                self.allocator.free(req.kv[req.cached_len : r.prefix_len])
            tail_start = max(self.cache.aligned_len(req.kv_len), r.prefix_len, req.cached_len)
        else:
            tail_start = req.cached_len
        if len(req.kv) > tail_start:
            # NOTE: with pages, the page holding `tail_start` may be partly tree-owned only when
            # tail_start is page-aligned, so freeing from tail_start frees request pages only.
            self.allocator.free(req.kv[tail_start:])
        self.cache.unlock(req.last_node)
        req.reset_kv()

    @_timed
    def flush(self) -> None:
        """Drops the whole tree (only when no request holds KV); mutates tree and allocator."""
        freed = self.cache.reset()
        if len(freed):
            self.allocator.free(freed)

    def check_invariant(self) -> None:
        """Raises MemoryInvariantError unless free + cached == total (call when no request holds KV)."""
        free, cached, total = self.allocator.available, self.cache.total_size, self.num_slots
        if free + cached != total:
            raise MemoryInvariantError(
                f"KV accounting broken: free {free} + cached {cached} != total {total} "
                f"(leak of {total - free - cached} slots)"
            )
        if self.cache.protected_size != 0:
            raise MemoryInvariantError(f"{self.cache.protected_size} cached tokens still locked while idle")
        self.cache.check_integrity()
