"""Triton paged decode attention (flash-decoding): one new query token per request.

Stage 1 splits each request's KV length into `num_kv_splits` pieces; a program handles one
(request, KV head, split) and all query heads of that KV head's GQA group together (packed
into the rows of one `tl.dot`, padded to 16 rows, so any group size works, SmolLM2's 3 too). It
writes a partial output and its log-sum-exp. Stage 2 merges the splits. The split length is
computed on the device from `seq_lens`, so the launch shape depends only on (batch size,
`num_kv_splits`) and the call can be captured in a CUDA graph.
FP8 caches (float8_e4m3fn, `k_scale` / `v_scale` per tensor): each K / V tile is widened to the
query dtype (exact), K's scale is folded into the softmax scale and V's applied to the output.
Reference: `reference.decode_attention_ref` (of the dequantized cache).
"""

from __future__ import annotations

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
from lmserver.kernels.online_softmax import merge_partials, online_softmax_step, split_partial

__all__ = ["choose_num_kv_splits", "decode_attention", "launch_decode_stage1"]

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_stage1(
    q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_pool_indices_ptr, seq_lens_ptr, kv_start_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    sm_scale_log2e, v_scale,
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_rt,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SINGLE_SPLIT: tl.constexpr, HAS_KV_START: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    req = tl.load(req_pool_indices_ptr + b).to(tl.int64)
    kv_lo = 0
    if HAS_KV_START:  # cascade decode: tokens [0, kv_start) are attended by the shared-prefix kernel
        kv_lo = tl.load(kv_start_ptr + b).to(tl.int32)
    split_len = tl.cdiv(seq_len - kv_lo, num_splits)
    # NOTE: round split lengths to BLOCK_N so each tile load is aligned (relative to kv_lo).
    split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N
    start = kv_lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :], other=0.0,
    )  # (BLOCK_H, BLOCK_D)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    token_row = req_to_token_ptr + req * stride_rt
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(token_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :], other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        if KV_FP8:  # k_scale is folded into sm_scale_log2e
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * sm_scale_log2e
        else:
            qk = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * sm_scale_log2e
        qk = tl.where(mask_n[None, :], qk, float("-inf"))  # (BLOCK_H, BLOCK_N), log2 units
        m_new, l_i, p, alpha = online_softmax_step(m_i, l_i, qk)
        v = tl.load(
            v_cache_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :], other=0.0,
        )
        if KV_FP8:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if KV_FP8:
        acc = acc * v_scale
    store_mask = mask_h[:, None] & mask_d[None, :]
    if SINGLE_SPLIT:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=store_mask,
        )
    else:
        out, lse = split_partial(acc, m_i, l_i, end > start)  # lse in log2 units
        tl.store(
            partial_out_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
            out, mask=store_mask,
        )
        tl.store(partial_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    partial_out_ptr, partial_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(partial_lse_ptr + b * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    part = tl.load(
        partial_out_ptr + b * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :], other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    out = merge_partials(part, lse)  # empty splits: lse -inf, weight 0
    tl.store(out_ptr + b * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def choose_num_kv_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 32) -> int:
    """A power-of-two split count giving about one program per multiprocessor (1 for large batches).

    Depends only on the batch shape, never on sequence lengths, so one value serves every
    replay of a CUDA graph captured for that batch size. Pure function; mutates nothing.
    """
    # NOTE: set from the H200 sweep (benchmarks/kernels/sweep_attention.py, Llama-3-8B shape):
    # half of "two programs per SM, rounded up to a power of two", with BLOCK_N 128, was the
    # fastest or within 3% at bs 1/8/32 x context 512/4096.
    programs = batch_size * num_kv_heads
    splits = min(max_splits, next_pow2(max(1, -(-2 * num_sms // max(programs, 1)))))
    return max(1, splits // 2)


def launch_decode_stage1(
    q: torch.Tensor,  # (bs, num_heads, head_dim)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,  # (bs, num_heads, head_dim), written when single_split
    p_out: torch.Tensor,  # (bs, num_heads, num_kv_splits, head_dim) float32 (any strides but the last)
    p_lse: torch.Tensor,  # (bs, num_heads, num_kv_splits) float32
    num_kv_splits: int,
    single_split: bool,
    kv_start: torch.Tensor | None,  # (bs,) int32 first token of each row to attend (None: 0)
    block_n: int,
    num_warps: int,
    num_stages: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Stage 1 of flash-decoding over tokens [kv_start, seq_len) of each row (inputs checked by
    the caller): the final output when `single_split`, else partial (out, lse) per split in log2
    units (an empty split gets lse -inf). An FP8 cache is read as values x `k_scale` / `v_scale`.
    Mutates `out` or `p_out`, `p_lse`."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if bs == 0:
        return
    p_out_strides = (0, 0, 0) if single_split else (p_out.stride(0), p_out.stride(1), p_out.stride(2))
    p_lse_strides = (0, 0) if single_split else (p_lse.stride(0), p_lse.stride(1))
    _decode_stage1[(bs, num_kv_heads, num_kv_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        kv_start if kv_start is not None else seq_lens,
        out, p_out, p_lse,
        sm_scale * _LOG2E * (k_scale if kv_fp8 else 1.0), v_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        out.stride(0), out.stride(1),
        *p_out_strides,
        *p_lse_strides,
        num_kv_splits,
        GROUP=group, HEAD_DIM=head_dim, SINGLE_SPLIT=single_split, HAS_KV_START=kv_start is not None,
        BLOCK_H=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim),
        PRECISION=dot_precision(q.dtype if kv_fp8 else k_cache.dtype), KV_FP8=kv_fp8,
        num_warps=num_warps, num_stages=num_stages,
    )


def decode_attention(
    q: torch.Tensor,  # (bs, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    req_to_token: torch.Tensor,  # (max_running_requests, max_context_len) int32
    req_pool_indices: torch.Tensor,  # (bs,)
    seq_lens: torch.Tensor,  # (bs,) including the new token, each >= 1
    sm_scale: float,
    out: torch.Tensor | None = None,  # (bs, num_heads, head_dim)
    num_kv_splits: int = 8,
    partial_out: torch.Tensor | None = None,  # (bs, num_heads, num_kv_splits, head_dim) float32
    partial_lse: torch.Tensor | None = None,  # (bs, num_heads, num_kv_splits) float32
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of each request's new query over its cached tokens; returns `out`.

    An FP8 (float8_e4m3fn) cache holds K / k_scale and V / v_scale (`KVPool`).

    Mutates `out` (allocated when None) and the scratch buffers `partial_out`, `partial_lse`
    (allocated when None and `num_kv_splits > 1`; pass them preallocated to capture the call in
    a CUDA graph). The new token's key and value must already be stored in the cache.
    """
    check_attention_inputs(q, k_cache, v_cache)
    bs, num_heads, head_dim = q.shape
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape:
        raise KernelInputError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    check_last_dim_contiguous(out=out)
    if num_kv_splits > 1:
        if partial_out is None:
            partial_out = torch.empty(bs, num_heads, num_kv_splits, head_dim, dtype=torch.float32, device=q.device)
        if partial_lse is None:
            partial_lse = torch.empty(bs, num_heads, num_kv_splits, dtype=torch.float32, device=q.device)
        if (partial_out.shape != (bs, num_heads, num_kv_splits, head_dim) or partial_lse.shape != (bs, num_heads, num_kv_splits)
                or partial_out.dtype != torch.float32 or partial_lse.dtype != torch.float32):
            raise KernelInputError(
                f"partial_out must be float32 ({bs}, {num_heads}, {num_kv_splits}, {head_dim}) and partial_lse float32 "
                f"({bs}, {num_heads}, {num_kv_splits}); got {partial_out.dtype} {tuple(partial_out.shape)}, "
                f"{partial_lse.dtype} {tuple(partial_lse.shape)}"
            )
        check_last_dim_contiguous(partial_out=partial_out, partial_lse=partial_lse)
        p_out, p_lse = partial_out, partial_lse
    else:
        p_out, p_lse = out, out  # unused by the kernel when SINGLE_SPLIT
    if bs == 0:
        return out
    launch_decode_stage1(
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sm_scale, out, p_out, p_lse,
        num_kv_splits, single_split=num_kv_splits == 1, kv_start=None,
        block_n=block_n, num_warps=num_warps, num_stages=num_stages, k_scale=k_scale, v_scale=v_scale,
    )
    block_d = next_pow2(head_dim)
    p_out_strides = (p_out.stride(0), p_out.stride(1), p_out.stride(2)) if num_kv_splits > 1 else (0, 0, 0)
    p_lse_strides = (p_lse.stride(0), p_lse.stride(1)) if num_kv_splits > 1 else (0, 0)
    if num_kv_splits > 1:
        _decode_stage2[(bs, num_heads)](
            p_out, p_lse, out,
            *p_out_strides,
            *p_lse_strides,
            out.stride(0), out.stride(1),
            num_kv_splits,
            HEAD_DIM=head_dim, BLOCK_S=next_pow2(num_kv_splits), BLOCK_D=block_d,
            num_warps=4 if block_d >= 128 else 2,
        )
    return out
