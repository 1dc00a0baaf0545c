"""Triton RMSNorm and fused residual-add + RMSNorm, one program per token row.

Rounding follows Hugging Face's Llama (normalize in float32, round to the activation dtype,
multiply by the weight, round again; the residual sum is rounded before it is normalized), so
the Triton path and the torch-native path give the same greedy tokens.
References: `reference.rmsnorm_ref`, `reference.fused_add_rmsnorm_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError, check_last_dim_contiguous, next_pow2, row_warps

__all__ = ["add_rmsnorm_row", "check_norm_inputs", "fused_add_rmsnorm", "rmsnorm"]


@triton.jit
def add_rmsnorm_row(x_row, residual_row, weight_ptr, offs, mask, hidden, eps, HAS_RESIDUAL: tl.constexpr):
    """rmsnorm(x [+ residual]) * weight of one whole row (columns `offs`, `mask`) in x's dtype, HF's
    rounding; with HAS_RESIDUAL the rounded sum is stored over the residual row first. Shared by the
    norm + FP8 quantizer (`lmserver.kernels.fp8_quant`) so both round alike."""
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_row + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (xf + r).to(dtype)
        tl.store(residual_row + offs, summed, mask=mask)
        xf = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return (normed * w).to(dtype)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    out = add_rmsnorm_row(x_ptr + row * stride_x, residual_ptr + row * stride_r, weight_ptr, offs, mask, hidden, eps,
                          HAS_RESIDUAL)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def check_norm_inputs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    """x (num_tokens, hidden), weight (hidden,), residual (None or x's shape and dtype), rows contiguous."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise KernelInputError(f"expected x (num_tokens, hidden) and weight (hidden,), got {tuple(x.shape)}, {tuple(weight.shape)}")
    check_last_dim_contiguous(x=x, weight=weight)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise KernelInputError(f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs {tuple(x.shape)} {x.dtype}")
        check_last_dim_contiguous(residual=residual)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    if x.shape[0] == 0:
        return
    block = next_pow2(x.shape[1])
    _rmsnorm_kernel[(x.shape[0],)](
        x, residual if residual is not None else x, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        x.shape[1], eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=row_warps(block),
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of x (num_tokens, hidden); returns `out`. Mutates `out` only
    (allocated when None; may be x itself)."""
    check_norm_inputs(x, weight)
    if out is None:
        out = torch.empty_like(x)
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: `residual <- x + residual`, then `x <- rmsnorm(residual) * weight`.

    Mutates both x and residual (num_tokens, hidden), as SGLang's and vLLM's fused kernels do.
    """
    check_norm_inputs(x, weight, residual)
    _launch(x, residual, weight, x, eps)
