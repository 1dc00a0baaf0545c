"""`RadixCache`: the radix tree of cached KV slots, keyed by token ids (SGLang paper, section 3).

Ownership in one line: the tree owns the slots of its nodes; the caller owns every other slot.
See the package README ("Ownership protocol") for the exact sequence an engine follows.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, TextIO

import numpy as np
import numpy.typing as npt

from radixcache.allocator import SlotAllocator
from radixcache.config import RadixCacheConfig
from radixcache.errors import InvalidKeyError, LockError
from radixcache.events import (
    AllCleared,
    Event,
    PageRemoved,
    PageStored,
    chain_hashes,
    hash_to_bytes,
    namespace_seed,
)
from radixcache.keys import EMPTY as _EMPTY
from radixcache.keys import INT64 as _INT64
from radixcache.keys import TOKEN_BYTES, KeyLike, as_key
from radixcache.keys import key_bytes as _key_bytes
from radixcache.node import TreeNode
from radixcache.policy import EvictionPolicy, make_policy


class MatchResult(NamedTuple):
    """Result of `RadixCache.match_prefix`.

    - `indices`: slot ids of the matched prefix, read-only, shape (length,). Owned by the tree.
    - `last_node`: the node that ends exactly at `length` when returned. Lock it at once (before
      any `evict`) and keep it locked while the slots are in use; a locked node may later be
      split (or grow in place by its single holder's own insert), and it still protects these
      slots.
    - `length`: number of matched tokens, a multiple of `page_size`.
    """

    indices: npt.NDArray[np.int64]
    last_node: TreeNode
    length: int


class PrefixPath(NamedTuple):
    """Result of `RadixCache.find_prefix`: where a key's longest cached prefix ends, found
    without mutating anything.

    - `length`: matched tokens (page-aligned), as `peek_prefix_len` returns.
    - `node`: the deepest node the key matches whole (a namespace root when nothing matches);
      None when the namespace holds nothing.
    - `partial`: the child whose edge the match ends inside, or None.
    - `version`: `RadixCache.version` when found. While the cache's version is unchanged, finding
      the same key again gives the same path, and `touch_path` may refresh it.
    - `next_page`: when the match ends at `node` (no `partial`), the key's page right after
      `length` as int64 bytes (the page `node` has no child for), or None when the key has no
      whole page more; None with a `partial`. Lets `refresh_path` recheck the end without the key.
    """

    length: int
    node: TreeNode | None
    partial: TreeNode | None
    version: int
    next_page: bytes | None = None


class TouchPlan(NamedTuple):
    """Result of `RadixCache.plan_touches`: the clocks a round of `touch_path` calls sets.

    `nodes[i].last_access` becomes (the cache clock before) + `offsets[i]`; the clock advances
    by `ticks`. Valid while the cache's `version` equals `version`.
    """

    nodes: tuple[TreeNode, ...]
    offsets: tuple[int, ...]
    ticks: int
    version: int


class InsertResult(NamedTuple):
    """Result of `RadixCache.insert`.

    - `prefix_len`: leading tokens that were already cached before this call; the caller's
      slots `value[:prefix_len]` were NOT taken by the tree (free the ones you allocated).
    - `last_node`: the node that ends at the inserted (page-aligned) length.
    - `free`: with `insert(..., cached_len=...)`, exactly the slots of `value` the caller must
      now free (duplicates of what the tree already held, and with `finished` the unaligned
      tail and anything past the key); empty when the cache frees them through its allocator,
      or without `cached_len`.
    """

    prefix_len: int
    last_node: TreeNode
    free: npt.NDArray[np.int64] = _EMPTY


class CacheSizes(NamedTuple):
    """Result of `RadixCache.sizes()`, in slots (= tokens).

    - `total`: held by the tree (`evictable + protected`).
    - `evictable`: held by unlocked nodes (`evict` can reclaim them).
    - `protected`: held by locked nodes.
    - `free`: free in the attached `SlotAllocator` (None without one). With an allocator,
      `free + evictable` is what `alloc` can hand out now, and `free + total + (slots held by
      requests) == allocator.num_slots` at all times.
    """

    total: int
    evictable: int
    protected: int
    free: int | None


class RadixCache:
    """Radix tree mapping token-id prefixes to KV slot ids, with locking and policy eviction.

    Keys are cut to whole pages of `page_size` tokens: only `len(key) - len(key) % page_size`
    tokens are ever matched or stored. `extra_key` selects a namespace (adapter id, image salt,
    tenant); namespaces never share nodes. Single-threaded; no method blocks.

    `merge_leaves=True`: an insert that continues a leaf (the next chat turn, an agent's next
    step) extends that leaf in place instead of hanging a one-child chain under it, so paths stay
    short; a locked leaf only for its single holder (an insert with `cached_len` ending at it, or
    `insert_below` it), so no lock ever protects tokens another request appended. `trim_leaves=True`: `evict` frees exactly what is asked (rounded up to pages) by
    cutting the tail of the policy's first leaf, instead of freeing whole leaves. Setting both to
    False gives SGLang's granularity.

    `allocator`: a `SlotAllocator` of the same page size that the cache then frees into itself:
    `evict`, `reset` and `insert(..., cached_len=...)` return empty arrays (nothing left for the
    caller to free), `alloc` evicts as needed, and `sizes().free` is the allocator's.
    Without one, each of those calls returns the slots the caller must free.
    """

    def __init__(
        self,
        page_size: int = 1,
        eviction: str | EvictionPolicy = "lru",
        *,
        enable_events: bool = False,
        merge_leaves: bool = True,
        trim_leaves: bool = True,
        allocator: SlotAllocator | None = None,
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if allocator is not None and allocator.page_size != page_size:
            raise ValueError(f"allocator.page_size={allocator.page_size} != page_size={page_size}")
        self._allocator = allocator
        self._page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self._policy = make_policy(eviction)
        self._enable_events = enable_events
        self._merge_leaves = merge_leaves
        self._trim_leaves = trim_leaves
        self._tick = 0
        self._seq = 0
        # bumped by every change of the node structure or of the cached keys (add / extend / trim
        # / delete a leaf, split, new or dropped namespace, reset); not by clocks, locks, sizes
        self._version = 0
        self._heap: list[tuple[Any, int, TreeNode]] = []
        self._roots: dict[Hashable, TreeNode] = {}
        self._root = self._new_root(None)
        self._evictable = 0
        self._protected = 0
        self._events: list[Event] = []
        # NOTE: called as on_evict(node, keep) by `evict` before `node.value[keep:]` leaves the
        # tree (node still linked, so its path can be read); a host tier offloads there
        self.on_evict: Callable[[TreeNode, int], None] | None = None

    @classmethod
    def from_config(cls, config: RadixCacheConfig, allocator: SlotAllocator | None = None) -> RadixCache:
        """A cache built from `config` (page size, eviction policy, events), freeing into
        `allocator` when given."""
        return cls(config.page_size, config.eviction, enable_events=config.enable_events,
                   merge_leaves=config.merge_leaves, trim_leaves=config.trim_leaves, allocator=allocator)

    # ------------------------------------------------------------------ properties
    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def root(self) -> TreeNode:
        """Root of the default namespace (`extra_key=None`); locking a root is a no-op."""
        return self._root

    @property
    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes (reclaimable by `evict`, leaves first)."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens held by locked nodes (never evicted)."""
        return self._protected

    @property
    def total_size(self) -> int:
        """Tokens held by the tree; always `evictable_size + protected_size`."""
        return self._evictable + self._protected

    @property
    def allocator(self) -> SlotAllocator | None:
        """The attached `SlotAllocator` (the cache frees evicted and surplus slots into it)."""
        return self._allocator

    def sizes(self) -> CacheSizes:
        """`CacheSizes(total, evictable, protected, free)`. Mutates nothing."""
        a = self._allocator
        return CacheSizes(self._evictable + self._protected, self._evictable, self._protected,
                          None if a is None else a.available)

    def alloc(self, num_tokens: int) -> npt.NDArray[np.int64] | None:
        """`allocator.alloc(num_tokens)` (whole pages: `allocator.alloc_size(num_tokens)` slots),
        evicting unlocked leaves in policy order first when too few slots are free; None (and
        nothing evicted) when free + evictable cannot cover it. The request owns the slots.
        Needs an attached allocator. Mutates: the allocator, the tree (eviction)."""
        a = self._allocator
        if a is None:
            raise ValueError("alloc needs a cache built with allocator=SlotAllocator(...)")
        slots = a.alloc(num_tokens)
        if slots is None:
            need = a.alloc_size(num_tokens) - a.available
            if need > self._evictable:
                return None
            self.evict(need)
            slots = a.alloc(num_tokens)
        return slots

    @property
    def version(self) -> int:
        """Structure counter: unchanged means every `find_prefix` result is still exact (no node
        was added, extended, trimmed, split or removed since). Clocks and locks do not count."""
        return self._version

    def aligned_len(self, num_tokens: int) -> int:
        """`num_tokens` rounded down to whole pages: what match and insert consider."""
        return num_tokens - num_tokens % self._page_size

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, key: KeyLike, extra_key: Hashable = None, *, limit: int | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of `key` in namespace `extra_key`, at most `limit`
        tokens when given (an engine passes `len(key) - 1`: the last token is computed for its
        logits). `key`: any 1-D int sequence (see `as_key`).

        Mutates: the access clock and hit count of every node on the matched path, and splits
        the last node when the match ends inside its edge (so `last_node` ends exactly at
        `length`; the unmatched lower half's clock is refreshed too). Never changes which slots
        are cached, nor any size.
        """
        arr = _limited(as_key(key), limit)
        root = self._roots.get(extra_key)
        n = len(arr) - len(arr) % self._page_size
        if root is None or n == 0:
            return MatchResult(_EMPTY, self._root if root is None else root, 0)
        self._tick += 1
        tick = self._tick
        root.last_access = tick
        if arr[: self._page_size].tobytes() not in root.children:
            return MatchResult(_EMPTY, root, 0)  # no first page: the key's bytes are not needed
        kb = _key_bytes(arr, n)
        nb = len(kb)
        pb = self._page_bytes
        node = root
        pos = 0
        values: list[npt.NDArray[np.int64]] = []
        while pos < nb:
            child = node.children.get(kb[pos : pos + pb])
            if child is None:
                break
            ck = child._key if child._tail is None else child.key
            cl = len(ck)
            if kb[pos : pos + cl] != ck:
                m = self._common_len(ck, arr, pos // TOKEN_BYTES)
                child.last_access = tick  # NOTE: the unmatched lower half is refreshed too (as SGLang)
                child = self._split(child, m)
                cl = m * TOKEN_BYTES
            child.last_access = tick
            child.hit_count += 1
            values.append(child.value)
            pos += cl
            node = child
            if len(ck) != cl:
                break
        if not values:
            return MatchResult(_EMPTY, node, 0)
        indices = values[0] if len(values) == 1 else np.concatenate(values)
        return MatchResult(indices, node, pos // TOKEN_BYTES)

    def match_path(self, path: PrefixPath) -> MatchResult:
        """`match_prefix` of the key `path` was found for (by `find_prefix` or `refresh_path`),
        without the key: the same clocks, hit counts, split and result. For a scheduler that
        admits a request it has just peeked. Raises `ValueError` when the cache's `version`
        changed since `path` was found (find it again, or match the key)."""
        if path.version != self._version:
            raise ValueError(f"stale PrefixPath (version {path.version}, cache at {self._version})")
        node, partial = path.node, path.partial
        if node is None:  # no such namespace
            return MatchResult(_EMPTY, self._root, 0)
        if path.length == 0 and path.next_page is None:
            return MatchResult(_EMPTY, node, 0)  # the key has no whole page: match_prefix ticks not
        self._tick += 1
        tick = self._tick
        if partial is not None:  # split where the match ends, as match_prefix does
            partial.last_access = tick
            node = self._split(partial, path.length - self.path_len(node))
        values = self._stamp_path_values(node, tick)
        if not values:
            return MatchResult(_EMPTY, node, 0)
        indices = values[0] if len(values) == 1 else np.concatenate(values[::-1])
        return MatchResult(indices, node, path.length)

    @staticmethod
    def _stamp_path_values(node: TreeNode, tick: int) -> list[npt.NDArray[np.int64]]:
        """Stamps `tick` and one hit on every node from `node` up to its namespace root (the root
        gets the tick only, as match_prefix stamps it); returns their values, deepest first."""
        values: list[npt.NDArray[np.int64]] = []
        cur = node
        while cur.parent is not None:
            cur.last_access = tick
            cur.hit_count += 1
            values.append(cur.value)
            cur = cur.parent
        cur.last_access = tick
        return values

    def match_node(self, node: TreeNode) -> MatchResult:
        """`match_prefix` of the key that ends exactly at `node` (its whole path from the
        namespace root), without walking the key: the same clock tick, access clocks and hit
        counts, and `MatchResult(path slots, node, path length)`. For re-locking the end of a
        just-inserted key (`insert(...).last_node`). Raises `ValueError` for a root or a removed
        node (a root stands for no key: use `match_prefix`)."""
        if node.parent is None or node.removed:
            raise ValueError("match_node needs a live non-root node (use match_prefix for a key)")
        self._tick += 1
        tick = self._tick
        values = self._stamp_path_values(node, tick)
        indices = values[0] if len(values) == 1 else np.concatenate(values[::-1])
        return MatchResult(indices, node, len(indices))

    def hit_node(self, node: TreeNode) -> int:
        """`match_node(node)` without making the slots: the same clock tick, access clocks and
        hit counts; returns the path length. For re-locking a just-inserted key whose slots the
        caller already holds. Raises `ValueError` as `match_node`."""
        if node.parent is None or node.removed:
            raise ValueError("hit_node needs a live non-root node (use match_prefix for a key)")
        self._tick += 1
        return sum(map(len, self._stamp_path_values(node, self._tick)))

    def insert(
        self,
        key: KeyLike,
        value: KeyLike,
        extra_key: Hashable = None,
        priority: int = 0,
        *,
        cached_len: int | None = None,
        finished: bool = True,
    ) -> InsertResult:
        """Cache `value[i]` (a slot id) as the KV of token `key[i]` for the page-aligned part.

        `value` must cover at least the page-aligned part of `key`; only `value[:aligned]` is
        read, with `aligned = aligned_len(len(key))`. The tree takes ownership of
        `value[prefix_len:aligned]` and keeps its own slots for the first `prefix_len` tokens;
        the caller keeps `value[:prefix_len]` (and frees the duplicates it allocated there) and
        the rest `value[aligned:]` (the unaligned tail).

        With `cached_len` (the request's cached prefix length at admission, locked since), the
        cache settles the request's slots: `value` is every slot the request holds, token by
        token (`value[:cached_len]` the tree's), and `free` in the result is exactly what the
        caller must free: the duplicates `value[cached_len:prefix_len]` (another request cached
        those tokens meanwhile) and, when `finished` (the request is done with these slots), all
        of `value[aligned:]`. With `finished=False` (a checkpoint of a running request) the
        request keeps `value[aligned:]`; re-lock at `last_node` (`match_node` gives the tree's
        slots for `value[:aligned]`). With an attached allocator the cache frees them itself.
        Raises `ValueError` for a `cached_len` that is not page-aligned or past the aligned key,
        and `LockError` when the tree no longer held the first `cached_len` tokens (the request
        did not keep its match locked; the tree may then hold a slot twice).

        Mutates: adds at most one leaf or extends one leaf in place (and splits at most one
        node), refreshes the access clock along the path, raises node priorities to at least
        `priority`, grows `total_size` by `aligned - prefix_len` (as `protected_size` when the
        extended leaf is locked, else `evictable_size`); with `cached_len` and an allocator, the
        allocator.
        """
        arr, val, n = self._key_value(key, value)
        if cached_len is not None:
            self._check_cached_len(cached_len, 0, n)
        root = self._roots.get(extra_key)
        if root is None:
            if n == 0:
                r = InsertResult(0, self._root)
                return r if cached_len is None else self._settle(r, val, 0, n, cached_len, finished)
            root = self._new_root(extra_key)
        self._tick += 1
        root.last_access = self._tick
        r = self._insert_below(root, 0, arr, val, n, priority, cached_len)
        return r if cached_len is None else self._settle(r, val, 0, n, cached_len, finished)

    def _check_cached_len(self, cached_len: int, depth: int, n: int) -> None:
        if cached_len % self._page_size or not depth <= cached_len <= depth + n:
            raise ValueError(
                f"cached_len={cached_len} must be page-aligned (page_size={self._page_size}) and within "
                f"[{depth}, {depth + n}] (the path below the node, then the page-aligned key)"
            )

    def _settle(
        self, r: InsertResult, val: npt.NDArray[np.int64], depth: int, n: int, cached_len: int, finished: bool
    ) -> InsertResult:
        """`r` with `free`: the caller's duplicates `val[cached_len - depth : prefix_len - depth]`
        and, when `finished`, `val[n:]` (`val` starts at token `depth`, `n` its aligned part);
        freed into the allocator instead when one is attached."""
        if r.prefix_len < cached_len:
            raise LockError(
                f"the tree held {r.prefix_len} < cached_len={cached_len} tokens of the key: the request's "
                "match was not kept locked (lock(m.last_node) until this insert)"
            )
        lo, hi = cached_len - depth, r.prefix_len - depth
        dup = val[lo:hi]
        tail = val[n:] if finished else _EMPTY
        if not len(tail):
            free = dup
        elif not len(dup):
            free = tail
        else:
            free = np.concatenate((dup, tail))
        if self._allocator is not None:
            if len(free):
                self._allocator.free(free)
            free = _EMPTY
        return InsertResult(r.prefix_len, r.last_node, free)

    def _key_value(self, key: KeyLike, value: KeyLike) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
        """(key, value) as int64 arrays and the key's page-aligned length; raises
        InvalidKeyError when `value` does not cover that length."""
        arr = as_key(key)
        val = as_key(value)
        n = len(arr) - len(arr) % self._page_size
        if len(val) < n:
            raise InvalidKeyError(
                f"len(value)={len(val)} must cover the page-aligned key ({n} of {len(arr)} tokens)"
            )
        return arr, val, n

    def insert_below(
        self,
        node: TreeNode,
        key: KeyLike,
        value: KeyLike,
        priority: int = 0,
        *,
        cached_len: int | None = None,
        finished: bool = True,
    ) -> InsertResult:
        """`insert(path + key, path_slots + value, node.extra_key, priority)`, where `path` is
        the whole key that ends at `node` (from its namespace root) and `path_slots` its slots,
        without walking that path: the same tree, clocks, hit counts, priorities and result
        (`prefix_len` counts from the namespace root). For a caller that holds `node` locked as
        the end of its key's cached prefix (appending what it computed since). A root stands for
        an empty path. `cached_len` and `finished` as for `insert`, where `value` holds the
        request's slots from `path_len(node)` on (so `cached_len >= path_len(node)`). Raises
        `ValueError` for a removed node."""
        if node.removed:
            raise ValueError("insert_below needs a live node")
        if node.parent is None:
            return self.insert(key, value, node.extra_key, priority, cached_len=cached_len, finished=finished)
        arr, val, n = self._key_value(key, value)
        if cached_len is not None:
            self._check_cached_len(cached_len, self.path_len(node), n)
        self._tick += 1
        tick = self._tick
        depth = 0
        cur = node
        while cur.parent is not None:  # what insert's walk down to `node` sets
            cur.last_access = tick
            cur.hit_count += 1
            if priority > cur.priority:
                cur.priority = priority
            depth += len(cur.value)
            cur = cur.parent
        cur.last_access = tick
        r = self._insert_below(node, depth, arr, val, n, priority, depth)
        return r if cached_len is None else self._settle(r, val, depth, n, cached_len, finished)

    def path_len(self, node: TreeNode) -> int:
        """Tokens of the path from the namespace root to `node` (0 for a root); a walk up.
        A locked node keeps it unless its single holder's own insert extends it in place."""
        depth = 0
        while node.parent is not None:
            depth += len(node.value)
            node = node.parent
        return depth

    def _insert_below(
        self,
        node: TreeNode,
        depth: int,
        arr: npt.NDArray[np.int64],
        val: npt.NDArray[np.int64],
        n: int,
        priority: int,
        own_len: int | None,
    ) -> InsertResult:
        """insert's walk from `node` (ending at `depth` tokens, its clock already set) for the
        first `n` (page-aligned) tokens of `arr`, slots `val`; at the current tick. `own_len`:
        where the caller's own lock ends on this key (None: unknown)."""
        tick = self._tick
        kb = _key_bytes(arr, n)
        nb = len(kb)
        pb = self._page_bytes
        pos = 0
        while pos < nb:
            child = node.children.get(kb[pos : pos + pb])
            if child is None:
                break
            ck = child._key if child._tail is None else child.key
            cl = len(ck)
            if kb[pos : pos + cl] != ck:
                m = self._common_len(ck, arr, pos // TOKEN_BYTES)
                child.last_access = tick  # the unmatched lower half too, as match_prefix
                child = self._split(child, m)
                cl = m * TOKEN_BYTES
            child.last_access = tick
            child.hit_count += 1
            if priority > child.priority:
                child.priority = priority
            pos += cl
            node = child
            if len(ck) != cl:
                break
        matched = pos // TOKEN_BYTES
        if pos < nb:
            # NOTE: a leaf grows in place only when no other request's lock would then protect
            # the new tokens: unlocked, or locked once by this caller (it ends where its lock does)
            if (self._merge_leaves and node.parent is not None and not node.children
                    and (node.lock_ref == 0 or (node.lock_ref == 1 and depth + matched == own_len))):
                self._extend_leaf(node, kb[pos:], val[matched:n], priority, tick)
            else:
                node = self._add_leaf(node, kb[pos:], val[matched:n], priority, tick)
        return InsertResult(depth + matched, node)

    def peek_prefix_len(self, key: KeyLike, extra_key: Hashable = None, *, limit: int | None = None) -> int:
        """Length of the longest cached page-aligned prefix of `key` (at most `limit`).
        Mutates nothing."""
        return self._peek(_limited(as_key(key), limit), extra_key)[0]

    def touch_prefix(self, key: KeyLike, extra_key: Hashable = None) -> int:
        """Refresh the access clock of the cached path of `key` (the node where the match ends
        inside an edge included, unsplit); returns the matched length like `peek_prefix_len`.

        For schedulers: touching the prefixes of *waiting* requests every round keeps LRU from
        evicting what is about to be reused. Mutates access clocks only (no split, no hit count).
        """
        return self.touch_path(self.find_prefix(key, extra_key))

    def find_prefix(self, key: KeyLike, extra_key: Hashable = None, *, limit: int | None = None) -> PrefixPath:
        """Where the longest cached page-aligned prefix of `key` (at most `limit`) ends (see
        `PrefixPath`; it stands for the key cut at `limit`). Mutates nothing. A scheduler that
        peeks the same waiting request every round can keep the path and reuse it while
        `version` is unchanged."""
        length, node, partial, page = self._peek(_limited(as_key(key), limit), extra_key)
        return PrefixPath(length, node, partial, self._version, page)

    def refresh_prefix(self, path: PrefixPath, key: KeyLike, extra_key: Hashable = None) -> PrefixPath:
        """`find_prefix(key, extra_key)`, reusing `path` (an earlier `find_prefix` of the same key
        and namespace) without walking the key when no change since can have moved its end: the
        same result as `find_prefix`, current `version`. Mutates nothing.

        Kept when the nodes where the path ends (its deepest matched node and the partly matched
        child) kept their edges and parents and were not removed, and, for a path that ends at a
        node, that node still has no child for the key's next page. Changes elsewhere (new leaves
        under other pages, splits of ancestors, evictions of other leaves) do not move the end.
        """
        kept = self.refresh_path(path)
        return self.find_prefix(key, extra_key) if kept is None else kept

    def refresh_path(self, path: PrefixPath) -> PrefixPath | None:
        """`refresh_prefix(path, key, extra_key)` when that needs no walk of the key (the same
        result, current `version`); None when the key must be found again (`find_prefix`).
        Needs no key: a path that ends at a node rechecks its `next_page`. Mutates nothing."""
        version = self._version
        if path.version == version:
            return path
        node, partial, seen = path.node, path.partial, path.version
        if node is None or node.removed or node.stamp > seen:
            return None
        if partial is not None:
            if partial.removed or partial.stamp > seen:
                return None
            return PrefixPath(path.length, node, partial, version)
        # NOTE: ancestors of `node` are never leaves, so they can only be split (which keeps
        # `node` and its depth); the match went on only through the next page
        page = path.next_page
        if page is not None and page in node.children:
            return None
        return PrefixPath(path.length, node, None, version, page)

    def touch_path(self, path: PrefixPath) -> int:
        """`touch_prefix` of the key `path` was found for: refreshes the access clock of the path
        (one clock tick, as `touch_prefix`); returns `path.length`. Raises `ValueError` when the
        cache's `version` changed since `path` was found (find it again)."""
        if path.version != self._version:
            raise ValueError(f"stale PrefixPath (version {path.version}, cache at {self._version})")
        cur = path.partial if path.partial is not None else path.node
        if cur is None:
            return 0
        self._tick += 1
        tick = self._tick
        while cur is not None:
            cur.last_access = tick
            cur = cur.parent
        return path.length

    def touch_paths(self, paths: Sequence[PrefixPath]) -> None:
        """`touch_path` of each path in order, in one call (the same clocks and ticks): a
        scheduler's round of touches. Raises `ValueError`, touching nothing, if any is stale."""
        self.apply_touches(self.plan_touches(paths))

    def plan_touches(self, paths: Sequence[PrefixPath]) -> TouchPlan:
        """The effect of `touch_paths(paths)` as a plan that `apply_touches` replays in time
        linear in the distinct nodes touched (one entry when no path leaves the root), while
        `version` is unchanged. Mutates nothing; raises `ValueError` if a path is stale."""
        version = self._version
        last: dict[TreeNode, int] = {}
        k = 0
        for path in paths:
            if path.version != version:
                raise ValueError(f"stale PrefixPath (version {path.version}, cache at {version})")
            cur = path.partial if path.partial is not None else path.node
            if cur is None:
                continue
            k += 1  # the k-th touch sets its whole path to (clock before) + k
            while cur is not None:
                last[cur] = k
                cur = cur.parent
        return TouchPlan(tuple(last), tuple(last.values()), k, version)

    def apply_touches(self, plan: TouchPlan) -> None:
        """Replays a `plan_touches` plan (as many times as wanted, each like one more round of
        the same touches). Raises `ValueError` when `version` changed since it was made."""
        if plan.version != self._version:
            raise ValueError(f"stale TouchPlan (version {plan.version}, cache at {self._version})")
        tick = self._tick
        for node, offset in zip(plan.nodes, plan.offsets, strict=True):
            node.last_access = tick + offset
        self._tick = tick + plan.ticks

    # ------------------------------------------------------------------ lock / evict
    def lock(self, node: TreeNode) -> int:
        """Add one reference to `node` and each ancestor; a locked node is never evicted.

        Returns the change of `evictable_size` (<= 0). Mutates lock counts and sizes.
        Raises `LockError` if `node` was evicted or dropped by `reset()`.
        """
        if node.removed:
            raise LockError("cannot lock an evicted node; lock the last_node of a fresh match_prefix")
        delta = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                delta += len(node.value)
            node.lock_ref += 1
            node = node.parent
        self._evictable -= delta
        self._protected += delta
        return -delta

    def unlock(self, node: TreeNode) -> int:
        """Remove one reference from `node` and each ancestor (undo one `lock`).

        Returns the change of `evictable_size` (>= 0). A leaf whose count reaches 0 becomes
        evictable. Raises `LockError` when `node` is not locked (unbalanced unlock) or was dropped
        by `reset()`.
        """
        if node.parent is None:
            return 0
        if node.removed:
            raise LockError("cannot unlock a node dropped by reset(); its lock died with it")
        if node.lock_ref <= 0:
            raise LockError("unlock without a matching lock (node.lock_ref is already 0)")
        delta = 0
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.value)
                if not node.children:
                    self._push(node)
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        return delta

    def evict(self, num_tokens: int) -> npt.NDArray[np.int64]:
        """Evict unlocked leaves, in policy order, until at least `num_tokens` tokens are freed
        or nothing is evictable. A parent left as an unlocked leaf becomes evictable in turn.
        With `trim_leaves` (default) the last leaf visited loses only its tail, so exactly
        `num_tokens` rounded up to whole pages are freed when that many are evictable.

        Returns the freed slot ids for the caller to free in its allocator; empty when the
        cache has an allocator (it freed them there). Calls `on_evict(node, keep)` (when set)
        before each leaf loses `node.value[keep:]`. Mutates the tree, sizes (the allocator).
        """
        if num_tokens <= 0:
            return _EMPTY
        heap = self._heap
        key = self._policy.key
        freed: list[npt.NDArray[np.int64]] = []
        got = 0
        while got < num_tokens and heap:
            k, _, node = heap[0]
            if node.removed or node.children or node.lock_ref:
                heapq.heappop(heap)
                node.in_heap = False
                continue
            cur = key(node)
            if cur != k:
                self._seq += 1
                heapq.heapreplace(heap, (cur, self._seq, node))
                continue
            need = num_tokens - got
            if self._trim_leaves and need < len(node.value):
                keep = len(node.value) - (need + (-need) % self._page_size)
                if keep > 0:
                    if self.on_evict is not None:
                        self.on_evict(node, keep)
                    freed.append(node.value[keep:])
                    got += len(node.value) - keep
                    self._trim_leaf(node, keep)
                    break
            heapq.heappop(heap)
            node.in_heap = False
            if self.on_evict is not None:
                self.on_evict(node, 0)
            freed.append(node.value)
            got += len(node.value)
            self._delete_leaf(node)
        if not freed:
            return _EMPTY
        out = freed[0].copy() if len(freed) == 1 else np.concatenate(freed)
        if self._allocator is not None:
            self._allocator.free(out)
            return _EMPTY
        return out

    def reset(self) -> npt.NDArray[np.int64]:
        """Drop every node (locked or not). Returns all slot ids the tree held, for the caller to
        free (empty with an allocator: freed there). Old node handles become invalid
        (`lock`/`unlock` on them raise `LockError`)."""
        held: list[npt.NDArray[np.int64]] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            node.removed = True
            if node.parent is not None:
                held.append(node.value)
            stack.extend(node.children.values())
        self._heap = []
        self._roots = {}
        self._version += 1
        self._root = self._new_root(None)
        self._evictable = 0
        self._protected = 0
        if self._enable_events:
            self._events.append(AllCleared())
        out = np.concatenate(held) if held else _EMPTY.copy()
        if self._allocator is not None:
            self._allocator.free(out)
            return _EMPTY
        return out

    def take_events(self) -> list[Event]:
        """Stored/removed page events since the last call (empty unless `enable_events`).
        Mutates: clears the event buffer."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ introspection
    def namespaces(self) -> list[Hashable]:
        """The `extra_key`s that currently hold nodes (plus `None`, always present)."""
        return list(self._roots)

    def num_nodes(self) -> int:
        """Number of non-root nodes (walks the tree)."""
        return sum(1 for _ in self._walk())

    def pretty_print(self, file: TextIO | None = None) -> str:
        """Writes an indented dump of the tree to `file` (default stdout) and returns it."""
        lines = [f"RadixCache(page_size={self._page_size}, policy={self._policy.name}, "
                 f"total={self.total_size}, evictable={self._evictable}, protected={self._protected})"]
        for ns, root in self._roots.items():
            lines.append(f"[namespace {ns!r}]")
            stack = [(c, 1) for c in reversed(list(root.children.values()))]
            while stack:
                node, depth = stack.pop()
                toks = node.token_ids()
                shown = ",".join(map(str, toks[:8].tolist())) + (",..." if len(toks) > 8 else "")
                lines.append(f"{'  ' * depth}[{shown}] n={node.num_tokens} lock={node.lock_ref} "
                             f"last={node.last_access}")
                stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        text = "\n".join(lines) + "\n"
        (sys.stdout if file is None else file).write(text)
        return text

    def check_integrity(self) -> None:
        """Verify every invariant; raises `IntegrityError` naming the node and the broken rule.
        Mutates nothing. Cost: a full walk of the tree."""
        from radixcache._integrity import check

        check(self)

    # ------------------------------------------------------------------ internals
    def _new_root(self, extra_key: Hashable) -> TreeNode:
        root = TreeNode(b"", _EMPTY, None, extra_key, self._tick)
        self._version += 1
        root.stamp = self._version
        if self._enable_events:
            root.hashes = []
        self._roots[extra_key] = root
        return root

    def _walk(self) -> Any:
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _common_len(self, edge: bytes, arr: npt.NDArray[np.int64], start: int) -> int:
        """Page-aligned number of leading tokens `edge` shares with `arr[start:]`."""
        a = np.frombuffer(edge, _INT64)
        b = arr[start : start + len(a)]
        k = len(b)
        diff = np.flatnonzero(a[:k] != b)
        m = int(diff[0]) if len(diff) else k
        return m - m % self._page_size

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split `child` after `m` tokens; returns the new upper node. `child` keeps its identity
        as the lower part, so handles held by callers stay valid."""
        # NOTE: 0 < m < child.num_tokens and m is page-aligned; locks and sizes are unchanged.
        parent = child.parent
        assert parent is not None and 0 < m < len(child.value)
        self._version += 1
        child.stamp = self._version  # its edge and parent change
        cut = m * TOKEN_BYTES
        pb = self._page_bytes
        new = TreeNode(child.key[:cut], child.value[:m], parent, child.extra_key, child.created)
        new.lock_ref = child.lock_ref
        new.last_access = child.last_access
        new.hit_count = child.hit_count
        new.priority = child.priority
        new.stamp = self._version
        if child.hashes is not None:
            pages = m // self._page_size
            new.hashes = child.hashes[:pages]
            child.hashes = child.hashes[pages:]
        parent.children[child.key[:pb]] = new
        child.key = child.key[cut:]
        child.value = child.value[m:]
        child.parent = new
        new.children[child.key[:pb]] = child
        return new

    def _add_leaf(
        self, parent: TreeNode, kb: bytes, value: npt.NDArray[np.int64], priority: int, tick: int
    ) -> TreeNode:
        slots = np.array(value, dtype=np.int64)
        slots.setflags(write=False)
        leaf = TreeNode(kb, slots, parent, parent.extra_key, tick)
        self._version += 1
        leaf.stamp = self._version  # the parent's stamp stays: only its children changed
        leaf.priority = priority
        parent.children[kb[: self._page_bytes]] = leaf
        self._evictable += len(slots)
        if self._enable_events:
            prev = hash_to_bytes(parent.hashes[-1]) if parent.hashes else namespace_seed(parent.extra_key)
            toks = leaf.token_ids()
            leaf.hashes = chain_hashes(prev, toks, self._page_size)
            self._events.append(
                PageStored(tuple(leaf.hashes), parent.hashes[-1] if parent.hashes else None,
                           tuple(toks.tolist()), parent.extra_key)
            )
        self._push(leaf)
        return leaf

    def _extend_leaf(
        self, leaf: TreeNode, kb: bytes, value: npt.NDArray[np.int64], priority: int, tick: int
    ) -> None:
        """Append tokens to a leaf in place (a leaf extended by a longer key, e.g. the next chat
        turn) instead of hanging a one-child chain under it: keeps paths short."""
        # NOTE: the leaf's lock (if any) now also covers the new tokens, so they count as protected
        slots = np.concatenate((leaf.value, value))
        slots.setflags(write=False)
        n = len(value)
        self._version += 1
        leaf.stamp = self._version
        if self._enable_events:
            assert leaf.hashes
            parent_hash = leaf.hashes[-1]
            toks = np.frombuffer(kb, _INT64)
            new_hashes = chain_hashes(hash_to_bytes(parent_hash), toks, self._page_size)
            leaf.hashes = leaf.hashes + new_hashes
            self._events.append(PageStored(tuple(new_hashes), parent_hash, tuple(toks.tolist()), leaf.extra_key))
        leaf.append_key(kb)  # joined at the first read of leaf.key (often never)
        leaf.value = slots
        if priority > leaf.priority:
            leaf.priority = priority
        if leaf.lock_ref:
            self._protected += n
        else:
            self._evictable += n
            self._push(leaf)

    def _push(self, node: TreeNode) -> None:
        if not node.in_heap:
            self._seq += 1
            heapq.heappush(self._heap, (self._policy.key(node), self._seq, node))
            node.in_heap = True

    def _trim_leaf(self, node: TreeNode, keep: int) -> None:
        """Drop the tail of an unlocked leaf, keeping its first `keep` tokens (page-aligned)."""
        removed = len(node.value) - keep
        self._version += 1
        node.stamp = self._version
        node.key = node.key[: keep * TOKEN_BYTES]
        node.value = node.value[:keep]
        self._evictable -= removed
        if node.hashes is not None:
            pages = keep // self._page_size
            if self._enable_events:
                self._events.append(PageRemoved(tuple(node.hashes[pages:]), node.extra_key))
            node.hashes = node.hashes[:pages]

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node._key[: self._page_bytes]]  # _key holds at least the first page
        node.removed = True
        self._version += 1
        node.stamp = self._version
        self._evictable -= len(node.value)
        if self._enable_events and node.hashes is not None:
            self._events.append(PageRemoved(tuple(node.hashes), node.extra_key))
        if parent.parent is None:
            if not parent.children and parent.extra_key is not None:
                del self._roots[parent.extra_key]
                parent.removed = True
        elif not parent.children and parent.lock_ref == 0:
            self._push(parent)

    def _peek(
        self, arr: npt.NDArray[np.int64], extra_key: Hashable
    ) -> tuple[int, TreeNode | None, TreeNode | None, bytes | None]:
        """(matched length, deepest fully matched node, child matched only in part or None,
        the key's next page when the match ends at the node: see `PrefixPath`), without mutating
        anything. The node is None when the namespace holds nothing."""
        root = self._roots.get(extra_key)
        n = len(arr) - len(arr) % self._page_size
        if root is None or n == 0:
            return 0, root, None, None
        first = arr[: self._page_size].tobytes()
        if first not in root.children:
            return 0, root, None, first  # the no-sharing case: one page converted
        kb = _key_bytes(arr, n)
        nb = len(kb)
        pb = self._page_bytes
        node = root
        pos = 0
        while pos < nb:
            page = kb[pos : pos + pb]
            child = node.children.get(page)
            if child is None:
                return pos // TOKEN_BYTES, node, None, page
            ck = child._key if child._tail is None else child.key
            if kb[pos : pos + len(ck)] != ck:
                pos += self._common_len(ck, arr, pos // TOKEN_BYTES) * TOKEN_BYTES
                return pos // TOKEN_BYTES, node, child, None
            pos += len(ck)
            node = child
        return pos // TOKEN_BYTES, node, None, None


def _limited(arr: npt.NDArray[np.int64], limit: int | None) -> npt.NDArray[np.int64]:
    """`arr[:limit]` (a view), or `arr` when `limit` is None or not shorter."""
    if limit is None or limit >= len(arr):
        return arr
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    return arr[:limit]
