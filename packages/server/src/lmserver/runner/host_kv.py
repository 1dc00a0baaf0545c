"""HostKVPool: the host-memory KV tier's tensors and copies (radixcache's `KVTransfer`).

The host pool mirrors the device `KVPool` one slot per token, token-major: one row per slot
holding that token's K and V of every layer, (num_slots, num_layers, 2, words), stored as int64
words of the KV bytes (uint8 when a layer's row is not a whole number of words; an FP8 pool
copies as is), pinned on a CUDA host. All copying is the GPU's: no per-token CPU work.

- `offload(device_slots, host_slots)`: on a copy stream, after the current (main) stream's work
  queued so far (the forwards that wrote the slots): gathers the rows of every layer into a
  token-major device staging buffer (device-local, fast); the main stream then waits for that
  gather only, so the freed device slots can be rewritten at once, while the slow part, staging
  -> host pool over PCIe, runs on behind the next forwards.
- `load(host_slots, device_slots)`: on the copy stream, host pool -> device staging right away
  (overlapping whatever the main stream is running; the host rows' writers are earlier offloads
  on the same stream), then, after the main stream's queued work (the fresh device slots' last
  readers), the scatter into the device pool; the main stream waits for that, so the forward
  that reads the slots comes after the copy while the CPU goes on scheduling.

Every host-side copy is on the one copy stream, so a host slot is never read before its offload
nor rewritten before an earlier load read it; radixcache may reuse a slot as soon as a call
returns (the `KVTransfer` contract). The staging buffers come from the copy stream's caching
allocator and are only used on it, so freeing them after the enqueue is safe.

IO backends (`io_backend`): `kernel` (the GPU's copy kernels read and write the pinned host pool
directly through its device address, unified addressing: one kernel per staging chunk whatever
the host slots' order), `direct` (one DMA per run of consecutive host slots), `auto` (`kernel`
when the host pool is device-addressable, else `direct`). On a CPU both run the same code on CPU
tensors. `CopyStreams` is the ordering seam: tests pass a deferred fake that replays both
streams' operations in adversarial orders.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from lmserver.forward.kv_pool import KVPool

IO_BACKENDS = ("auto", "kernel", "direct")
DEFAULT_CHUNK_TOKENS = 4096  # staging per copy: 512 MiB at 128 KiB per token (Llama-3-8B bf16)


class CopyStreams(Protocol):
    """The two queues HostKVPool orders its work on: the engine's main stream (forwards) and a
    copy stream. Each call's effect is on work issued *after* it."""

    def on_copy(self, fn: Callable[[], None]) -> None:
        """Issues `fn`'s work on the copy stream."""
        ...

    def copy_waits_main(self) -> None:
        """Later copy-stream work waits for the main-stream work issued so far."""
        ...

    def main_waits_copy(self) -> None:
        """Later main-stream work waits for the copy-stream work issued so far."""
        ...


class CudaCopyStreams:
    """`CopyStreams` of a CUDA device: a side stream and events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def on_copy(self, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(self.stream):
            fn()

    def copy_waits_main(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def main_waits_copy(self) -> None:
        done = torch.cuda.Event()
        done.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(done)


class ImmediateStreams:
    """`CopyStreams` of a CPU: every operation runs when issued, so order is program order."""

    def on_copy(self, fn: Callable[[], None]) -> None:
        fn()

    def copy_waits_main(self) -> None:
        pass

    def main_waits_copy(self) -> None:
        pass


class _DeviceArray:
    """A pinned host tensor presented as device memory (`__cuda_array_interface__`): with unified
    addressing its host address is also a device address, so torch's CUDA kernels read and write
    it over the bus directly."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t  # keeps the host memory alive as long as the view
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "strides": None, "data": (t.data_ptr(), False), "version": 3,
            "typestr": {torch.int64: "<i8", torch.uint8: "|u1"}[t.dtype],
        }


class _Staged:
    """The device staging rows of one chunk, handed from one copy-stream operation to the next."""

    rows: torch.Tensor | None = None

    def take(self) -> torch.Tensor:
        assert self.rows is not None, "a staged chunk consumed before it was staged"
        return self.rows


def _runs(slots: npt.NDArray[np.int64]) -> list[tuple[int, int, int]]:
    """(start index, end index, first slot) of each run of consecutive slot ids."""
    if len(slots) == 0:
        return []
    cuts = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(slots)]))
    return [(int(a), int(b), int(slots[a])) for a, b in zip(starts, ends, strict=True)]


class HostKVPool:
    """A host KV pool of `num_slots` rows (slot 0 padding) for the device `pool` (module docstring).

    `streams` defaults to a CUDA side stream on a CUDA pool and immediate execution on a CPU one;
    `chunk_tokens` bounds the device staging buffer of one copy."""

    def __init__(
        self,
        pool: KVPool,
        num_slots: int,
        pin_memory: bool | None = None,
        *,
        io_backend: str = "auto",
        streams: CopyStreams | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend must be one of {IO_BACKENDS}, got {io_backend!r}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.pool = pool
        self.num_slots = num_slots
        self.device = pool.k_cache[0].device
        self.on_cuda = self.device.type == "cuda"
        self.pin = self.on_cuda if pin_memory is None else pin_memory
        self.chunk_tokens = chunk_tokens
        layer_bytes = pool.k_cache[0][0].numel() * pool.k_cache[0].element_size()
        self.word = torch.int64 if layer_bytes % 8 == 0 else torch.uint8
        self.layer_words = layer_bytes // torch.empty((), dtype=self.word).element_size()
        self.row_shape = (pool.num_layers, 2, self.layer_words)  # (L, K|V, words)
        # the device caches as (slots, words) views, K and V of each layer
        self._k = [self._words(c) for c in pool.k_cache]
        self._v = [self._words(c) for c in pool.v_cache]
        # NOTE: `empty`: untouched host pages cost nothing on CPU; every slot read was written first
        self.kv = torch.empty((num_slots, *self.row_shape), dtype=self.word, pin_memory=self.pin)
        self.streams: CopyStreams = streams or (CudaCopyStreams(self.device) if self.on_cuda else ImmediateStreams())
        self.host_view = self.kv  # what the copy kernels index: on CUDA the device view of `kv`
        if self.on_cuda:
            self.io_backend = self._pick_backend(io_backend)
        else:  # the same code on CPU tensors: `kernel` indexes the host pool itself
            self.io_backend = "direct" if io_backend == "direct" else "kernel"
        self.offloaded_tokens = 0
        self.loaded_tokens = 0

    def _words(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(torch.uint8).view(cache.shape[0], -1).view(self.word)  # (slots, words)

    def _pick_backend(self, wanted: str) -> str:
        if wanted == "direct":
            return "direct"
        view = self._device_view()
        if view is None:
            if wanted == "kernel":
                raise ValueError("io_backend 'kernel' needs the pinned host pool to be device-addressable "
                                 "(unified addressing); use 'direct'")
            return "direct"
        self.host_view = view
        return "kernel"

    def _device_view(self) -> torch.Tensor | None:
        """The host pool as a CUDA tensor, checked by a round trip through row 0 (the padding
        slot), or None when this device cannot address pinned host memory."""
        if not self.pin:
            return None
        try:
            view = torch.as_tensor(_DeviceArray(self.kv), device=self.device)
            if view.device != self.device or view.data_ptr() != self.kv.data_ptr():
                return None
            probe = torch.arange(self.kv[0].numel(), device=self.device, dtype=torch.int64).to(self.word)
            view[0].view(-1).copy_(probe)
            torch.cuda.synchronize(self.device)
            ok = torch.equal(self.kv[0].view(-1), probe.cpu())
            self.kv[0].zero_()
            return view if ok else None
        except (RuntimeError, TypeError, ValueError):
            return None

    @staticmethod
    def bytes_per_slot(pool: KVPool) -> int:
        """Host bytes of one token (K and V, all layers): the device pool's."""
        return pool.bytes_per_slot(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)

    @staticmethod
    def available_host_bytes() -> int:
        """Host memory free now (physical pages not in use), in bytes."""
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))

    def _to_device(self, *arrays: npt.NDArray[np.int64]) -> list[torch.Tensor]:
        """Index arrays on the device, through one pinned buffer and one async copy (no sync)."""
        flat = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays]))
        if self.on_cuda:
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        return list(torch.split(flat, [len(a) for a in arrays]))

    # ------------------------------------------------------------------ the copies
    def offload(self, device_slots: npt.NDArray[np.int64], host_slots: npt.NDArray[np.int64]) -> None:
        """Copies device rows `device_slots` into host rows `host_slots` (all layers, K and V).
        When it returns, later main-stream writes to `device_slots` come after the read and
        later copies of `host_slots` after the write. Mutates the host pool (asynchronously)."""
        n = len(device_slots)
        if n != len(host_slots):
            raise ValueError(f"offload of {n} device slots into {len(host_slots)} host slots")
        if n == 0:
            return
        s = self.streams
        s.copy_waits_main()  # the forwards that wrote the rows go first
        for a in range(0, n, self.chunk_tokens):
            dev, host = device_slots[a : a + self.chunk_tokens], host_slots[a : a + self.chunk_tokens]
            staged = _Staged()
            s.on_copy(functools.partial(self._gather, staged, dev))
            s.main_waits_copy()  # NOTE: only the device-local gather: the slots may be rewritten after it
            s.on_copy(functools.partial(self._write_host, staged, host))
        self.offloaded_tokens += n

    def load(self, host_slots: npt.NDArray[np.int64], device_slots: npt.NDArray[np.int64]) -> None:
        """Copies host rows `host_slots` into device rows `device_slots`; ordered before any
        later main-stream work (the forward that reads them) and after the main-stream work issued
        so far (the slots' previous readers). Mutates the device pool (asynchronously)."""
        n = len(host_slots)
        if n != len(device_slots):
            raise ValueError(f"load of {n} host slots into {len(device_slots)} device slots")
        if n == 0:
            return
        s = self.streams
        for a in range(0, n, self.chunk_tokens):
            host, dev = host_slots[a : a + self.chunk_tokens], device_slots[a : a + self.chunk_tokens]
            staged = _Staged()
            s.on_copy(functools.partial(self._read_host, staged, host))
            s.copy_waits_main()  # NOTE: after the bus transfer above, so that overlaps the main stream
            s.on_copy(functools.partial(self._scatter, staged, dev))
        s.main_waits_copy()
        self.loaded_tokens += n

    # ------------------------------------------------------------------ stream-side bodies
    def _gather(self, staged: _Staged, device_slots: npt.NDArray[np.int64]) -> None:
        """Stages device rows `device_slots` of every layer, token-major: (n, L, 2, words)."""
        (dev_idx,) = self._to_device(device_slots)
        n = len(dev_idx)
        layer_major = torch.empty((len(self._k), 2, n, self.layer_words), dtype=self.word, device=self.device)
        for layer, (k, v) in enumerate(zip(self._k, self._v, strict=True)):
            torch.index_select(k, 0, dev_idx, out=layer_major[layer, 0])
            torch.index_select(v, 0, dev_idx, out=layer_major[layer, 1])
        staged.rows = layer_major.permute(2, 0, 1, 3).contiguous()

    def _scatter(self, staged: _Staged, device_slots: npt.NDArray[np.int64]) -> None:
        """Writes the staged token-major rows (n, L, 2, words) into device rows `device_slots`."""
        rows, staged.rows = staged.take(), None
        (dev_idx,) = self._to_device(device_slots)
        for layer, (k, v) in enumerate(zip(self._k, self._v, strict=True)):
            k.index_copy_(0, dev_idx, rows[:, layer, 0])
            v.index_copy_(0, dev_idx, rows[:, layer, 1])

    def _write_host(self, staged: _Staged, host_slots: npt.NDArray[np.int64]) -> None:
        rows, staged.rows = staged.take(), None
        if self.io_backend == "kernel":
            (idx,) = self._to_device(host_slots)
            self.host_view.index_copy_(0, idx, rows)
            return
        for a, b, slot in _runs(host_slots):
            self.kv[slot : slot + b - a].copy_(rows[a:b], non_blocking=True)

    def _read_host(self, staged: _Staged, host_slots: npt.NDArray[np.int64]) -> None:
        if self.io_backend == "kernel":
            (idx,) = self._to_device(host_slots)
            staged.rows = self.host_view.index_select(0, idx)
            return
        rows = torch.empty((len(host_slots), *self.row_shape), dtype=self.word, device=self.device)
        for a, b, slot in _runs(host_slots):
            rows[a:b].copy_(self.kv[slot : slot + b - a], non_blocking=True)
        staged.rows = rows

    def usage_bytes(self, used_slots: int) -> int:
        """Host bytes that `used_slots` slots hold."""
        return used_slots * self.bytes_per_slot(self.pool)
