"""Batch token masks: fill one int32 bitmask for the constrained rows of a sampling batch on
the CPU, then apply it to the logits on their device.

CPU logits: `cfsm.torch.apply_token_bitmask_` on the constrained rows only. CUDA logits: the
Triton kernel of `lmserver.kernels.bitmask` over the whole batch in one launch, with all-ones
rows for unconstrained requests (their logits are left as they are); the mask is filled in a
pinned host buffer and copied without blocking. `BatchMasker(kernel_on_cpu=True)` takes the kernel
path for CPU logits too (Triton's interpreter, TRITON_INTERPRET=1: the test of both paths).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

import cfsm
from lmserver.constrained.grammar import ReqGrammar

__all__ = ["BatchMasker"]


class BatchMasker:
    """Reusable host buffers for the batch bitmask.

    `mask_time_s` accumulates fill + apply time as seen by the host (on CUDA the apply is a
    launch: its device time is not included); `fill_time_s` the host fill alone.
    """

    def __init__(self, vocab_size: int, *, kernel_on_cpu: bool = False) -> None:
        self.vocab_size = vocab_size
        self.kernel_on_cpu = kernel_on_cpu  # the Triton kernel for CPU logits too (interpreter tests)
        self.num_words = (vocab_size + 31) // 32
        self._host = np.zeros((0, self.num_words), dtype=np.int32)
        self._pinned: torch.Tensor | None = None  # CUDA path: page-locked, so the copy is asynchronous
        self._copied: torch.cuda.Event | None = None
        self.mask_time_s = 0.0
        self.fill_time_s = 0.0
        self.num_masked_rows = 0

    def _buffer(self, rows: int) -> np.ndarray:
        if self._host.shape[0] < rows:
            self._host = np.zeros((max(rows, 2 * self._host.shape[0]), self.num_words), dtype=np.int32)
        return self._host[:rows]

    def _pinned_buffer(self, rows: int) -> torch.Tensor:
        # NOTE: the previous step's copy may still read this buffer: wait for it before refilling
        # (normally long done: sampling read the tokens back in between).
        if self._copied is not None:
            self._copied.synchronize()
        if self._pinned is None or self._pinned.shape[0] < rows:
            size = max(rows, 2 * (0 if self._pinned is None else self._pinned.shape[0]))
            self._pinned = torch.empty((size, self.num_words), dtype=torch.int32, pin_memory=True)
        return self._pinned[:rows]

    def apply(self, logits: torch.Tensor, grammars: Sequence[ReqGrammar | None]) -> torch.Tensor:
        """Masks row i of `logits` (B, V) by `grammars[i]` (None: unconstrained). Mutates
        `logits` in place and returns it. Rows whose grammar allows nothing keep nothing."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return logits
        start = time.perf_counter()
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns, the grammar vocabulary {self.vocab_size}")
        if logits.is_cuda or self.kernel_on_cpu:
            from lmserver.kernels.bitmask import apply_token_bitmask_inplace

            if logits.is_cuda:
                pinned = self._pinned_buffer(len(grammars))
                host = pinned.numpy()
            else:
                host = self._buffer(len(grammars))
            host.fill(-1)  # all-ones rows: unconstrained requests keep every logit
            self._fill(host, rows, [grammars[i] for i in rows])
            if logits.is_cuda:
                mask = pinned.to(logits.device, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record()
            else:
                mask = torch.from_numpy(host)
            apply_token_bitmask_inplace(logits, mask)
        else:
            from cfsm.torch import apply_token_bitmask_

            host = self._buffer(len(rows))
            self._fill(host, range(len(rows)), [grammars[i] for i in rows])
            sub = torch.from_numpy(host)
            if len(rows) == len(grammars):
                apply_token_bitmask_(logits, sub)
            else:
                # cfsm's `indices` form takes a full-batch mask; gather the constrained rows instead
                idx = torch.tensor(rows, dtype=torch.long)
                part = logits.index_select(0, idx)
                apply_token_bitmask_(part, sub)
                logits.index_copy_(0, idx, part)
        self.mask_time_s += time.perf_counter() - start
        self.num_masked_rows += len(rows)
        return logits

    def _fill(self, out: np.ndarray, rows: Sequence[int], grammars: Sequence[ReqGrammar | None]) -> None:
        start = time.perf_counter()
        guides = [g.guide for g in grammars if g is not None]
        cfsm.fill_next_token_bitmasks(guides, out, list(rows))
        self.fill_time_s += time.perf_counter() - start
