"""Batch token masks: fill one int32 bitmask for the constrained rows of a sampling batch on
the CPU, then apply it to the logits on their device.

CPU logits: `cfsm.torch.apply_token_bitmask_` on the constrained rows only. CUDA logits: the
Triton kernel of `lmserver.kernels.bitmask` over the whole batch in one launch, with all-ones
rows for unconstrained requests (their logits are left as they are); the mask is filled in a
pinned host buffer and copied without blocking into a device buffer kept across steps.
`BatchMasker(kernel_on_cpu=True)` takes the kernel path for CPU logits too (Triton's
interpreter, TRITON_INTERPRET=1: the test of both paths).

Two phases, so the host work leaves the decode step's critical path: `prepare` fills the mask
(and on CUDA starts its copy) while the device runs the forward; `apply` at sampling time only
launches the apply. Invariant: a prepared row is used only when its grammar is still in the
state it was filled from (`ReqGrammar.mask_key`: index, DFA state, finished); otherwise the
whole batch is filled again at `apply` (`num_stale_rows` counts such rows). `apply` without a
`prepare` fills then (the single-phase path).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import cfsm
from lmserver.engine.constrained.grammar import ReqGrammar

__all__ = ["BatchMasker"]


@dataclass
class _Prepared:
    """A filled batch mask. `keys[i]` is row i's `ReqGrammar.mask_key()` at the fill (None:
    unconstrained). `mask`: (B, words) on `device` (kernel path) or (len(rows), words) on the
    host (torch path, the constrained rows only)."""

    device: torch.device
    rows: list[int]
    keys: list[tuple[Any, int, bool] | None]
    mask: torch.Tensor
    kernel: bool


def _same_key(a: tuple[Any, int, bool], b: tuple[Any, int, bool]) -> bool:
    # NOTE: the index by identity (comparing two indexes by value would compare their tables)
    return a[0] is b[0] and a[1] == b[1] and a[2] == b[2]


class BatchMasker:
    """Reusable host and device buffers for the batch bitmask.

    Host-time counters (on CUDA the copy and the apply are launches: their device time is not
    included): `prepare_time_s` (fill + copy launch, overlaps the forward when called after its
    launch), `apply_time_s` (the apply at sampling time, including any fill it had to do),
    `mask_time_s` their sum, `fill_time_s` the cfsm fills alone.
    """

    def __init__(self, vocab_size: int, *, kernel_on_cpu: bool = False) -> None:
        self.vocab_size = vocab_size
        self.kernel_on_cpu = kernel_on_cpu  # the Triton kernel for CPU logits too (interpreter tests)
        self.num_words = (vocab_size + 31) // 32
        self._host = np.zeros((0, self.num_words), dtype=np.int32)
        # CUDA path: a page-locked host buffer (so the copy is asynchronous), its numpy view, the
        # device buffer it is copied into, and the event of the last copy out of it
        self._pinned: torch.Tensor | None = None
        self._pinned_np = np.zeros((0, self.num_words), dtype=np.int32)
        self._dev: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._copy_pending = False
        self._prepared: _Prepared | None = None
        self.fill_time_s = 0.0
        self.prepare_time_s = 0.0
        self.apply_time_s = 0.0
        self.num_masked_rows = 0
        self.num_prepared_used = 0  # batches applied from a mask prepared before `apply`
        self.num_stale_rows = 0  # prepared rows whose grammar moved before `apply` (refilled)

    @property
    def mask_time_s(self) -> float:
        """Host time of `prepare` and `apply` together."""
        return self.prepare_time_s + self.apply_time_s

    # --- buffers --------------------------------------------------------------------------------

    def _buffer(self, rows: int) -> np.ndarray:
        if self._host.shape[0] < rows:
            self._host = np.zeros((max(rows, 2 * self._host.shape[0]), self.num_words), dtype=np.int32)
        return self._host[:rows]

    def _pinned_buffer(self, rows: int) -> np.ndarray:
        # NOTE: the last copy may still read this buffer: wait for it before refilling (normally
        # long done: sampling read the tokens back in between, so query() answers without waiting)
        if self._copy_pending:
            assert self._copied is not None
            if not self._copied.query():
                self._copied.synchronize()
            self._copy_pending = False
        if self._pinned is None or self._pinned.shape[0] < rows:
            size = max(rows, 2 * self._pinned_np.shape[0])
            self._pinned = torch.empty((size, self.num_words), dtype=torch.int32, pin_memory=True)
            self._pinned_np = self._pinned.numpy()
        return self._pinned_np[:rows]

    def _device_buffer(self, rows: int, device: torch.device) -> torch.Tensor:
        # NOTE: rewriting it is ordered after the last apply that read it (one stream)
        if self._dev is None or self._dev.device != device or self._dev.shape[0] < rows:
            size = max(rows, 2 * (0 if self._dev is None else self._dev.shape[0]))
            self._dev = torch.empty((size, self.num_words), dtype=torch.int32, device=device)
        return self._dev[:rows]

    # --- the two phases -------------------------------------------------------------------------

    def prepare(self, grammars: Sequence[ReqGrammar | None], device: torch.device | str) -> None:
        """Fills the mask of a sampling batch whose row i is masked by `grammars[i]` (None:
        unconstrained) for logits on `device`, and on CUDA starts its copy. Call it once the
        grammars' states are final for this sampling (the next `apply` checks it). Mutates the
        buffers."""
        start = time.perf_counter()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # as logits' devices read ("cuda:0")
            device = torch.device("cuda", torch.cuda.current_device())
        self._prepare(grammars, device)
        self.prepare_time_s += time.perf_counter() - start

    def _prepare(self, grammars: Sequence[ReqGrammar | None], device: torch.device) -> None:
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            self._prepared = None
            return
        guides = [g.guide for g in grammars if g is not None]
        keys = [None if g is None else g.mask_key() for g in grammars]
        cuda = device.type == "cuda"
        if cuda or self.kernel_on_cpu:
            host = self._pinned_buffer(len(grammars)) if cuda else self._buffer(len(grammars))
            if len(rows) < len(grammars):  # all-ones rows: unconstrained requests keep every logit
                host[[i for i, g in enumerate(grammars) if g is None]] = -1
            self._fill(host, rows, guides)
            if cuda:
                assert self._pinned is not None
                mask = self._device_buffer(len(grammars), device)
                mask.copy_(self._pinned[: len(grammars)], non_blocking=True)
                if self._copied is None:
                    self._copied = torch.cuda.Event()
                self._copied.record()
                self._copy_pending = True
            else:
                mask = torch.from_numpy(host)
            self._prepared = _Prepared(device, rows, keys, mask, kernel=True)
        else:
            host = self._buffer(len(rows))
            self._fill(host, range(len(rows)), guides)
            self._prepared = _Prepared(device, rows, keys, torch.from_numpy(host), kernel=False)

    def apply(self, logits: torch.Tensor, grammars: Sequence[ReqGrammar | None]) -> torch.Tensor:
        """Masks row i of `logits` (B, V) by `grammars[i]` (None: unconstrained), from the
        prepared mask when it is still valid for these grammars, else filling now. Mutates
        `logits` in place and returns it. Rows whose grammar allows nothing keep nothing."""
        prepared, self._prepared = self._prepared, None
        if all(g is None for g in grammars):
            return logits
        start = time.perf_counter()
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns, the grammar vocabulary {self.vocab_size}")
        if prepared is not None and self._still_valid(prepared, logits.device, grammars):
            self.num_prepared_used += 1
        else:
            self._prepare(grammars, logits.device)
            prepared, self._prepared = self._prepared, None
            assert prepared is not None
        if prepared.kernel:
            from lmserver.kernels.bitmask import apply_token_bitmask_inplace

            apply_token_bitmask_inplace(logits, prepared.mask)
        else:
            from cfsm.torch import apply_token_bitmask_

            rows = prepared.rows
            if len(rows) == len(grammars):
                apply_token_bitmask_(logits, prepared.mask)
            else:
                # cfsm's `indices` form takes a full-batch mask; gather the constrained rows instead
                idx = torch.tensor(rows, dtype=torch.long)
                part = logits.index_select(0, idx)
                apply_token_bitmask_(part, prepared.mask)
                logits.index_copy_(0, idx, part)
        elapsed = time.perf_counter() - start
        self.apply_time_s += elapsed
        self.num_masked_rows += len(prepared.rows)
        return logits

    def _still_valid(self, prepared: _Prepared, device: torch.device, grammars: Sequence[ReqGrammar | None]) -> bool:
        """True when `prepared` masks this batch: same device and constrained rows, and every
        grammar in the state its row was filled from. Counts the stale rows otherwise."""
        if prepared.device != device or len(prepared.keys) != len(grammars):
            return False
        stale = 0
        for key, g in zip(prepared.keys, grammars, strict=True):
            if (key is None) != (g is None):
                return False
            if g is not None and key is not None and not _same_key(key, g.mask_key()):
                stale += 1
        self.num_stale_rows += stale
        return stale == 0

    @property
    def pending(self) -> bool:
        """True while a prepared mask waits for its `apply`."""
        return self._prepared is not None

    def _fill(self, out: np.ndarray, rows: Sequence[int], guides: Sequence[cfsm.Guide]) -> None:
        start = time.perf_counter()
        cfsm.fill_next_token_bitmasks(guides, out, list(rows))
        self.fill_time_s += time.perf_counter() - start
