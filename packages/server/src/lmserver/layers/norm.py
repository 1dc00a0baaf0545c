"""RMSNorm, computed in float32 like HF transformers (so float32 logits match exactly).

The torch ops are the default; a model routes every norm through the fused Triton kernels
instead by setting `kernels` once when it is built (`LlamaForCausalLM.use_kernels`). Both paths
round where HF does (see `lmserver.kernels.norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from lmserver.kernels.dispatch import KernelOps
from lmserver.layers.fp8_linear import Fp8Rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: KernelOps | None = None  # None: torch ops; set once at model build

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes over the last dimension; returns a new tensor of x's dtype."""
        if self.kernels is not None:
            rows = x.reshape(-1, x.shape[-1])  # the kernel takes (rows, dim); a copy for strided heads
            return self.kernels.rmsnorm(rows, self.weight, self.eps).view(x.shape)
        dtype = x.dtype
        h = x.to(torch.float32)  # x itself in float32: never written
        rstd = h.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        out = (h * rstd).to(dtype)
        # HF's `weight * out`, in place on the new tensor when that keeps the result dtype
        return out.mul_(self.weight) if self.weight.dtype == dtype else self.weight * out

    def forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[Fp8Rows, torch.Tensor]:
        """Kernel path only, for an FP8 linear that `takes_fp8_rows`: (this norm's output quantized per
        token in the norm's launch, `KernelOps.rmsnorm_fp8`; the residual stream). x (T, dim). With
        `residual`: `residual <- residual + x` first, as `add_forward` (mutates residual); None (the
        first layer): x is the residual stream (not mutated)."""
        assert self.kernels is not None, "the fused FP8 norm runs on the kernel path"
        q, scale = self.kernels.rmsnorm_fp8(x, self.weight, self.eps, residual)
        return Fp8Rows(q, scale, x.dtype), x if residual is None else residual

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual <- residual + x` (rounded to the dtype, as HF's `residual + hidden`), then
        returns (rmsnorm(residual), residual). x, residual: (T, dim), owned by the caller.

        Mutates residual; on the fused path also x, which then holds the normalized value.
        """
        if self.kernels is not None:
            self.kernels.fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        residual.add_(x)
        return self(residual), residual
