"""Triton in-place rotary embedding (neox style, rotate-half, as Hugging Face's Llama).

`cos_sin_cache` (max_position, rotary_dim) float32 holds cos in its first half and sin in its
second; the caller builds it (Llama-3's scaled frequencies, NTK or YaRN variants are computed
there, not here). Channels past `rotary_dim` are left alone. One program per token rotates all
its query and key heads. Reference: `reference.rope_ref`.

Rounding follows Hugging Face's `q * cos + rotate_half(q) * sin` with cos and sin cast to the
activation dtype: cos and sin are rounded to it, each product is rounded, then the sum. A product
of two half-precision values is exact in float32, so every rounding equals torch's; float
contraction into FMAs is switched off at launch so that float32 also rounds each product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError, check_last_dim_contiguous, next_pow2

__all__ = ["apply_rope_inplace"]


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_c[None, :] < half)
    ptr1 = x_ptr + offs_h[:, None] * stride_h + offs_c[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + half, mask=mask, other=0.0).to(tl.float32)
    dtype = x1.dtype
    x1f = x1.to(tl.float32)
    c = cos.to(dtype).to(tl.float32)[None, :]  # HF casts cos and sin to the activation dtype
    s = sin.to(dtype).to(tl.float32)[None, :]
    out1 = (x1f * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    out2 = (x2 * c).to(dtype).to(tl.float32) + (x1f * s).to(dtype).to(tl.float32)
    tl.store(ptr1, out1.to(dtype), mask=mask)
    tl.store(ptr1 + half, out2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_heads, num_kv_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_HALF)
    mask_c = offs_c < half
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_heads, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_kv_heads, cos, sin, half, BLOCK_HK, BLOCK_HALF)


def apply_rope_inplace(
    positions: torch.Tensor,  # (num_tokens,)
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, rotary_dim) float32
) -> None:
    """Rotate the first `rotary_dim` channels of every head of q and k. Mutates q and k."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or positions.shape != (q.shape[0],):
        raise KernelInputError(
            f"expected positions (T,), q (T, num_heads, head_dim), k (T, num_kv_heads, head_dim); got "
            f"{tuple(positions.shape)}, {tuple(q.shape)}, {tuple(k.shape)}"
        )
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > q.shape[2] or k.shape[2] != q.shape[2]:
        raise KernelInputError(f"rotary_dim {rotary_dim} must be even and <= head_dim {q.shape[2]}")
    check_last_dim_contiguous(q=q, k=k, cos_sin_cache=cos_sin_cache)
    if q.shape[0] == 0:
        return
    half = rotary_dim // 2
    _rope_kernel[(q.shape[0],)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        q.shape[1], k.shape[1], half,
        BLOCK_HQ=next_pow2(q.shape[1]), BLOCK_HK=next_pow2(k.shape[1]), BLOCK_HALF=next_pow2(half),
        num_warps=4, enable_fp_fusion=False,  # no FMA: each product rounded, as torch does
    )
