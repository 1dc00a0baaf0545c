"""Triton SiLU-and-mul: `out = silu(x[:, :d]) * x[:, d:]`, the gated MLP activation.

Rounding follows Hugging Face (`act_fn(gate) * up`: silu rounded to the activation dtype, then
the product). Reference: `reference.silu_and_mul_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError, check_last_dim_contiguous

__all__ = ["silu_and_mul", "silu_mul"]


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in gate's dtype, silu rounded to that dtype first (HF's rounding); shared by
    the fused SiLU-and-mul + FP8 quantizer (`lmserver.kernels.fp8_quant`) so both round alike."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, silu_mul(gate, up), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """x (num_tokens, 2 * d) -> out (num_tokens, d); returns `out`. Mutates `out` only
    (allocated when None)."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise KernelInputError(f"expected x (num_tokens, 2 * d), got {tuple(x.shape)}")
    d = x.shape[1] // 2
    if out is None:
        out = torch.empty(x.shape[0], d, dtype=x.dtype, device=x.device)
    elif out.shape != (x.shape[0], d):
        raise KernelInputError(f"out must be ({x.shape[0]}, {d}), got {tuple(out.shape)}")
    check_last_dim_contiguous(x=x, out=out)
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](
            x, out, x.stride(0), out.stride(0), d, BLOCK=block, num_warps=4
        )
    return out
