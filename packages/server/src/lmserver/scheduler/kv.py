"""KVManager: the adapter from requests to radixcache (tree + slot allocator), torch-free.

It follows the ownership protocol of the radixcache README: a slot is free in the allocator,
held by one tree node, or held by one request. Every method says what it mutates.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from lmserver.scheduler.req import Req
from radixcache import (
    HierarchicalCache,
    InsertResult,
    KVTransfer,
    PrefixPath,
    RadixCache,
    SlotAllocator,
    TouchPlan,
    WritePolicy,
)

F = TypeVar("F", bound=Callable[..., Any])

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)


def _timed(method: F) -> F:
    """Splits the method's wall time between `self.radix_time_s` (radix-tree work: prefix
    matching, locking, insertion, eviction, the lpm peeks and the tree keys they need; the method
    measures it into `self._tree_s`) and `self.slot_time_s` (the rest: slot allocation and the
    request's slot buffer, work that runs with the radix cache off too). The two add up to the
    method's wall time. A timed method never calls another one."""

    @functools.wraps(method)
    def wrapper(self: KVManager, *args: Any, **kwargs: Any) -> Any:
        self._tree_s = 0.0
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            total = time.perf_counter() - start
            self.radix_time_s += self._tree_s
            self.slot_time_s += total - self._tree_s

    return wrapper  # type: ignore[return-value]


class MemoryInvariantError(AssertionError):
    """KV slots leaked or were double-counted (free + cached != total while idle)."""


class KVManager:
    def __init__(self, num_slots: int, page_size: int = 1, disable_radix_cache: bool = False) -> None:
        num_slots -= num_slots % page_size
        self.page_size = page_size
        self.allocator = SlotAllocator(num_slots, page_size)
        # the tree frees evicted slots and a request's surplus slots into the allocator itself
        self.cache = RadixCache(page_size=page_size, eviction="lru", allocator=self.allocator)
        self.disable_radix_cache = disable_radix_cache
        self.radix_time_s = 0.0  # radix-tree work, accumulated by the @_timed methods
        self.slot_time_s = 0.0  # slot bookkeeping (runs with the cache off too), idem
        self._tree_s = 0.0  # tree time of the @_timed call in progress
        # (cache version, requests, their output_ids copies, lengths, TouchPlan) of the last peeks
        self._last_round: tuple[int, list[Req], list[list[int]], list[int], TouchPlan] | None = None
        self.tier: HierarchicalCache | None = None  # the host-memory tier (enable_host_tier)

    def enable_host_tier(self, host_slots: int, transfer: KVTransfer, write_policy: WritePolicy = "write_back") -> None:
        """Backs the device cache with a host tier of `host_slots` slots (rounded down to pages):
        evicted KV is copied there through `transfer` and loaded back by `admit`. Call before
        anything is cached. Mutates: `tier`, `cache.on_evict`."""
        if self.disable_radix_cache:
            raise ValueError("the hierarchical cache needs the radix cache (drop --disable-radix-cache)")
        ps = self.page_size
        host_slots -= host_slots % ps
        if host_slots <= 0:
            raise ValueError(f"the host KV pool needs at least one page ({ps} slots), got {host_slots}")
        host = RadixCache(page_size=ps, eviction="lru", allocator=SlotAllocator(host_slots, ps))
        self.tier = HierarchicalCache(self.cache, host, transfer, write_policy=write_policy)

    def host_stats(self) -> dict[str, Any]:
        """The host tier's counters and pool usage (empty without a tier). Mutates nothing."""
        tier = self.tier
        if tier is None:
            return {}
        st = tier.stats
        host = tier.host.sizes()
        assert host.free is not None
        return {
            "hicache_host_total_slots": host.free + host.total,
            "hicache_host_used_slots": host.total,
            "hicache_host_usage": host.total / (host.free + host.total),
            "hicache_host_hits": st.host_hits,
            "hicache_host_hit_tokens": st.host_hit_tokens,
            "hicache_loaded_tokens": st.host_hit_tokens,
            "hicache_offloaded_tokens": st.offloaded_tokens,
            "hicache_dropped_tokens": st.dropped_tokens,
            "hicache_load_failures": st.load_failures,
        }

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
        sizes = self.cache.sizes()
        assert sizes.free is not None
        return sizes.free + sizes.evictable

    @_timed
    def peek_prefix_len(self, req: Req, touch: bool = False) -> int:
        """Cached prefix length `req` would reuse (capped). With `touch`, refreshes the LRU clock
        of that prefix (so what waiting requests will reuse is evicted last); else mutates nothing."""
        if self.disable_radix_cache:
            return 0
        start = time.perf_counter()
        path = self._path(req)
        if touch:
            self.cache.touch_path(path)
        length = min(path.length, req.prefix_cap(self.page_size)) if path.length else 0
        self._tree_s += time.perf_counter() - start
        return length

    @_timed
    def peek_prefix_lens(self, reqs: Sequence[Req], touch: bool = False) -> list[int]:
        """`peek_prefix_len` of each request in order (a round's waiting queue), in one call.

        The last round is kept: the same queue (same requests, same tokens) against an unchanged
        tree (`cache.version`) has the same lengths, and its touches replay from a TouchPlan."""
        if self.disable_radix_cache:
            return [0] * len(reqs)
        start = time.perf_counter()
        cache = self.cache
        version = cache.version
        outs = [req.output_ids for req in reqs]
        last = self._last_round
        if last is not None and last[0] == version and last[1] == reqs and last[2] == outs:
            lens, plan = last[3], last[4]
        else:
            ps = self.page_size
            paths = [self._path(req) for req in reqs]
            lens = [min(p.length, req.prefix_cap(ps)) if p.length else 0 for p, req in zip(paths, reqs, strict=True)]
            plan = cache.plan_touches(paths)
            self._last_round = (version, list(reqs), [list(o) for o in outs], lens, plan)
        if touch:
            cache.apply_touches(plan)
        self._tree_s += time.perf_counter() - start
        return list(lens)

    @_timed
    def match_last_nodes(self, reqs: Sequence[Req]) -> list[Any]:
        """`match_prefix(fill_ids).last_node` of each request in order (the dfs-weight order's
        tree walk, timed as tree work). Mutates access clocks and hit counts; may split nodes."""
        start = time.perf_counter()
        match = self.cache.match_prefix
        nodes = [match(req.fill_key(), req.extra_key).last_node for req in reqs]
        self._tree_s += time.perf_counter() - start
        return nodes

    def _path(self, req: Req) -> PrefixPath:
        """The tree path of `req`'s tokens (at most its prefix cap); kept on the request (`req.peek_memo`) while its
        tokens are unchanged: reused as is while the tree's structure (`cache.version`) is
        unchanged, else brought up to date by `cache.refresh_path` (neither the key nor a walk
        when the tree changed elsewhere than where the path ends), else found again."""
        cache = self.cache
        memo = req.peek_memo
        if memo is not None and memo[0] == req.output_ids:
            kept = cache.refresh_path(memo[1])  # no key needed (no-sharing: one dict lookup)
            if kept is not None:
                if kept is not memo[1]:
                    req.peek_memo = (memo[0], kept)
                return kept
            path = cache.find_prefix(req.fill_key(), req.extra_key, limit=req.prefix_cap(self.page_size))
            req.peek_memo = (memo[0], path)
            return path
        path = cache.find_prefix(req.fill_key(), req.extra_key, limit=req.prefix_cap(self.page_size))
        req.peek_memo = (list(req.output_ids), path)
        return path

    @_timed
    def admit(self, req: Req) -> int:
        """Matches and locks the cached prefix of `req`; returns the reused length.

        Mutates: req.kv/kv_len/cached_len/last_node, the tree's lock counts (and may split a node).
        """
        assert req.kv_len == 0 and req.last_node is None, f"admit of a request holding KV: {req!r}"
        cap = req.prefix_cap(self.page_size)
        # room for the prompt and the first decode tokens without regrowing the slot buffer
        capacity = req.fill_len + min(req.remaining_new_tokens, 256) + self.page_size
        if self.disable_radix_cache or cap == 0:
            req.last_node = self.cache.root
            req.locked_len = 0
            req.set_kv(_EMPTY, capacity)
            return 0
        start = time.perf_counter()
        cache = self.cache
        memo = req.peek_memo  # a path peeked since the last change of the tree: no key needed
        m: Any
        if self.tier is not None:  # the device match, extended by what the host tier loads back
            m = self.tier.match_prefix(req.fill_key(), req.extra_key, limit=cap)
        elif (memo is not None and memo[1].version == cache.version and memo[0] == req.output_ids
                and memo[1].length <= cap):
            m = cache.match_path(memo[1])
        else:
            m = cache.match_prefix(req.fill_key(), req.extra_key, limit=cap)
        cache.lock(m.last_node)
        self._tree_s += time.perf_counter() - start
        req.last_node = m.last_node
        req.locked_len = length = m.length  # at most the cap
        req.set_kv(m.indices, capacity)
        req.kv_len = length
        req.cached_len = length
        return length

    @_timed
    def extend(self, req: Req, num_tokens: int) -> bool:
        """Reserves slots for `num_tokens` more tokens of `req` (evicting if needed).

        Returns False (and changes nothing) when not enough slots can be found. Mutates:
        req.kv/kv_len, the allocator, the tree (eviction).
        """
        return self._extend(req, num_tokens)

    @_timed
    def extend_all(self, reqs: Sequence[Req], num_tokens: int) -> Req | None:
        """`extend(req, num_tokens)` for each request in order (a decode round); stops at the
        first that fails and returns it (None when all succeed). When the free slots cover all,
        they come from one allocation, split in order: the same slots the calls one by one get."""
        ps = self.page_size
        pages = []
        total = 0
        for req in reqs:
            missing = req.kv_len + num_tokens - req.kv_alloc
            k = -(-missing // ps) if missing > 0 else 0
            pages.append(k)
            total += k
        if total * ps > self.allocator.available:
            for req in reqs:  # eviction may be needed: the plain path
                if not self._extend(req, num_tokens):
                    return req
            return None
        slots = self.allocator.alloc(total * ps) if total else _EMPTY
        assert slots is not None
        if num_tokens == 1 and ps == 1 and total == len(reqs):  # a decode round: one slot each
            for req, slot in zip(reqs, slots.tolist(), strict=True):
                req.append_slot(slot)
                req.kv_len += num_tokens
            return None
        pos = 0
        for req, k in zip(reqs, pages, strict=True):
            if k:
                n = k * ps
                req.append_slots(slots[pos : pos + n])
                pos += n
            req.kv_len += num_tokens
        return None

    def _extend(self, req: Req, num_tokens: int) -> bool:
        new_len = req.kv_len + num_tokens
        missing = new_len - req.kv_alloc
        if missing > 0:
            slots = self._alloc(missing)
            if slots is None:
                return False
            req.append_slots(slots)
        req.kv_len = new_len
        return True

    def shrink(self, req: Req, kv_len: int) -> None:
        """Forgets `req`'s KV past `kv_len` (rejected draft tokens): frees its request-owned
        slots past the page holding `kv_len`. Mutates: req.kv_len / kv_alloc / table_valid_len,
        the allocator."""
        if not req.cached_len <= kv_len <= req.kv_len:
            raise ValueError(f"shrink to {kv_len} outside [{req.cached_len}, {req.kv_len}] for {req!r}")
        keep = -(-kv_len // self.page_size) * self.page_size
        if req.kv_alloc > keep:
            self.allocator.free(req.kv[keep:].copy())
            req.kv_alloc = keep
        req.kv_len = kv_len
        req.table_valid_len = min(req.table_valid_len, kv_len)

    def slots_needed(self, req: Req, num_tokens: int) -> int:
        """Fresh slots `extend(req, num_tokens)` would allocate (whole pages)."""
        missing = req.kv_len + num_tokens - req.kv_alloc
        if missing <= 0:
            return 0
        return -(-missing // self.page_size) * self.page_size

    def _alloc(self, num_tokens: int) -> np.ndarray | None:
        slots = self.allocator.alloc(num_tokens)
        if slots is None:
            need = self.allocator.alloc_size(num_tokens) - self.allocator.available
            start = time.perf_counter()
            self.cache.evict(need)  # frees into the allocator
            self._tree_s += time.perf_counter() - start
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
        start = time.perf_counter()  # one timed region: the tree work (and the duplicates' free)
        cache = self.cache
        r = self._insert_written(req, finished=False)  # frees the request's duplicates
        if self.tier is not None and self.tier.write_policy == "write_through":
            self.tier.backup(r.last_node)
        replaced = r.prefix_len > req.cached_len
        # the inserted key ends at r.last_node (a root only when it had no whole page)
        node = r.last_node
        indices = _EMPTY
        if node.parent is None:
            m = cache.match_prefix(req.fill_key()[: req.kv_len], req.extra_key)
            node, length = m.last_node, m.length
        elif replaced:
            m = cache.match_node(node)
            length, indices = m.length, m.indices
        else:  # the request's slots are the path's: no need to make them
            length = cache.hit_node(node)
        cache.lock(node)
        cache.unlock(req.last_node)
        self._tree_s += time.perf_counter() - start
        if replaced:  # the tree's slots instead of the request's duplicates (freed by insert)
            req.kv[:length] = indices
        req.last_node = node
        req.locked_len = length
        req.cached_len = length
        return replaced

    def _insert_written(self, req: Req, finished: bool) -> InsertResult:
        """`cache.insert` of the written tokens `fill_key()[:kv_len]` with the request's slots
        (`cached_len`: the cache frees the request's duplicates and, when `finished`, every slot
        past the aligned written part); below the locked `last_node` (no walk of its path, no
        conversion of its tokens) when that node still ends at `locked_len` (== cached_len)."""
        node, depth, end = req.last_node, req.locked_len, req.kv_len
        cache = self.cache
        slots = req.kv if finished else req.kv[:end]
        # NOTE: path_len guards the case where the node no longer ends at locked_len (an
        # in-place extension grew it since): the plain insert then
        if (node is not None and node.parent is not None and not node.removed and depth <= end
                and depth == req.cached_len and cache.path_len(node) == depth):
            return cache.insert_below(node, req.fill_key_range(depth, end), slots[depth:],
                                      cached_len=req.cached_len, finished=finished)
        return cache.insert(req.fill_key()[:end], slots, req.extra_key, cached_len=req.cached_len, finished=finished)

    @_timed
    def release(self, req: Req, cache_tokens: bool = True) -> None:
        """Gives back everything `req` holds: its written prefix goes into the tree (unless
        `cache_tokens` is False or the cache is disabled), other slots to the allocator, the lock
        is dropped. Mutates: tree, allocator, and resets req's KV fields."""
        if req.last_node is None:
            req.reset_kv()
            return
        if cache_tokens and not self.disable_radix_cache and req.kv_len > 0:
            start = time.perf_counter()  # one timed region: insert (it frees the request's
            r = self._insert_written(req, finished=True)  # duplicates and unaligned tail) and unlock
            if self.tier is not None and self.tier.write_policy == "write_through":
                self.tier.backup(r.last_node)
            self.cache.unlock(req.last_node)
            self._tree_s += time.perf_counter() - start
        else:
            if not self.disable_radix_cache:  # else last_node is the root: nothing to unlock
                start = time.perf_counter()
                self.cache.unlock(req.last_node)
                self._tree_s += time.perf_counter() - start
            if req.kv_alloc > req.cached_len:  # cached_len is page-aligned: request pages only
                self.allocator.free(req.kv[req.cached_len :])
        req.reset_kv()

    @_timed
    def flush(self) -> None:
        """Drops the whole tree (only when no request holds KV); mutates tree and allocator."""
        start = time.perf_counter()
        if self.tier is not None:
            self.tier.reset()  # both tiers, each into its allocator
        else:
            self.cache.reset()  # frees into the allocator
        self._tree_s += time.perf_counter() - start

    def check_invariant(self) -> None:
        """Raises MemoryInvariantError unless free + cached == total (call when no request holds KV)."""
        sizes, total = self.cache.sizes(), self.num_slots
        assert sizes.free is not None
        if sizes.free + sizes.total != total:
            raise MemoryInvariantError(
                f"KV accounting broken: free {sizes.free} + cached {sizes.total} != total {total} "
                f"(leak of {total - sizes.free - sizes.total} slots)"
            )
        if sizes.protected != 0:
            raise MemoryInvariantError(f"{sizes.protected} cached tokens still locked while idle")
        self.cache.check_integrity()
        if self.tier is not None:
            host = self.tier.host.sizes()
            assert host.free is not None and self.tier.host.allocator is not None
            if host.free + host.total != self.tier.host.allocator.num_slots or host.protected:
                raise MemoryInvariantError(f"host KV accounting broken: free {host.free} + cached {host.total} != "
                                           f"{self.tier.host.allocator.num_slots} or {host.protected} locked while idle")
            self.tier.host.check_integrity()
