"""`HierarchicalCache`: a device tier and a host tier of radix trees, one key space (HiCache).

The device tree (`RadixCache` with the device `SlotAllocator`) is the engine's cache as before.
A second tree, of the same page size, holds host-memory slots of a larger host pool. A cached
prefix is on the device, on the host, or on both; `residency(key)` says which part is where.

- Device eviction offloads instead of dropping: before an evicted leaf's slots go back to the
  device allocator, the part of its path the host tree lacks is copied to fresh host slots
  (`KVTransfer.offload`) and inserted into the host tree. The host tree evicts LRU (its own
  policy) when its pool is full; what it evicts is gone.
- `match_prefix` returns the device part and loads the host part back: fresh device slots (the
  device allocator, evicting, hence offloading, as needed), `KVTransfer.load`, then inserted into
  the device tree, so the result is one device `MatchResult` over both parts.
- Locks: while a load or an offload runs, the device node it extends and the host node it reads
  or extends are locked, so the allocations it makes (which evict, in either tier) never take
  slots it is copying from or into.
- Write policy: `write_back` (default) copies to the host only on device eviction;
  `write_through` also copies every `insert` at once (`backup`), so eviction then drops.

Torch-free: the copies are the engine's (`KVTransfer`). Single-threaded, like `RadixCache`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from radixcache.allocator import SlotAllocator
from radixcache.cache import CacheSizes, InsertResult, RadixCache, _limited
from radixcache.keys import INT64 as _INT64
from radixcache.keys import KeyLike, as_key
from radixcache.node import TreeNode
from radixcache.policy import EvictionPolicy

WritePolicy = Literal["write_back", "write_through"]
WRITE_POLICIES: tuple[WritePolicy, ...] = ("write_back", "write_through")


class KVTransfer(Protocol):
    """The engine's copies between its device KV pool and its host KV pool, by slot ids.

    Both are called with equal-length int64 arrays. When a call returns, the source slots may be
    reused by later work on the engine's side (the engine orders its later writes after the copy:
    a synchronous copy, or one on a stream that later work waits for), and the copies take effect
    in call order (a host slot offloaded to, then loaded from, or loaded from, then reused by a
    later offload, is read and written in that order: lmserver issues all of them on one stream)."""

    def offload(self, device_slots: npt.NDArray[np.int64], host_slots: npt.NDArray[np.int64]) -> None:
        """Copy the KV of `device_slots[i]` into `host_slots[i]`."""
        ...

    def load(self, host_slots: npt.NDArray[np.int64], device_slots: npt.NDArray[np.int64]) -> None:
        """Copy the KV of `host_slots[i]` into `device_slots[i]` (before any forward reads them)."""
        ...


class TieredMatch(NamedTuple):
    """Result of `HierarchicalCache.match_prefix`: a device `MatchResult` over both tiers.

    - `indices`, `last_node`, `length`: as `MatchResult` (device slots, device node: lock it at
      once), covering `device_len + host_len` tokens.
    - `device_len`: tokens that were already on the device.
    - `host_len`: tokens loaded back from the host (`KVTransfer.load` was called for them).
    """

    indices: npt.NDArray[np.int64]
    last_node: TreeNode
    length: int
    device_len: int
    host_len: int


class Residency(NamedTuple):
    """Result of `HierarchicalCache.residency`: `device_len` leading tokens of the key are on
    the device, the next `host_len` only on the host (the host may also hold some device ones)."""

    device_len: int
    host_len: int


class TieredSizes(NamedTuple):
    """Result of `HierarchicalCache.sizes()`: each tier's `CacheSizes` (slots of its own pool)."""

    device: CacheSizes
    host: CacheSizes


@dataclass
class TierStats:
    """Counters of a `HierarchicalCache`, in tokens unless named otherwise.

    - `host_hits`: matches that loaded something back; `host_hit_tokens`: tokens they loaded.
    - `offloaded_tokens`: copied device -> host (evictions, and `backup` with write-through).
    - `dropped_tokens`: evicted from the device without a host copy (host pool full of locked
      nodes); `load_failures`: host hits not loaded (device pool full of locked nodes).
    """

    host_hits: int = 0
    host_hit_tokens: int = 0
    offloaded_tokens: int = 0
    dropped_tokens: int = 0
    load_failures: int = 0


class HierarchicalCache:
    """A device `RadixCache` backed by a host `RadixCache` (see the module docstring).

    `device` and `host` must each own a `SlotAllocator` (`RadixCache(allocator=...)`) of one
    page size. The engine keeps using `device` for everything it did before (lock, unlock,
    insert, alloc, evict, sizes); this object adds `match_prefix` with load-back, `residency`,
    `backup`, `sizes`, `stats`. It installs itself as `device.on_evict`.
    """

    def __init__(
        self, device: RadixCache, host: RadixCache, transfer: KVTransfer, *, write_policy: WritePolicy = "write_back"
    ) -> None:
        if device.allocator is None or host.allocator is None:
            raise ValueError("both tiers need a RadixCache built with allocator=SlotAllocator(...)")
        if device.page_size != host.page_size:
            raise ValueError(f"device page_size={device.page_size} != host page_size={host.page_size}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if device.on_evict is not None:
            raise ValueError("the device cache already has an on_evict listener")
        if device.total_size or host.total_size:
            raise ValueError("build a HierarchicalCache over empty caches")
        self._device = device
        self._host = host
        self._transfer = transfer
        self._write_through = write_policy == "write_through"
        self.write_policy: WritePolicy = write_policy
        self.stats = TierStats()
        device.on_evict = self._on_device_evict

    @classmethod
    def build(
        cls,
        device_allocator: SlotAllocator,
        host_allocator: SlotAllocator,
        transfer: KVTransfer,
        *,
        eviction: str | EvictionPolicy = "lru",
        host_eviction: str | EvictionPolicy = "lru",
        write_policy: WritePolicy = "write_back",
    ) -> HierarchicalCache:
        """Both trees from their allocators (page size taken from the device allocator)."""
        ps = device_allocator.page_size
        return cls(RadixCache(ps, eviction, allocator=device_allocator),
                   RadixCache(ps, host_eviction, allocator=host_allocator), transfer, write_policy=write_policy)

    @property
    def device(self) -> RadixCache:
        return self._device

    @property
    def host(self) -> RadixCache:
        return self._host

    def sizes(self) -> TieredSizes:
        """Both tiers' `CacheSizes`. Mutates nothing."""
        return TieredSizes(self._device.sizes(), self._host.sizes())

    def residency(self, key: KeyLike, extra_key: Hashable = None, *, limit: int | None = None) -> Residency:
        """Where the longest cached prefix of `key` (at most `limit` tokens) lives. Mutates nothing."""
        arr = as_key(key)
        d = self._device.peek_prefix_len(arr, extra_key, limit=limit)
        h = self._host.peek_prefix_len(arr, extra_key, limit=limit)
        return Residency(d, max(0, h - d))

    def match_prefix(
        self, key: KeyLike, extra_key: Hashable = None, *, limit: int | None = None, load: bool = True
    ) -> TieredMatch:
        """`device.match_prefix(key, extra_key, limit=limit)`, extended by the host tier's longer
        match when there is one and `load`: device slots are allocated for the host part (evicting
        unlocked device leaves, which offloads them), `KVTransfer.load` copies it, and it is
        inserted into the device tree. When the device cannot make room (everything locked) the
        result is the device part alone (`stats.load_failures`).

        Mutates: both trees' clocks (and splits, as `match_prefix`), the device tree and
        allocator (the loaded part, evictions), the host tree (offloads), `stats`.
        """
        arr = _limited(as_key(key), limit)
        dev, host = self._device, self._host
        m = dev.match_prefix(arr, extra_key)
        if not load or host.peek_prefix_len(arr, extra_key) <= m.length:
            return TieredMatch(m.indices, m.last_node, m.length, m.length, 0)
        hm = host.match_prefix(arr, extra_key)  # refreshes the host clocks of what it reuses
        n = hm.length - m.length
        dev.lock(m.last_node)
        host.lock(hm.last_node)  # NOTE: device evictions below offload into the host tree
        try:
            slots = dev.alloc(n)
            if slots is None:
                self.stats.load_failures += 1
                return TieredMatch(m.indices, m.last_node, m.length, m.length, 0)
            self._transfer.load(hm.indices[m.length :], slots)
            value = np.concatenate((m.indices, slots))
            r = dev.insert(arr[: hm.length], value, extra_key, cached_len=m.length)
        finally:
            host.unlock(hm.last_node)
            dev.unlock(m.last_node)
        self.stats.host_hits += 1
        self.stats.host_hit_tokens += n
        full = dev.match_node(r.last_node)
        return TieredMatch(full.indices, full.last_node, full.length, m.length, n)

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
        """`device.insert(...)`, then with write-through `backup` of the inserted path.
        Mutates: as `RadixCache.insert`; with write-through the host tree and `stats`."""
        r = self._device.insert(key, value, extra_key, priority, cached_len=cached_len, finished=finished)
        if self._write_through:
            self.backup(r.last_node)
        return r

    def backup(self, node: TreeNode) -> int:
        """Copies to the host the part of the path ending at device node `node` that the host
        tree lacks (what write-through does after each insert); returns the tokens copied (0 when
        all was there, `node` is a root, or the host pool is full of locked nodes).
        Mutates: the host tree and allocator (evicting LRU), `stats`."""
        if node.parent is None or node.removed:
            return 0
        return self._offload_path(node, 0)

    def reset(self) -> None:
        """Drops both trees (their slots go back to their allocators); `stats` are kept."""
        self._device.reset()
        self._host.reset()

    def check_integrity(self) -> None:
        """Both trees' `check_integrity()`."""
        self._device.check_integrity()
        self._host.check_integrity()

    # ------------------------------------------------------------------ internals
    def _on_device_evict(self, node: TreeNode, keep: int) -> None:
        self._offload_path(node, len(node.value) - keep)

    def _offload_path(self, node: TreeNode, evicted: int) -> int:
        """Copies what the host lacks of the path ending at `node` (still linked in the device
        tree); returns tokens copied. When the host pool cannot take them (all locked), copies
        nothing and counts the last `evicted` tokens (those leaving the device) as dropped."""
        keys: list[bytes] = []
        values: list[npt.NDArray[np.int64]] = []
        cur = node
        while cur.parent is not None:
            keys.append(cur.key)
            values.append(cur.value)
            cur = cur.parent
        arr = np.frombuffer(b"".join(reversed(keys)), _INT64)
        end = len(arr)
        host = self._host
        hm = host.match_prefix(arr, node.extra_key)
        if hm.length >= end:
            return 0
        need = end - hm.length
        host.lock(hm.last_node)  # its slots stay while the host allocator evicts for ours
        try:
            slots = host.alloc(need)
        finally:
            host.unlock(hm.last_node)
        if slots is None:
            self.stats.dropped_tokens += min(evicted, need)
            return 0
        dev_slots = np.concatenate(values[::-1])[hm.length :]
        self._transfer.offload(dev_slots, slots)
        r = host.insert(arr, np.concatenate((hm.indices, slots)), node.extra_key, cached_len=hm.length)
        assert r.prefix_len == hm.length and not len(r.free)
        self.stats.offloaded_tokens += need
        return need


__all__ = [
    "WRITE_POLICIES",
    "HierarchicalCache",
    "KVTransfer",
    "Residency",
    "TierStats",
    "TieredMatch",
    "TieredSizes",
    "WritePolicy",
]
