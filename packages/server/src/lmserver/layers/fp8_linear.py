"""FP8 (e4m3) weight linear layer and its three paths, chosen once when the model is built.

`Fp8Linear` holds `weight` (N, K) float8_e4m3fn and `weight_scale` (N, ceil(K / group_k))
float32 (layout: `lmserver.kernels.fp8_ref`). Its forward:

- `torch` (CPU, or CUDA without Triton): dequantize to the activation dtype, then `F.linear`.
  The reference of the other two.
- `triton` (CUDA): up to `GEMV_MAX_M` rows (decode) the FP8 GEMV kernel
  (`lmserver.kernels.fp8_gemv`: FP8 weight bytes read once, float32 accumulation); more rows
  (prefill) through `torch._scaled_mm` (cuBLASLt FP8 tensor cores, activations quantized per
  token on the fly) when the scales are per channel and the GPU is Hopper or newer, else
  dequantize + matmul. A caller holding the activation quantized already calls
  `forward_fp8_rows` when `takes_fp8_rows(M)`, or passes `Fp8Rows` to `forward`: the dense MLP's
  down projection, whose input comes from the fused SiLU-and-mul + FP8 quantizer, and the qkv and
  gate-up projections, whose inputs come from the fused RMSNorm + FP8 quantizer
  (`lmserver.kernels.fp8_quant`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from lmserver.kernels.fp8_ref import FP8_DTYPE, fp8_linear_ref, num_groups, quantize_fp8

__all__ = ["FP8_MIN_CAPABILITY", "GEMV_MAX_M", "Fp8Linear", "Fp8Rows", "fp8_unsupported_reason", "takes_fp8_rows"]

GEMV_MAX_M = 16  # rows up to which the Triton GEMV runs (decode); more: _scaled_mm or dequantize
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have FP8 tensor cores and conversions
SCALED_MM_MIN_CAPABILITY = (9, 0)  # row-wise scaled _scaled_mm (cuBLASLt) on Hopper and newer
SCALED_MM_FAST_ACCUM = True


def fp8_unsupported_reason(device: torch.device | str) -> str | None:
    """Why FP8 cannot run on `device` (a CUDA GPU below compute capability 8.9), else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"FP8 needs a GPU of compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
                f"(Ada, Hopper or newer); {device} ({name}) has compute capability {cap[0]}.{cap[1]}")
    return None


class Fp8Rows(NamedTuple):
    """An activation quantized per token (`lmserver.kernels.fp8_quant`), as an `Fp8Linear` that
    `takes_fp8_rows` consumes it: x = q * scale, q (M, K) float8_e4m3fn, scale (M, 1) float32;
    `dtype` the activation dtype it stands for (the linear's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def takes_fp8_rows(layer: nn.Module, m: int) -> bool:
    """Whether `layer` is an `Fp8Linear` whose forward of `m` rows quantizes them per token first (the
    `_scaled_mm` prefill), so that its producer may hand it `Fp8Rows` made in its own launch."""
    return isinstance(layer, Fp8Linear) and layer.takes_fp8_rows(m)


class Fp8Linear(nn.Module):
    """y = x @ (weight * weight_scale).T (+ bias), weights in FP8. Buffers are filled by the
    loader (an FP8 checkpoint) or by `from_linear` (online quantization)."""

    weight_scale: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool, group_k: int | None,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_k = in_features if group_k is None or group_k >= in_features else group_k
        groups = num_groups(in_features, self.group_k)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        # NOTE: a buffer, not a parameter: the model's weight loader fills parameters only; the
        # FP8 loader fills and checks the scales (lmserver.models.quantization).
        self.register_buffer("weight_scale", torch.ones(out_features, groups, dtype=torch.float32, device=device))
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.path = "torch"  # "torch" or "triton"; set once by `use_path`
        self.scaled_mm = False  # prefill through torch._scaled_mm (set by `use_path`)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_k: int | None = None) -> Fp8Linear:
        """`linear` quantized: per output channel (group_k None) or per (row, group_k columns)."""
        w = linear.weight.data
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group_k, w.dtype, w.device)
        q, scale = quantize_fp8(w, None if layer.group_k == linear.in_features else layer.group_k)
        layer.weight.data.copy_(q)
        layer.weight_scale.copy_(scale)
        if linear.bias is not None:
            assert layer.bias is not None
            layer.bias.data.copy_(linear.bias.data)
        return layer

    def use_path(self, path: str, scaled_mm: bool | None = None) -> None:
        """"torch" or "triton" (CUDA); mutates self. `_scaled_mm` serves prefill when the scales
        are per channel and the GPU is Hopper or newer (`scaled_mm` None), or when `scaled_mm` is
        True on the triton path with per-channel scales (tests: torch's CPU `_scaled_mm` under the
        Triton interpreter)."""
        if path not in ("torch", "triton"):
            raise ValueError(f"unknown FP8 linear path {path!r}")
        self.path = path
        dev = self.weight.device
        if scaled_mm is None:
            scaled_mm = dev.type == "cuda" and (
                tuple(torch.cuda.get_device_capability(dev)) >= SCALED_MM_MIN_CAPABILITY
                and self.in_features % 16 == 0 and self.out_features % 16 == 0)
        self.scaled_mm = path == "triton" and self.weight_scale.shape[1] == 1 and scaled_mm
        if self.scaled_mm:
            self._scale_row = self.weight_scale.view(1, -1).contiguous()  # (1, N) for _scaled_mm's scale_b

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_k={self.group_k}, "
                f"bias={self.bias is not None}, path={self.path}")

    def takes_fp8_rows(self, m: int) -> bool:
        """Whether a forward of `m` rows quantizes its activation per token first (the `_scaled_mm`
        prefill), so a caller that has it quantized already may call `forward_fp8_rows` instead."""
        return self.scaled_mm and m > GEMV_MAX_M

    def forward_fp8_rows(self, xq: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The forward of x = xq * x_scale: xq (M, K) float8_e4m3fn, x_scale (M, 1) float32 (per-token
        rows, `lmserver.kernels.fp8_quant`) -> (M, N) `out_dtype`. Through `_scaled_mm` when this layer
        takes it (`use_path`), else the dequantizing reference on the dequantized rows. Mutates nothing."""
        if self.scaled_mm:
            # NOTE: the bias is added apart: not every torch version takes one with row-wise scales.
            # use_fast_accum: Hopper's FP8 MMA accumulates without the periodic float32 promotion, as
            # vLLM's and SGLang's FP8 GEMMs do (the check script measures both, RESULTS.md FP8 (issue 33))
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self._scale_row, out_dtype=out_dtype,
                                   use_fast_accum=SCALED_MM_FAST_ACCUM)
            if self.bias is not None:
                out += self.bias
            return out
        x = (xq.float() * x_scale).to(out_dtype)
        return fp8_linear_ref(x, self.weight, self.weight_scale, self.group_k, self.bias)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """x (..., K) -> (..., N) in x's dtype (rows quantized already: `Fp8Rows`, (M, K) -> (M, N)
        through `forward_fp8_rows`); mutates nothing."""
        if isinstance(x, Fp8Rows):
            return self.forward_fp8_rows(x.q, x.scale, x.dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K), possibly strided rows
        if self.path == "triton":
            if x2.shape[0] <= GEMV_MAX_M:
                from lmserver.kernels.fp8_gemv import fp8_gemv

                out = fp8_gemv(x2, self.weight, self.weight_scale, self.group_k, self.bias)
            elif self.scaled_mm:
                from lmserver.kernels.fp8_quant import quantize_fp8_per_token

                out = self.forward_fp8_rows(*quantize_fp8_per_token(x2 if x2.stride(-1) == 1 else x2.contiguous()),
                                            out_dtype=x.dtype)
            else:
                out = fp8_linear_ref(x2, self.weight, self.weight_scale, self.group_k, self.bias)
        else:
            out = fp8_linear_ref(x2, self.weight, self.weight_scale, self.group_k, self.bias)
        return out.view(*lead, self.out_features)


def linear_to_dense(layer: Fp8Linear, dtype: torch.dtype) -> nn.Linear:
    """An `nn.Linear` holding the dequantized weights (tests, tools); `layer` is not changed."""
    from lmserver.kernels.fp8_ref import dequantize_fp8

    out = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                    dtype=dtype, device=layer.weight.device)
    with torch.no_grad():
        out.weight.copy_(dequantize_fp8(layer.weight, layer.weight_scale, layer.group_k, dtype))
        if layer.bias is not None:
            out.bias.copy_(layer.bias)
    return out

