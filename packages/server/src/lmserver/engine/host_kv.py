"""HostKVPool: the host-memory KV tier's tensors and copies (radixcache's `KVTransfer`).

The host pool mirrors the device `KVPool` one slot per token, token-major: one row per slot
holding that token's K and V of every layer, (num_slots, num_layers, 2, num_kv_heads, row bytes),
stored as bytes (an FP8 pool copies as is), pinned on a CUDA host. A copy of n tokens then moves
n contiguous rows on the host side (one gather or scatter of large rows) and one transfer.
Which host slots are free is decided by the scheduler's host `SlotAllocator` (radixcache's
`HierarchicalCache`); this module only copies by slot ids.

- `offload(device_slots, host_slots)`: gathers the rows on the device (the current stream, so
  after every forward already queued that wrote them), copies them to a pinned staging buffer
  and scatters them into the host pool; synchronous (it runs only when the device evicts).
- `load(host_slots, device_slots)`: gathers the host rows into a pinned buffer, copies them on a
  side CUDA stream (after the current stream's queued work, which may still read the slots' old
  contents) and scatters them into the device pool; the current stream then waits on an event,
  so the forward that reads the slots comes after the copy while the CPU goes on scheduling.
"""

from __future__ import annotations

import os
from contextlib import nullcontext as _nullcontext

import numpy as np
import numpy.typing as npt
import torch

from lmserver.engine.kv_pool import KVPool


class HostKVPool:
    """A host KV pool of `num_slots` rows (slot 0 padding) for the device `pool`."""

    def __init__(self, pool: KVPool, num_slots: int, pin_memory: bool | None = None) -> None:
        self.pool = pool
        self.num_slots = num_slots
        self.device = pool.k_cache[0].device
        self.on_cuda = self.device.type == "cuda"
        self.pin = self.on_cuda if pin_memory is None else pin_memory
        self.row_shape = (pool.num_layers, 2, *self._bytes(pool.k_cache[0]).shape[1:])  # (L, K|V, KV, D')
        # NOTE: `empty`: untouched host pages cost nothing on CPU; every slot read was written first
        self.kv = torch.empty((num_slots, *self.row_shape), dtype=torch.uint8, pin_memory=self.pin)
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.offloaded_tokens = 0
        self.loaded_tokens = 0

    @staticmethod
    def bytes_per_slot(pool: KVPool) -> int:
        """Host bytes of one token (K and V, all layers): the device pool's."""
        return pool.bytes_per_slot(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)

    @staticmethod
    def available_host_bytes() -> int:
        """Host memory free now (physical pages not in use), in bytes."""
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8)  # (num_slots, num_kv_heads, head_dim * element size)

    @staticmethod
    def _index(slots: npt.NDArray[np.int64], device: torch.device) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(device)

    def offload(self, device_slots: npt.NDArray[np.int64], host_slots: npt.NDArray[np.int64]) -> None:
        """Copies device rows `device_slots` into host rows `host_slots` (all layers, K and V);
        returns when the host pool holds them. Mutates the host pool."""
        n = len(device_slots)
        if n == 0:
            return
        dev_idx = self._index(device_slots, self.device)
        pool = self.pool
        rows = torch.stack([
            torch.stack((self._bytes(k).index_select(0, dev_idx), self._bytes(v).index_select(0, dev_idx)), 1)
            for k, v in zip(pool.k_cache, pool.v_cache, strict=True)
        ], 1)  # (n, L, 2, KV, D')
        if self.on_cuda:
            staged = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=self.pin)
            staged.copy_(rows)  # waits for the gather (the current stream's queued work first)
            rows = staged
        self.kv.index_copy_(0, self._index(host_slots, torch.device("cpu")), rows)
        self.offloaded_tokens += n

    def load(self, host_slots: npt.NDArray[np.int64], device_slots: npt.NDArray[np.int64]) -> None:
        """Copies host rows `host_slots` into device rows `device_slots`; on CUDA asynchronously,
        ordered before any later work of the current stream. Mutates the device pool."""
        n = len(host_slots)
        if n == 0:
            return
        staged = torch.empty((n, *self.row_shape), dtype=torch.uint8, pin_memory=self.pin)
        # NOTE: a pinned buffer comes from torch's caching host allocator, which keeps it until
        # the non_blocking copy that reads it has run
        torch.index_select(self.kv, 0, self._index(host_slots, torch.device("cpu")), out=staged)
        pool = self.pool
        main = torch.cuda.current_stream(self.device) if self.stream is not None else None
        if self.stream is not None and main is not None:
            self.stream.wait_stream(main)  # the slots' previous readers and writers go first
        with torch.cuda.stream(self.stream) if self.stream is not None else _nullcontext():
            dev_idx = self._index(device_slots, self.device)
            rows = staged.to(self.device, non_blocking=True)
            for layer in range(pool.num_layers):
                self._bytes(pool.k_cache[layer]).index_copy_(0, dev_idx, rows[:, layer, 0])
                self._bytes(pool.v_cache[layer]).index_copy_(0, dev_idx, rows[:, layer, 1])
        if self.stream is not None and main is not None:
            done = torch.cuda.Event()
            done.record(self.stream)
            main.wait_event(done)
        self.loaded_tokens += n

    def usage_bytes(self, used_slots: int) -> int:
        """Host bytes that `used_slots` slots hold."""
        return used_slots * self.bytes_per_slot(self.pool)
