"""Triton extend attention for (chunked) prefill.

The new tokens of each request attend to the request's cached prefix (any length, e.g. a
radix-cache hit or the earlier chunks of a chunked prefill; read through `req_to_token`) and
causally to themselves (read from the contiguous `k_extend`, `v_extend`). A program handles
`BLOCK_M` new tokens of one request and one query head; its KV head is `head // group`.
An FP8 (float8_e4m3fn) cache holds K / k_scale and V / v_scale (`KVPool`): prefix tiles are widened
to the query dtype, `k_scale` multiplies their scores and `v_scale` their value sums; the new
tokens' `k_extend` / `v_extend` come in the query dtype.
Reference: `reference.extend_attention_ref` (of the dequantized cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError, check_attention_inputs, dot_precision, next_pow2
from lmserver.kernels.online_softmax import online_softmax_step

__all__ = ["extend_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr, k_ext_ptr, v_ext_ptr, k_cache_ptr, v_cache_ptr,
    req_to_token_ptr, req_pool_indices_ptr, prefix_lens_ptr, extend_lens_ptr, start_loc_ptr,
    out_ptr,
    sm_scale_log2e, k_scale, v_scale,
    stride_qt, stride_qh,
    stride_ket, stride_keh,
    stride_vet, stride_veh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_rt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr = False, HEAVY_FIRST: tl.constexpr = False,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    if HEAVY_FIRST:  # the grid's last query blocks (the most keys under a causal mask) launch first
        block_m = tl.num_programs(2) - 1 - block_m
    kv_head = head // GROUP

    extend_len = tl.load(extend_lens_ptr + b).to(tl.int32)
    if block_m * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)
    start = tl.load(start_loc_ptr + b).to(tl.int64)
    req = tl.load(req_pool_indices_ptr + b).to(tl.int64)

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < extend_len
    mask_d = offs_d < HEAD_DIM
    rows = start + offs_m
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :], other=0.0,
    )  # (BLOCK_M, BLOCK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Cached prefix: every new token sees all of it.
    token_row = req_to_token_ptr + req * stride_rt
    for n in range(0, prefix_len, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        slots = tl.load(token_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :], other=0.0,
        )
        if KV_FP8:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * (sm_scale_log2e * k_scale)
        else:
            qk = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * sm_scale_log2e
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new, l_i, p, alpha = online_softmax_step(m_i, l_i, qk)
        v = tl.load(
            v_cache_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :], other=0.0,
        )
        if KV_FP8:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION) * v_scale
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # New tokens before this query block: fully visible, no causal mask needed.
    # NOTE: BLOCK_M is a multiple of BLOCK_N, so this loop ends exactly at the block's first row.
    diag_start = block_m * BLOCK_M
    for n in range(0, diag_start, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        ext_rows = start + offs_n
        k = tl.load(
            k_ext_ptr + ext_rows[:, None] * stride_ket + kv_head * stride_keh + offs_d[None, :],
            mask=mask_d[None, :], other=0.0,
        )
        qk = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * sm_scale_log2e
        m_new, l_i, p, alpha = online_softmax_step(m_i, l_i, qk)
        v = tl.load(
            v_ext_ptr + ext_rows[:, None] * stride_vet + kv_head * stride_veh + offs_d[None, :],
            mask=mask_d[None, :], other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # The diagonal: causal mask, up to this block's last valid row.
    end_n = tl.minimum(diag_start + BLOCK_M, extend_len)
    for n in range(diag_start, end_n, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < extend_len
        ext_rows = start + offs_n
        k = tl.load(
            k_ext_ptr + ext_rows[:, None] * stride_ket + kv_head * stride_keh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :], other=0.0,
        )
        qk = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * sm_scale_log2e
        causal = (offs_m[:, None] >= offs_n[None, :]) & mask_n[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        m_new, l_i, p, alpha = online_softmax_step(m_i, l_i, qk)
        v = tl.load(
            v_ext_ptr + ext_rows[:, None] * stride_vet + kv_head * stride_veh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :], other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # NOTE: every valid row saw at least its own token, so l_i > 0 there; padded rows are masked.
    safe_l = tl.where(mask_m, l_i, 1.0)
    out = acc / safe_l[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,  # (num_new_tokens, num_heads, head_dim)
    k_extend: torch.Tensor,  # (num_new_tokens, num_kv_heads, head_dim)
    v_extend: torch.Tensor,  # (num_new_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    req_to_token: torch.Tensor,  # (max_running_requests, max_context_len) int32
    req_pool_indices: torch.Tensor,  # (bs,)
    extend_prefix_lens: torch.Tensor,  # (bs,)
    extend_seq_lens: torch.Tensor,  # (bs,)
    extend_start_loc: torch.Tensor,  # (bs,)
    sm_scale: float,
    max_extend_len: int,
    out: torch.Tensor | None = None,  # (num_new_tokens, num_heads, head_dim)
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    has_prefix: bool = True,
    heavy_first: bool = True,
) -> torch.Tensor:
    """Prefix + causal attention of the new tokens; returns `out`.

    `max_extend_len` (a host int, >= every `extend_seq_lens[b]`) sizes the grid, so no device
    value is read on the host; `has_prefix` False (a host fact: no request has a cached prefix)
    reads no prefix and no cache: the kernel runs as for a cache of the new tokens' dtype over
    zero-length prefixes (`k_extend` / `v_extend` stand in for the cache pointers, never
    dereferenced), so a fresh prompt runs the same compiled kernel whatever the cache dtype.
    `heavy_first` launches the last query blocks (the most keys) first: on the H200 a 4,096-token prompt 354.8 ->
    333.3 us, 1,024 tokens 37.8 -> 33.0 (`bench_prefill_attention.py`), the causal grid's tail being light blocks.
    Mutates `out` (allocated when None); the caches are only read.
    """
    check_attention_inputs(q, k_cache, v_cache)
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if kv_fp8 and (k_extend.dtype != q.dtype or v_extend.dtype != q.dtype):
        raise KernelInputError(f"with an FP8 cache, k_extend and v_extend come in q's dtype ({q.dtype})")
    if not has_prefix:
        # NOTE: not a kernel without its prefix loop: on the H200 (4k prefill, us per layer, benchmarks/RESULTS.md
        # FP8 (issue 33)) that compile took 424-448 where the kernel with the loop took 371-388 on bf16 caches,
        # in the same calls; an FP8 cache's loop (widening its tiles) compiled in made it 496
        k_cache, v_cache, k_scale, v_scale, kv_fp8 = k_extend, v_extend, 1.0, 1.0, False
        extend_prefix_lens = torch.zeros_like(extend_prefix_lens)
    if k_extend.shape[0] != q.shape[0] or k_extend.shape[1:] != k_cache.shape[1:] or v_extend.shape != k_extend.shape:
        raise KernelInputError(
            f"k_extend and v_extend must be (num_new_tokens={q.shape[0]}, num_kv_heads, head_dim) like the "
            f"cache; got {tuple(k_extend.shape)}, {tuple(v_extend.shape)}"
        )
    if k_extend.stride(-1) != 1 or v_extend.stride(-1) != 1:
        raise KernelInputError("k_extend and v_extend must be contiguous in their last dimension")
    num_tokens, num_heads, head_dim = q.shape
    bs = req_pool_indices.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or bs == 0 or max_extend_len <= 0:
        return out
    block_d = next_pow2(head_dim)
    # NOTE: defaults from the H200 sweep (benchmarks/kernels/sweep_attention.py, head_dim 128):
    # 64 x 64 tiles, 4 warps, 3 stages were best or within 4% on a 4096-token prefill and on
    # chunks over cached prefixes (300-390 TFLOP/s; the earlier 64 x 32, 8 warps, 2 stages: 160-175).
    if block_m is None:
        block_m = 64 if q.is_cuda else 16
    if block_n is None:
        block_n = 64 if q.is_cuda else 16
    if num_warps is None:
        num_warps = 4
    if block_m % block_n:
        raise KernelInputError(f"block_m ({block_m}) must be a multiple of block_n ({block_n})")
    grid = (bs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_extend, v_extend, k_cache, v_cache,
        req_to_token, req_pool_indices, extend_prefix_lens, extend_seq_lens, extend_start_loc,
        out,
        sm_scale * _LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1),
        k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=dot_precision(q.dtype if kv_fp8 else k_cache.dtype), KV_FP8=kv_fp8, HEAVY_FIRST=heavy_first,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
