"""Triton KV-cache store: scatter the new tokens' keys and values into their cache slots.

One program per (token, column block) copies that token's `num_kv_heads * head_dim` values of
both k and v. An FP8 cache stores them quantized (`fp8_ref.quantize_kv_fp8`) and, when asked, the
same launch writes the values as the cache now holds them back in k's dtype (`k_out`, `v_out`: what
an extend step attends to, so prefill and later decode steps see one K / V). Reference:
`reference.store_kv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError

__all__ = ["store_kv"]


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, k_out_ptr, v_out_ptr,
    stride_kt, stride_vt, stride_kcs, stride_vcs, stride_ot,
    width, k_scale, v_scale, k_inv, v_inv, BLOCK: tl.constexpr, FP8: tl.constexpr = False,
    DEQUANT: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    slot = tl.load(loc_ptr + t).to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    if FP8:  # fp8_ref.quantize_kv_fp8: x * (1 / scale) in float32 (k_inv, v_inv), saturated at +-448
        k = tl.clamp(k.to(tl.float32) * k_inv, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) * v_inv, -448.0, 448.0)
    kq = k.to(k_cache_ptr.dtype.element_ty)
    vq = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + slot * stride_kcs + offs, kq, mask=mask)
    tl.store(v_cache_ptr + slot * stride_vcs + offs, vq, mask=mask)
    if DEQUANT:  # KVPool.dequantize_k / _v: (stored * scale) in float32, then the output dtype
        ty = k_out_ptr.dtype.element_ty
        tl.store(k_out_ptr + t * stride_ot + offs, (kq.to(tl.float32) * k_scale).to(ty), mask=mask)
        tl.store(v_out_ptr + t * stride_ot + offs, (vq.to(tl.float32) * v_scale).to(ty), mask=mask)


def _rows_contiguous(t: torch.Tensor) -> bool:
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def store_kv(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    loc: torch.Tensor,  # (num_tokens,) slot ids, distinct
    block: int = 1024,
    k_scale: float = 1.0,  # FP8 caches: the values stored are k * (1 / k_scale), v * (1 / v_scale), saturated
    v_scale: float = 1.0,
    k_out: torch.Tensor | None = None,  # FP8 caches: (num_tokens, num_kv_heads, head_dim), contiguous, k's dtype
    v_out: torch.Tensor | None = None,
) -> None:
    """`k_cache[loc] = k; v_cache[loc] = v` (FP8 caches: quantized as `fp8_ref.quantize_kv_fp8`
    does, in the same launch; with `k_out` / `v_out` also the stored values scaled back, as
    `KVPool.dequantize_k` / `dequantize_v` give them). Mutates k_cache, v_cache, k_out, v_out."""
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[1:] or v_cache.shape != k_cache.shape:
        raise KernelInputError(
            f"expected k, v (T, num_kv_heads, head_dim) matching the caches' last dims; got k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}, k_cache {tuple(k_cache.shape)}"
        )
    if loc.shape != (k.shape[0],):
        raise KernelInputError(f"loc must be ({k.shape[0]},), got {tuple(loc.shape)}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not _rows_contiguous(t):
            raise KernelInputError(f"{name} must be contiguous within each token (stride {t.stride()})")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    dequant = k_out is not None or v_out is not None
    if dequant:
        if not fp8 or k_out is None or v_out is None:
            raise KernelInputError("k_out and v_out come together, with an FP8 cache only")
        if k_out.shape != k.shape or v_out.shape != k.shape or not (k_out.is_contiguous() and v_out.is_contiguous()):
            raise KernelInputError(f"k_out and v_out must be contiguous {tuple(k.shape)}; got "
                                   f"{tuple(k_out.shape)}, {tuple(v_out.shape)}")
        if k_out.dtype != k.dtype or v_out.dtype != k.dtype:
            raise KernelInputError(f"k_out and v_out must be in k's dtype ({k.dtype}); got {k_out.dtype}, {v_out.dtype}")
    if k.shape[0] == 0:
        return
    width = k.shape[1] * k.shape[2]
    _store_kv_kernel[(k.shape[0], triton.cdiv(width, block))](
        k, v, k_cache, v_cache, loc, k if k_out is None else k_out, v if v_out is None else v_out,
        k.stride(0), v.stride(0), k_cache.stride(0), v_cache.stride(0), width,
        width, float(k_scale), float(v_scale), 1.0 / float(k_scale), 1.0 / float(v_scale), BLOCK=block, FP8=fp8,
        DEQUANT=dequant, num_warps=4,
    )
