"""Per-token FP8 (e4m3) activation quantizers of the `torch._scaled_mm` prefill (`Fp8Linear`).

Each row x gets scale = amax(|x|) / 448 (at least 1e-12) and the bytes e4m3(clamp(x * (1 / scale))), the
divisions IEEE-rounded (`tl.div_rn`, as torch divides) and the product too: the same values as
`fp8_ref.quantize_fp8_per_token`. (A quotient per element, `x / scale` IEEE-rounded, cost ~12 instructions with
a slow-path branch per value: the fused SiLU quantizer ran at 2.2 TB/s on the H200, bound by issue, not bytes.)
One program per row, one launch:

- `quantize_fp8_per_token`: the rows of x (o_proj's input, and any input its producer did not quantize).
- `silu_and_mul_quantize_fp8`: the rows of silu(gate) * up for a gate-up output (the input of
  down_proj), rounded to the activation dtype exactly as `kernels.activation.silu_and_mul` does, so
  the bytes equal `quantize_fp8_per_token(silu_and_mul(gate_up))`; the (M, d) product is never written.
- `rmsnorm_quantize_fp8`: the rows of the (residual-add +) RMSNorm of `kernels.norm` (the inputs of
  qkv and gate_up), the same bytes as quantizing that kernel's output, which is never written.

`QuantLaunch` says how a row is walked: in one tile held in registers (one pass: read once), or in
`block_k`-column steps in two passes (amax, then quantize: the second reads the row again, mostly
from L2, and a gated row recomputes its SiLU), so a 14,336-wide row needs no 16k-element tile.
`quant_launch` picks one per row width (the norm's rows: one tile, as `kernels.norm`). Reference:
`fp8_ref.quantize_fp8_per_token` (after `reference.silu_and_mul_ref`, `rmsnorm_ref`,
`fused_add_rmsnorm_ref` for the fused ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError, check_last_dim_contiguous, next_pow2, row_warps
from lmserver.kernels.activation import silu_mul
from lmserver.kernels.fp8_ref import FP8_DTYPE
from lmserver.kernels.norm import add_rmsnorm_row, check_norm_inputs

__all__ = [
    "GATED_ONE_PASS_MAX_K",
    "ONE_PASS_MAX_K",
    "QuantLaunch",
    "quant_launch",
    "quantize_fp8_per_token",
    "rmsnorm_quantize_fp8",
    "silu_and_mul_quantize_fp8",
]

ONE_PASS_MAX_K = 4096  # rows up to this width (padded to a power of two) stay in registers: one pass; wider
# rows: two passes over steps of this many columns
GATED_ONE_PASS_MAX_K = 16384  # SiLU-and-mul rows (of this many output columns) up to which one pass is faster


@dataclass(frozen=True)
class QuantLaunch:
    """`block_k` columns per step (a power of two; >= the row width: one pass) and the warps of a program;
    `l2_hints` (two passes only): the first pass loads with evict_last, the second with evict_first, so that
    a row stays in L2 for its second read and leaves it after."""

    block_k: int
    num_warps: int
    l2_hints: bool = True

    def __post_init__(self) -> None:
        for name in ("block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"QuantLaunch.{name} must be a power of two, got {value}")


def quant_launch(k: int, gated: bool = False) -> QuantLaunch:
    """The launch for rows of `k` values (`gated`: SiLU-and-mul's, `silu_and_mul_quantize_fp8`, 2k wide).
    Measured on the H200 at M = 4,096 (benchmarks/fp8/bench_quant_kernels.py --sweep --launches ..., RESULTS.md
    FP8 (issue 33), 2026-12-03):
    - gated rows up to `GATED_ONE_PASS_MAX_K` columns: the padded row in one pass, 16 warps (k = 14,336: 118.2 us
      against 142-182 for two passes over 2-8k-column steps, 184.1 at 32 warps; in the 4k prefill 163.9 -> 123.3
      us per layer);
    - other rows up to `ONE_PASS_MAX_K`: one pass, 1,024 columns per warp (k = 4,096: 4 warps 19.5 us, 8 warps
      20.0, 16 warps 24.0);
    - wider rows: two passes over `ONE_PASS_MAX_K`-column steps, 256 columns per warp (`row_warps`; a plain
      14,336-wide row: 72.1 us against 86.5 in one 16k pass). The second pass's reads hit L2 only if the rows stay
      there meanwhile (`QuantLaunch.l2_hints`)."""
    if gated and k <= GATED_ONE_PASS_MAX_K:
        return QuantLaunch(next_pow2(k), 16)
    if k <= ONE_PASS_MAX_K:
        block = next_pow2(k)
        return QuantLaunch(block, max(1, min(16, block // 1024)))
    return QuantLaunch(ONE_PASS_MAX_K, row_warps(ONE_PASS_MAX_K))


@triton.jit
def _row_values(row_ptr, offs, mask, K, GATED: tl.constexpr, EVICT: tl.constexpr):
    # float32 values of one row's columns `offs`: x, or silu(gate) * up rounded to the activation dtype. NOTE: EVICT
    # has no default: Triton 3.6 passes a nested call's string default as a plain str (compile error on the H200)
    if GATED:
        gate = tl.load(row_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT)
        up = tl.load(row_ptr + K + offs, mask=mask, other=0.0, eviction_policy=EVICT)
        return silu_mul(gate, up).to(tl.float32)
    return tl.load(row_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)


@triton.jit
def _fp8_scale(amax):
    # NOTE: div_rn (IEEE rounding, as torch divides): the same scales and FP8 bytes as the torch reference
    return tl.maximum(tl.div_rn(amax, 448.0), 1e-12)


@triton.jit
def _to_fp8(x, scale, q_ptr):
    # x * (1 / scale): one IEEE reciprocal per scale (scale's shape, before broadcasting), then a product per value
    return tl.clamp(x * tl.div_rn(1.0, scale), -448.0, 448.0).to(q_ptr.dtype.element_ty)


@triton.jit
def _store_fp8_row(q_row, s_at, offs, mask, x):
    # a whole row's float32 values x (masked columns 0) -> its scale at s_at, its FP8 bytes at q_row + offs
    scale = _fp8_scale(tl.max(tl.abs(x), 0))
    tl.store(q_row + offs, _to_fp8(x, scale, q_row), mask=mask)
    tl.store(s_at, scale)


@triton.jit
def _quantize_row(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, GATED: tl.constexpr, BLOCK_K: tl.constexpr,
                  ONE_PASS: tl.constexpr, FIRST_EVICT: tl.constexpr, SECOND_EVICT: tl.constexpr):
    # this program's row: amax -> scale = amax / 448 -> x * (1 / scale) saturated to e4m3 (fp8_ref.quantize_fp8_per_token).
    # K: the quantized row's width (a gated row reads 2K values: gate then up)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:  # BLOCK_K >= K: the row stays in registers
        mask = offs < K
        _store_fp8_row(q_row, s_ptr + row, offs, mask, _row_values(x_row, offs, mask, K, GATED, ""))
    else:  # two passes over BLOCK_K-column steps (a maximum is exact in any order: the same scale)
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            amax = tl.maximum(amax, tl.abs(_row_values(x_row, k0 + offs, k0 + offs < K, K, GATED, FIRST_EVICT)))
        scale = _fp8_scale(tl.max(amax, 0))
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = _row_values(x_row, k0 + offs, mask, K, GATED, SECOND_EVICT)
            tl.store(q_row + k0 + offs, _to_fp8(x, scale, q_row), mask=mask)
        tl.store(s_ptr + row, scale)


# NOTE: two kernels of one body, so that a profile names the fused one apart
@triton.jit
def _quantize_per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr,
                               ONE_PASS: tl.constexpr, FIRST_EVICT: tl.constexpr, SECOND_EVICT: tl.constexpr):
    _quantize_row(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, False, BLOCK_K, ONE_PASS, FIRST_EVICT, SECOND_EVICT)


@triton.jit
def _silu_and_mul_quantize_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr,
                                  ONE_PASS: tl.constexpr, FIRST_EVICT: tl.constexpr, SECOND_EVICT: tl.constexpr):
    _quantize_row(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, True, BLOCK_K, ONE_PASS, FIRST_EVICT, SECOND_EVICT)


@triton.jit
def _rmsnorm_quantize_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, hidden, eps, stride_x, stride_r, stride_q,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # one program per row: [residual <- x + residual;] rmsnorm * weight (norm.add_rmsnorm_row), then quantized
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    y = add_rmsnorm_row(x_ptr + row * stride_x, r_ptr + row * stride_r, w_ptr, offs, mask, hidden, eps, HAS_RESIDUAL)
    _store_fp8_row(q_ptr + row * stride_q, s_ptr + row, offs, mask, y.to(tl.float32))


def _quantize_rows(x: torch.Tensor, k: int, gated: bool, launch: QuantLaunch | None) -> tuple[torch.Tensor, torch.Tensor]:
    check_last_dim_contiguous(x=x)
    m = x.shape[0]
    q, scale = _empty_rows(x, k)
    if m and k:
        cfg = launch or quant_launch(k, gated)
        kernel = _silu_and_mul_quantize_kernel if gated else _quantize_per_token_kernel
        hints = cfg.l2_hints and cfg.block_k < k
        kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=cfg.block_k, ONE_PASS=cfg.block_k >= k,
                     FIRST_EVICT="evict_last" if hints else "", SECOND_EVICT="evict_first" if hints else "",
                     num_warps=cfg.num_warps)
    return q, scale


def _empty_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    return (torch.empty(m, k, dtype=FP8_DTYPE, device=x.device),
            torch.empty(m, 1, dtype=torch.float32, device=x.device))


def quantize_fp8_per_token(x: torch.Tensor, launch: QuantLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (float8_e4m3fn (M, K), float32 scale (M, 1)) in one launch (`launch`: None for
    `quant_launch(K)`); the same values as `fp8_ref.quantize_fp8_per_token` for any launch. Pure."""
    if x.dim() != 2:
        raise KernelInputError(f"expected x (M, K); got {tuple(x.shape)}")
    return _quantize_rows(x, x.shape[1], False, launch)


def silu_and_mul_quantize_fp8(gate_up: torch.Tensor,
                              launch: QuantLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up (M, 2 * d) -> the per-token FP8 rows of silu(gate) * up: (float8_e4m3fn (M, d), float32
    scale (M, 1)) in one launch, the bytes of `quantize_fp8_per_token(activation.silu_and_mul(gate_up))`
    (reference: `fp8_ref.quantize_fp8_per_token(reference.silu_and_mul_ref(gate_up))`). Pure."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise KernelInputError(f"expected gate_up (M, 2 * d); got {tuple(gate_up.shape)}")
    return _quantize_rows(gate_up, gate_up.shape[1] // 2, True, launch)


def rmsnorm_quantize_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                         residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token FP8 rows of rmsnorm(x) * weight, x (T, hidden) (with `residual`: first
    `residual <- x + residual` in place, then of rmsnorm(residual) * weight, as
    `norm.fused_add_rmsnorm`): (float8_e4m3fn (T, hidden), float32 scale (T, 1)) in one launch, the
    bytes of `quantize_fp8_per_token` of the norm kernels' output, which is never written (the input
    of an FP8 qkv / gate-up projection). Mutates `residual` only."""
    check_norm_inputs(x, weight, residual)
    q, scale = _empty_rows(x, x.shape[1])
    if x.shape[0]:
        block = next_pow2(x.shape[1])
        _rmsnorm_quantize_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, weight, q, scale, x.shape[1], eps, x.stride(0),
            residual.stride(0) if residual is not None else 0, q.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=row_warps(block))
    return q, scale
