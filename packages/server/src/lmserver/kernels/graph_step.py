"""Two small kernels that move a decode step's bookkeeping into its CUDA graph.

`write_decode_inputs` runs first in a captured decode graph: from the one int64 buffer the host
copies per step (input ids, positions, KV slots, request-table rows, lengths) it fills the int32
lengths the attention reads, writes each real row's new KV slot into the request-to-token table,
skipping padding rows (their slot is the padding slot), and takes the input ids the host marked
as "the previous step's argmax" from the graph's argmax buffer. Outside the graph those were a
copy, a cast, an index write and a device-to-device copy per step, each a launch with its own
latency and host time.

`argmax_rows` runs last: the greedy token of every row, in two launches (the max and its first
index per 1,024-entry chunk, one program per (row, chunk); then per row the first chunk holding
the row's maximum). `torch.argmax` reduces a row in a single thread block (13 us for a
49,152-entry row on an H200, 26 us for 128,256). Ties go to the first index, as in
`torch.argmax`; NaN counts as +inf (torch returns the first NaN, so the two differ only when a
+inf comes before it).

Each has a torch reference (`*_ref`) for the CPU; the references use data-dependent indexing
and so cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError, next_pow2

__all__ = ["ARGMAX_CHUNK", "argmax_rows", "argmax_rows_ref", "write_decode_inputs", "write_decode_inputs_ref"]

ARGMAX_CHUNK = 1024
# Rows of the per-step int64 input buffer.
IDS, POSITIONS, OUT_SLOTS, TABLE_ROWS, SEQ_LENS = range(5)


@triton.jit
def _decode_inputs_kernel(ints_ptr, stride_ints, seq_lens_ptr, table_ptr, stride_table, prev_ids_ptr, n, pad_slot,
                          BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    live = offs < n
    ids = tl.load(ints_ptr + offs, mask=live, other=0)
    chained = live & (ids < 0)
    prev = tl.load(prev_ids_ptr + (-ids - 1), mask=chained, other=0)
    tl.store(ints_ptr + offs, prev, mask=chained)
    pos = tl.load(ints_ptr + 1 * stride_ints + offs, mask=live, other=0)
    slot = tl.load(ints_ptr + 2 * stride_ints + offs, mask=live, other=0)
    row = tl.load(ints_ptr + 3 * stride_ints + offs, mask=live, other=0)
    lens = tl.load(ints_ptr + 4 * stride_ints + offs, mask=live, other=1)
    tl.store(seq_lens_ptr + offs, lens.to(tl.int32), mask=live)
    tl.store(table_ptr + row * stride_table + pos, slot.to(tl.int32), mask=live & (slot != pad_slot))


def _check_decode_inputs(ints: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor) -> int:
    n = seq_lens.shape[0]
    if ints.dim() != 2 or ints.shape[0] != 5 or ints.shape[1] < n or ints.dtype != torch.int64:
        raise KernelInputError(f"ints must be (5, >= {n}) int64, got {tuple(ints.shape)} {ints.dtype}")
    if seq_lens.dtype != torch.int32 or req_to_token.dtype != torch.int32 or req_to_token.dim() != 2:
        raise KernelInputError(f"seq_lens and req_to_token must be int32 (req_to_token 2-D), got "
                               f"{seq_lens.dtype} and {req_to_token.dtype} {tuple(req_to_token.shape)}")
    if ints.stride(1) != 1 or req_to_token.stride(1) != 1 or not seq_lens.is_contiguous():
        raise KernelInputError("ints, seq_lens and req_to_token must be contiguous in their last dimension")
    return n


def write_decode_inputs(ints: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor, pad_slot: int,
                        prev_ids: torch.Tensor) -> None:
    """For each of the `len(seq_lens)` rows: an input id `-(j + 1)` becomes `prev_ids[j]` (a token
    the device sampled and the host has not read), `seq_lens[i] = ints[SEQ_LENS, i]` and, unless
    `ints[OUT_SLOTS, i] == pad_slot` (a padding row), `req_to_token[ints[TABLE_ROWS, i],
    ints[POSITIONS, i]] = ints[OUT_SLOTS, i]`. One launch, no host sync (capturable)."""
    n = _check_decode_inputs(ints, seq_lens, req_to_token)
    if n == 0:
        return
    _decode_inputs_kernel[(1,)](ints, ints.stride(0), seq_lens, req_to_token, req_to_token.stride(0), prev_ids, n,
                                pad_slot, BLOCK=max(16, next_pow2(n)), num_warps=1)


def write_decode_inputs_ref(ints: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor, pad_slot: int,
                            prev_ids: torch.Tensor) -> None:
    """`write_decode_inputs` in torch (boolean indexing: not capturable on CUDA)."""
    n = _check_decode_inputs(ints, seq_lens, req_to_token)
    ids = ints[IDS, :n]
    chained = ids < 0
    ids[chained] = prev_ids[-ids[chained] - 1]
    seq_lens.copy_(ints[SEQ_LENS, :n])
    real = ints[OUT_SLOTS, :n] != pad_slot
    slots = ints[OUT_SLOTS, :n][real]
    req_to_token[ints[TABLE_ROWS, :n][real], ints[POSITIONS, :n][real]] = slots.to(req_to_token.dtype)


@triton.jit
def _argmax_chunks_kernel(x_ptr, stride_x, vals_ptr, idx_ptr, vocab, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN as +inf
    best = tl.max(x, 0)
    # NOTE: offs < vocab on a chunk's first entry, so an all -inf chunk picks a real index
    first = tl.min(tl.where(x == best, offs, vocab), 0)
    tl.store(vals_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _argmax_merge_kernel(vals_ptr, idx_ptr, out_ptr, vocab, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    live = offs < num_chunks
    vals = tl.load(vals_ptr + row * num_chunks + offs, mask=live, other=float("-inf"))
    idx = tl.load(idx_ptr + row * num_chunks + offs, mask=live, other=0)
    best = tl.max(vals, 0)
    # chunks are in order: the smallest index among the chunks reaching the max is the first one
    tl.store(out_ptr + row, tl.min(tl.where(live & (vals == best), idx, vocab), 0).to(tl.int64))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Index of each row's maximum of (rows, vocab) `logits` (first index on ties) as (rows,)
    int64, written into `out` when given. Two launches, no host sync (capturable)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise KernelInputError(f"logits must be (rows, vocab > 0), contiguous in vocab; got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise KernelInputError(f"out must be ({rows},) int64 and contiguous, got {tuple(out.shape)} {out.dtype}")
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, ARGMAX_CHUNK)
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _argmax_chunks_kernel[(rows, chunks)](logits, logits.stride(0), vals, idx, vocab, chunks, BLOCK=ARGMAX_CHUNK,
                                          num_warps=4)
    _argmax_merge_kernel[(rows,)](vals, idx, out, vocab, chunks, BLOCK_C=max(16, next_pow2(chunks)), num_warps=4)
    return out


def argmax_rows_ref(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`argmax_rows` through `torch.argmax`."""
    result = logits.argmax(dim=-1)
    return result if out is None else out.copy_(result)
