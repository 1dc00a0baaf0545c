"""Triton FP8-weight GEMV for decode: y (M, N) = x (M, K) @ (weight * scale).T, M small.

The weight stays float8_e4m3fn in memory (half of bf16's bytes, the point at decode); each tile
is widened in registers (exact: every e4m3 value is a bf16 / fp16 / fp32 value) and accumulated
in float32. Two kernels, chosen per launch by `Fp8GemvConfig.variant`:

- `rows` (batch 1 to a few rows): lowlat's row-wise layout (`lowlat.kernels.gemv`): a program owns
  BLOCK_N output features and walks K in BLOCK_K tiles (BLOCK_K up to the whole row: one 16-byte
  load per thread and step), the tile goes from global memory to registers and is reduced against
  each activation row in turn (rows unrolled, no padding to 16). Many small programs (N / BLOCK_N)
  keep every SM's loads in flight without split-K.
- `dot` (more rows): the tile widened to the activation dtype and multiplied on the tensor cores
  (`tl.dot`, rows padded to 16).

Scales (`lmserver.kernels.fp8_ref` layout): per channel / per tensor (one column) are applied once
to the finished sums; per (row, group_k columns) groups (128 x 128 block checkpoints) to each tile's
partial sums, the tile never straddling two groups. Reference: `fp8_ref.fp8_linear_ref`.

Tile choice: `config_for` (the measured H200 table `TUNED`, else a shape rule). The per-token
activation quantizers of the `torch._scaled_mm` prefill path: `lmserver.kernels.fp8_quant`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError, check_last_dim_contiguous, dot_precision
from lmserver.kernels.fp8_ref import FP8_DTYPE

__all__ = ["Fp8GemvConfig", "config_for", "fp8_gemv"]


@triton.jit
def _fp8_gemv_rows_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # GROUP_K 0: one scale per row (applied at the end); else one per (row, GROUP_K columns), BLOCK_K divides GROUP_K
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows_w = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        w = tl.load(rows_w + k0 + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        wf = w.to(tl.float32)
        if GROUP_K > 0:
            s = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP_K, mask=mask_n, other=0.0)
        for m in tl.static_range(BLOCK_M):
            xm = tl.load(x_ptr + m * stride_xm + k0 + offs_k, mask=mask_k & (offs_k * 0 + m < M),
                         other=0.0).to(tl.float32)
            part = tl.sum(wf * xm[None, :], 1)
            if GROUP_K > 0:
                part = part * s
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    if GROUP_K == 0:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & mask_n[None, :])


@triton.jit
def _fp8_gemv_dot_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
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
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)  # (BM, BN) fp32
        if GROUP_K > 0:
            s = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP_K, mask=mask_n, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
    if GROUP_K == 0:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class Fp8GemvConfig:
    """One launch: `variant` "rows" (row-wise, batch padded to a power of two, at most
    `ROWS_MAX_M`) or "dot" (tensor cores, rows padded to 16); a program's BLOCK_N x BLOCK_K tile,
    its warps and (dot) pipeline stages."""

    variant: str = "dot"
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.variant not in ("rows", "dot"):
            raise ValueError(f"Fp8GemvConfig.variant must be 'rows' or 'dot', got {self.variant!r}")
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"Fp8GemvConfig.{name} must be a power of two, got {value}")


ROWS_MAX_M = 8  # the row-wise kernel unrolls its rows: beyond a few, the tensor cores win
# Measured on the H200 (benchmarks/fp8/check_fp8_gpu.py --sweep; benchmarks/RESULTS.md "FP8 (issue 33)"):
# (device name, max M, K, N) -> config; first matching max M >= M wins. Shapes not listed: `_default_config`.
# H200 2026-12-02 (commit 5b9c704, L2 flushed, us per call, % of the FP8 floor at 4.25 TB/s): Llama-3-8B
# decode shapes; at M = 1 row-wise 8 x 1024-2048 tiles (qkv 13.8, o 10.7, gate-up 41.3, down 23.8), above the
# tensor-core kernel (M = 8: 18.9, 16.2, 47.9, 33.6; bf16 cuBLAS 22.8, 18.7, 69.2, 42.3)
_H200 = "NVIDIA H200"
TUNED: dict[tuple[str, int, int, int], Fp8GemvConfig] = {
    (_H200, 1, 4096, 6144): Fp8GemvConfig("rows", 8, 1024, 4, 1),
    (_H200, 16, 4096, 6144): Fp8GemvConfig("dot", 32, 512, 4, 4),
    (_H200, 1, 4096, 4096): Fp8GemvConfig("rows", 8, 2048, 8, 1),
    (_H200, 2, 4096, 4096): Fp8GemvConfig("rows", 8, 1024, 4, 1),
    (_H200, 4, 4096, 4096): Fp8GemvConfig("dot", 32, 1024, 4, 3),
    (_H200, 8, 4096, 4096): Fp8GemvConfig("dot", 32, 256, 4, 4),
    (_H200, 16, 4096, 4096): Fp8GemvConfig("dot", 32, 512, 4, 4),
    (_H200, 1, 4096, 28672): Fp8GemvConfig("rows", 8, 2048, 8, 1),
    (_H200, 16, 4096, 28672): Fp8GemvConfig("dot", 32, 256, 4, 4),
    (_H200, 1, 14336, 4096): Fp8GemvConfig("rows", 8, 2048, 8, 1),
    (_H200, 8, 14336, 4096): Fp8GemvConfig("dot", 32, 1024, 4, 3),
    (_H200, 16, 14336, 4096): Fp8GemvConfig("dot", 32, 512, 4, 4),
    # the FP8 LM heads (--quantize-lm-head; bench_lm_head.py --sweep, H200 2026-12-03, commit 8599715, us per call,
    # CUDA-graph replays, L2 flushed; the shape rule's launch in brackets): Llama-3-8B 4096 x 128256 at 1 row 129.3
    # (137.1), 2-8 rows 178.7-178.9 (210.6-211.9), 16 rows 176.6 (204.8); Mixtral 4096 x 32000 at 1 row 43.4 (44.6),
    # 2-16 rows 53.4-54.3 (59.9-61.6); SmolLM2 576 x 49152 at 1 row 18.8 (19.3), 2-16 rows 22.6-22.8 (34.7-35.5)
    (_H200, 1, 4096, 128256): Fp8GemvConfig("rows", 16, 512, 4, 1),
    (_H200, 8, 4096, 128256): Fp8GemvConfig("dot", 32, 256, 4, 4),
    (_H200, 16, 4096, 128256): Fp8GemvConfig("dot", 64, 256, 4, 3),
    (_H200, 1, 4096, 32000): Fp8GemvConfig("rows", 8, 1024, 4, 1),
    (_H200, 16, 4096, 32000): Fp8GemvConfig("dot", 32, 256, 4, 4),
    (_H200, 1, 576, 49152): Fp8GemvConfig("rows", 16, 512, 4, 1),
    (_H200, 16, 576, 49152): Fp8GemvConfig("dot", 64, 256, 4, 3),
}


def _default_config(m: int, k: int, n: int) -> Fp8GemvConfig:
    """The shape rule for untuned shapes: row-wise 8 x 2048 tiles at batch 1 (the best H200 tile
    on three of the four 8B shapes), the tensor cores above."""
    if m == 1:
        block_k = min(2048, triton.next_power_of_2(k))
        return Fp8GemvConfig("rows", 8, block_k, 8 if block_k >= 2048 else 4, 1)
    return Fp8GemvConfig("dot", 32, 512, 4, 4)


@functools.lru_cache(maxsize=1024)
def _config_for(m: int, k: int, n: int, device_name: str) -> Fp8GemvConfig:
    for max_m in sorted({mm for (d, mm, kk, nn) in TUNED if d == device_name and kk == k and nn == n}):
        if m <= max_m:
            return TUNED[(device_name, max_m, k, n)]
    return _default_config(m, k, n)


@functools.lru_cache(maxsize=16)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def config_for(m: int, k: int, n: int, device: torch.device | None = None) -> Fp8GemvConfig:
    """The launch for an (M, K) x (K, N) FP8 GEMV on `device`: the tuned entry, else the rule
    (memoized: decode calls it per layer and step)."""
    return _config_for(m, k, n, _device_name(device) if device is not None else "")


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
    cfg = config or config_for(m, k, n, x.device)
    if cfg.variant == "rows" and m > ROWS_MAX_M:
        cfg = Fp8GemvConfig("dot", cfg.block_n, cfg.block_k, cfg.num_warps, max(cfg.num_stages, 2))
    block_k = cfg.block_k
    if groups > 1:
        if group_k % 16:
            raise KernelInputError(f"group_k ({group_k}) must be a multiple of 16")
        while group_k % block_k:  # a tile never straddles two K groups
            block_k //= 2
    if cfg.variant == "dot":
        block_k = max(block_k, 16)
    check_last_dim_contiguous(x=x, weight=weight)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    args = (x, weight, weight_scale, bias if bias is not None else weight_scale, out, m, n, k,
            x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0))
    group = group_k if groups > 1 else 0
    if cfg.variant == "rows":
        _fp8_gemv_rows_kernel[(triton.cdiv(n, cfg.block_n),)](
            *args, GROUP_K=group, HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m),
            BLOCK_N=cfg.block_n, BLOCK_K=block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        block_m = 16
        _fp8_gemv_dot_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))](
            *args, GROUP_K=group, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=block_k, PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
