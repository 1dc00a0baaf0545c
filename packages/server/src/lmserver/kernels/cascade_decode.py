"""Cascade (shared-prefix) decode attention: a prefix that several rows share is read once.

The rows of a decode batch are partitioned into groups whose `req_to_token` rows are equal on
[0, P_g) (the radix cache hands the same KV slots to every request of a group). Three kernels:

1. `_cascade_shared`: one program per (work item, KV head); a work item is one chunk of at most
   `chunk_rows` members of a group and one split of [0, P_g). All query heads of the KV head's
   GQA group of all the chunk's rows are packed into the M rows of one `tl.dot`
   (chunk_rows x group, e.g. 16 x 4 = 64 for Llama-3-8B), so each K/V tile is loaded once for
   the whole chunk. It writes a partial (out, lse) per (row, head, shared split).
2. the flash-decoding stage 1 of `decode_attention` over each row's own suffix [P_g, seq_len)
   (`kv_start`), writing partials after the shared ones.
3. `_cascade_merge`: the log-sum-exp merge of a row's shared and suffix partials.

A row in no group has P = 0 and no shared partial: its result is plain decode attention.
Every launch shape depends only on (batch size, `CascadeMetadata`'s fixed sizes, the suffix
split count), and the metadata is one int32 tensor updated in place, so the call can be
captured in a CUDA graph. Reference: `reference.decode_attention_ref` (the same result).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch
import triton
import triton.language as tl

from lmserver.kernels._util import (
    KernelInputError,
    check_attention_inputs,
    check_last_dim_contiguous,
    dot_precision,
    next_pow2,
)
from lmserver.kernels.decode_attention import launch_decode_stage1
from lmserver.kernels.online_softmax import merge_partials, online_softmax_step, split_partial

__all__ = ["CascadeMetadata", "build_cascade_plan", "cascade_decode_attention"]

_LOG2E = 1.4426950408889634
WORK_COLS = 5  # a work item: member_start, member_count, kv_start, kv_end, shared split index
SPLIT_ALIGN = 64  # shared split boundaries are multiples of this many tokens


@triton.jit
def _cascade_shared(
    q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_pool_indices_ptr, work_ptr, member_rows_ptr,
    partial_out_ptr, partial_lse_ptr,
    sm_scale_log2e,
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_rt,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    w = tl.program_id(0)
    kv_head = tl.program_id(1)
    member_start = tl.load(work_ptr + w * 5).to(tl.int32)
    count = tl.load(work_ptr + w * 5 + 1).to(tl.int32)  # 0: an unused work item (no loads, no stores)
    start = tl.load(work_ptr + w * 5 + 2).to(tl.int32)
    end = tl.load(work_ptr + w * 5 + 3).to(tl.int32)
    split = tl.load(work_ptr + w * 5 + 4).to(tl.int32)

    offs_m = tl.arange(0, BLOCK_M)
    member = offs_m // GROUP  # M row m is query head (kv_head * GROUP + m % GROUP) of member m // GROUP
    mask_m = member < count
    rows = tl.load(member_rows_ptr + member_start + member, mask=mask_m, other=0).to(tl.int64)
    heads = kv_head * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :], other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    # NOTE: every member's table row holds the same slots on [0, end): read the first member's
    leader = tl.load(member_rows_ptr + member_start).to(tl.int64)
    req = tl.load(req_pool_indices_ptr + leader).to(tl.int64)
    token_row = req_to_token_ptr + req * stride_rt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(token_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :], other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        qk = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * sm_scale_log2e
        qk = tl.where(mask_n[None, :], qk, float("-inf"))  # (BLOCK_M, BLOCK_N), log2 units
        m_new, l_i, p, alpha = online_softmax_step(m_i, l_i, qk)
        v = tl.load(
            v_cache_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :], other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out, lse = split_partial(acc, m_i, l_i, end > start)  # lse in log2 units
    tl.store(
        partial_out_ptr + rows[:, None] * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
        out, mask=mask_m[:, None] & mask_d[None, :],
    )
    tl.store(partial_lse_ptr + rows * stride_lb + heads * stride_lh + split, lse, mask=mask_m)


@triton.jit
def _cascade_merge(
    partial_out_ptr, partial_lse_ptr, row_num_shared_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    num_suffix_splits,
    NUM_SHARED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    n_shared = tl.load(row_num_shared_ptr + b).to(tl.int32)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    # partials [0, n_shared) of the shared prefix, [NUM_SHARED, NUM_SHARED + suffix splits) of the suffix
    mask_s = (offs_s < n_shared) | ((offs_s >= NUM_SHARED) & (offs_s < NUM_SHARED + num_suffix_splits))
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(partial_lse_ptr + b * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    part = tl.load(
        partial_out_ptr + b * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :], other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    out = merge_partials(part, lse)  # empty splits: lse -inf, weight 0
    tl.store(out_ptr + b * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


class CascadeMetadata:
    """Device metadata of a cascade decode at one batch size: fixed shapes, updated in place.

    One int32 tensor holds `work` (max_work, 5): member_start, member_count, kv_start, kv_end,
    shared split index (count 0: unused); `member_rows` (bs,) batch rows listed chunk by chunk;
    `row_prefix` (bs,) tokens of each row read by the shared kernel (its suffix starts there);
    `row_num_shared` (bs,) shared partials of each row. All zero: no sharing (plain decode).
    """

    def __init__(self, batch_size: int, max_work: int, num_shared_splits: int, chunk_rows: int,
                 device: torch.device | str, target_work: int | None = None) -> None:
        if batch_size < 1 or max_work < 1 or num_shared_splits < 1 or chunk_rows < 2:
            raise ValueError("batch_size, max_work, num_shared_splits must be >= 1 and chunk_rows >= 2")
        self.batch_size = batch_size
        self.max_work = max_work
        self.num_shared_splits = num_shared_splits
        self.chunk_rows = chunk_rows
        self.target_work = max_work if target_work is None else min(max_work, target_work)
        n_work = max_work * WORK_COLS
        self.buffer = torch.zeros(n_work + 3 * batch_size, dtype=torch.int32, device=device)
        self.work = self.buffer[:n_work].view(max_work, WORK_COLS)
        self.member_rows = self.buffer[n_work : n_work + batch_size]
        self.row_prefix = self.buffer[n_work + batch_size : n_work + 2 * batch_size]
        self.row_num_shared = self.buffer[n_work + 2 * batch_size :]
        self._written: object = None  # the groups object whose plan the buffer holds

    def write(self, groups: Sequence[tuple[Sequence[int], int]]) -> None:
        """Fills the buffer with the plan of `groups` (see `build_cascade_plan`); a host-to-device
        copy, skipped when `groups` is the very object written last. Mutates the buffer."""
        if groups is self._written:
            return
        plan = build_cascade_plan(groups, self.batch_size, self.max_work, self.num_shared_splits, self.chunk_rows,
                                  self.target_work)
        host = torch.from_numpy(plan)
        if self.buffer.is_cuda:
            host = host.pin_memory()
        self.buffer.copy_(host, non_blocking=True)
        self._written = groups


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def build_cascade_plan(
    groups: Sequence[tuple[Sequence[int], int]],
    batch_size: int,
    max_work: int,
    num_shared_splits: int,
    chunk_rows: int,
    target_work: int | None = None,
) -> npt.NDArray[np.int32]:
    """The int32 contents of a `CascadeMetadata` buffer for `groups` ((batch rows, prefix length)
    pairs: disjoint rows < batch_size, every row's first `prefix length` table slots equal). Pure.

    A group of n rows becomes ceil(n / chunk_rows) chunks of near-equal size; each chunk's prefix
    is cut into splits (multiples of SPLIT_ALIGN tokens, at most `num_shared_splits`) so that the
    work items come near `target_work` (default `max_work`), never past `max_work`. Groups of one
    row or prefix 0 are left out (plain decode).
    Raises ValueError when rows repeat or fall outside the batch.
    """
    chunks: list[tuple[list[int], int]] = []
    seen: set[int] = set()
    for rows, prefix in groups:
        rows = [int(r) for r in rows]
        if any(not 0 <= r < batch_size or r in seen for r in rows):
            raise ValueError(f"group rows {rows} repeat a row or fall outside the batch of {batch_size}")
        seen.update(rows)
        if len(rows) < 2 or prefix <= 0:
            continue
        n_chunks = _ceil_div(len(rows), chunk_rows)
        for c in range(n_chunks):
            chunks.append((rows[c * len(rows) // n_chunks : (c + 1) * len(rows) // n_chunks], int(prefix)))
    if len(chunks) > max_work:
        raise ValueError(f"{len(chunks)} chunks do not fit in {max_work} work items")
    n_work = max_work * WORK_COLS
    plan = np.zeros(n_work + 3 * batch_size, dtype=np.int32)
    work = plan[:n_work].reshape(max_work, WORK_COLS)
    member_rows = plan[n_work : n_work + batch_size]
    row_prefix = plan[n_work + batch_size : n_work + 2 * batch_size]
    row_num_shared = plan[n_work + 2 * batch_size :]
    target = max_work if target_work is None else min(target_work, max_work)
    per_chunk = max(1, min(num_shared_splits, target // max(len(chunks), 1)))
    w = 0
    member = 0
    for rows, prefix in chunks:
        splits = max(1, min(per_chunk, prefix // SPLIT_ALIGN))
        split_len = _ceil_div(_ceil_div(prefix, splits), SPLIT_ALIGN) * SPLIT_ALIGN
        splits = _ceil_div(prefix, split_len)
        for s in range(splits):
            work[w] = (member, len(rows), s * split_len, min(prefix, (s + 1) * split_len), s)
            w += 1
        member_rows[member : member + len(rows)] = rows
        row_prefix[rows] = prefix
        row_num_shared[rows] = splits
        member += len(rows)
    assert w <= max_work, "per_chunk keeps the work items within max_work"
    return plan


def cascade_decode_attention(
    q: torch.Tensor,  # (bs, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    req_to_token: torch.Tensor,  # (max_running_requests, max_context_len) int32
    req_pool_indices: torch.Tensor,  # (bs,)
    seq_lens: torch.Tensor,  # (bs,) including the new token, each >= 1
    sm_scale: float,
    meta: CascadeMetadata,
    out: torch.Tensor | None = None,  # (bs, num_heads, head_dim)
    num_kv_splits: int = 1,  # splits of each row's suffix
    partial_out: torch.Tensor | None = None,  # (bs, num_heads, num_shared_splits + num_kv_splits, head_dim) f32
    partial_lse: torch.Tensor | None = None,  # (bs, num_heads, num_shared_splits + num_kv_splits) float32
    block_n: int = 64,
    suffix_block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Decode attention (same result as `decode_attention`) with each group's shared prefix read
    once per chunk of rows, as `meta` describes; returns `out`.

    Mutates `out` (allocated when None) and the scratch `partial_out`, `partial_lse` (allocated
    when None; pass them preallocated to capture the call in a CUDA graph). The new token's key
    and value must already be stored in the cache.
    """
    check_attention_inputs(q, k_cache, v_cache)
    if k_cache.dtype == torch.float8_e4m3fn:
        raise KernelInputError("cascade decode attention reads no FP8 cache yet; use decode_attention")
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if meta.batch_size != bs or meta.buffer.device != q.device:
        raise KernelInputError(f"meta is for batch size {meta.batch_size} on {meta.buffer.device}, "
                               f"q has {bs} rows on {q.device}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape:
        raise KernelInputError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    n_shared = meta.num_shared_splits
    n_total = n_shared + num_kv_splits
    if partial_out is None:
        partial_out = torch.empty(bs, num_heads, n_total, head_dim, dtype=torch.float32, device=q.device)
    if partial_lse is None:
        partial_lse = torch.empty(bs, num_heads, n_total, dtype=torch.float32, device=q.device)
    if (partial_out.shape != (bs, num_heads, n_total, head_dim) or partial_lse.shape != (bs, num_heads, n_total)
            or partial_out.dtype != torch.float32 or partial_lse.dtype != torch.float32):
        raise KernelInputError(
            f"partial_out must be float32 ({bs}, {num_heads}, {n_total}, {head_dim}) and partial_lse float32 "
            f"({bs}, {num_heads}, {n_total}); got {partial_out.dtype} {tuple(partial_out.shape)}, "
            f"{partial_lse.dtype} {tuple(partial_lse.shape)}"
        )
    check_last_dim_contiguous(out=out, partial_out=partial_out, partial_lse=partial_lse)
    if bs == 0:
        return out
    block_d = next_pow2(head_dim)
    block_m = max(16, next_pow2(meta.chunk_rows * group))
    _cascade_shared[(meta.max_work, num_kv_heads)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, meta.work, meta.member_rows,
        partial_out, partial_lse,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=dot_precision(k_cache.dtype),
        num_warps=num_warps if block_m <= 64 else 2 * num_warps, num_stages=num_stages,
    )
    launch_decode_stage1(
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sm_scale, out,
        partial_out[:, :, n_shared:], partial_lse[:, :, n_shared:], num_kv_splits,
        single_split=False, kv_start=meta.row_prefix,
        block_n=suffix_block_n, num_warps=4, num_stages=2,
    )
    _cascade_merge[(bs, num_heads)](
        partial_out, partial_lse, meta.row_num_shared, out,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        num_kv_splits,
        NUM_SHARED=n_shared, HEAD_DIM=head_dim, BLOCK_S=next_pow2(n_total), BLOCK_D=block_d,
        num_warps=4 if block_d >= 128 else 2,
    )
    return out
