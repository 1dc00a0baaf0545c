"""Triton FP8-weight GEMV for decode: y (M, N) = x (M, K) @ (weight * scale).T, M small.

The weight stays float8_e4m3fn in memory (half of bf16's bytes, the point at decode); each tile
is widened to the activation dtype (exact: every e4m3 value is a bf16 / fp16 value) and
accumulated in float32, one scale multiply per (row, K group) tile. A program owns BLOCK_N
output features and BLOCK_M rows of x: M = 1 reduces with a broadcast multiply-sum, M > 1 with
`tl.dot` (rows padded to 16). Scale layout: `lmserver.kernels.fp8_ref` (per channel, or one
value per row and 128-column group). Reference: `fp8_ref.fp8_linear_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError, check_last_dim_contiguous, dot_precision
from lmserver.kernels.fp8_ref import FP8_DTYPE

__all__ = ["Fp8GemvConfig", "fp8_gemv"]


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K, group_k,
    stride_xm, stride_wn, stride_sn, stride_om,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_w = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    rows_x = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(rows_w + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # (BN, BK) fp8
        x = tl.load(rows_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BM, BK)
        # NOTE: the wrapper makes BLOCK_K divide group_k (or group_k >= K): one scale per tile row
        s = tl.load(s_ptr + offs_n * stride_sn + k0 // group_k, mask=mask_n, other=0.0)  # (BN,) fp32
        if USE_DOT:
            part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)  # (BM, BN) fp32
        else:
            part = tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]  # BM == 1: (1, BN)
        acc += part * s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


class Fp8GemvConfig:
    """Launch parameters (tile sizes and warps); the defaults are a first guess to be swept on
    the GPU (benchmarks/fp8/check_fp8_gpu.py times them)."""

    def __init__(self, block_n: int = 32, block_k: int = 128, num_warps: int = 4, num_stages: int = 3) -> None:
        self.block_n, self.block_k, self.num_warps, self.num_stages = block_n, block_k, num_warps, num_stages


def fp8_gemv(
    x: torch.Tensor,  # (M, K) float32 / bfloat16 / float16
    weight: torch.Tensor,  # (N, K) float8_e4m3fn
    weight_scale: torch.Tensor,  # (N, ceil(K / group_k)) float32
    group_k: int,
    bias: torch.Tensor | None = None,  # (N,)
    out: torch.Tensor | None = None,  # (M, N) in x's dtype
    config: Fp8GemvConfig | None = None,
) -> torch.Tensor:
    """x @ dequantized(weight).T (+ bias) with float32 accumulation; returns `out` (allocated
    when None; mutated). Made for small M (decode); any M is correct."""
    cfg = config or Fp8GemvConfig()
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise KernelInputError(f"expected x (M, K) and weight (N, K); got {tuple(x.shape)}, {tuple(weight.shape)}")
    if weight.dtype != FP8_DTYPE:
        raise KernelInputError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    groups = -(-k // group_k)
    if weight_scale.shape != (n, groups) or weight_scale.dtype != torch.float32:
        raise KernelInputError(f"weight_scale must be float32 ({n}, {groups}); got {weight_scale.dtype} "
                               f"{tuple(weight_scale.shape)}")
    block_k = cfg.block_k
    if group_k < k:
        while group_k % block_k:  # a tile never straddles two K groups
            block_k //= 2
        if block_k < 16:
            raise KernelInputError(f"group_k ({group_k}) must be a multiple of 16")
    check_last_dim_contiguous(x=x, weight=weight)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    use_dot = m > 1
    block_m = 16 if use_dot else 1
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))
    _fp8_gemv_kernel[grid](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out,
        m, n, k, min(group_k, k) if groups > 1 else k,
        x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, USE_DOT=use_dot,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
