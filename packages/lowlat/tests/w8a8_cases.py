"""W8A8 multi-row GEMV cases (``mrow_w8a8`` / ``mrow_w8a8b``: the rows quantized to e4m3 in the kernel, FP8 x FP8
MMA) against float64 oracles; run by test_kernels_interpret_fp8.py.

Not collected directly: a child pytest runs this file with TRITON_INTERPRET=1 on the CPU (small ragged shapes), or
without it on a CUDA machine (the same plus the Llama-3-8B stages, bf16 activations). The oracle quantizes the rows
with torch (scale = amax / 448 per row, or per row and K block of the launch's BLOCK_K, at least 1e-12; x times the
float32 reciprocal of the scale, as the kernels do, saturated and rounded to e4m3 by torch's conversion), dequantizes them and the FP8 weights and computes in float64.
Every case also checks the error against unquantized rows, so that a kernel which does not quantize (or quantizes
with a wrong scale) fails one of the two bounds.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from lowlat import KVCache, LayerShape
from lowlat.kernels import ops
from lowlat.layer import FP8_DTYPE, dequantized, quantize_rows_fp8
from lowlat.reference import apply_rope
from lowlat.testing import decode_meta, random_kv

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = torch.device("cuda" if GPU else "cpu")
DTYPE = torch.bfloat16 if GPU else torch.float32  # activations: float32 on the interpreter, bf16 on a GPU
# against the oracle with the same quantized rows: float32 sums (interpreter); bf16 outputs and sm_90's FP8 MMA (GPU)
TOL_Q = 1e-2 if GPU else 1e-5
# against unquantized rows: e4m3 rounds each row value to 3 mantissa bits (~2.7% rms relative per projection output,
# ~3.8% through SiLU(g) x u on the 8B gate-up; a few outputs of the interpreter's small shapes scatter more)
TOL_X = 8e-2
VARIANTS = ["mrow_w8a8", "mrow_w8a8b"]
LLAMA8B = LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
SMALL = LayerShape(hidden_size=96, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=80)
# the GPU cases' tiles: the first candidate of each stage (benchmarks/fp8/device_fp8_w8a8.sh sweeps the rest)
GPU_TILES = {"qkv": (32, 256, 4, 3), "o_proj": (64, 256, 4, 3), "gate_up": (64, 256, 4, 3), "down": (64, 512, 4, 3)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed + int.from_bytes(os.urandom(2), "little"))  # fresh inputs per run


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a.float()).all(), "NaN / inf in kernel output"
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def quantized_rows(x: torch.Tensor, group: int | None, by_division: bool = False) -> torch.Tensor:
    """The rows of ``x`` (B, K) as the W8A8 kernels quantize them, dequantized in float64: per row (``group`` None) or
    per row and ``group`` columns (the last group ragged); float32 scale = amax / 448 (at least 1e-12), each value
    times the float32 1 / scale (``by_division``: divided by the scale, which rounds differently near e4m3 midpoints;
    only to show that the planted-midpoint test tells the two apart)."""
    xf = x.float()
    out = torch.empty(xf.shape, dtype=torch.float64)
    step = group or xf.shape[1]
    for k0 in range(0, xf.shape[1], step):
        blk = xf[:, k0:k0 + step].cpu()
        scale = (blk.abs().amax(dim=1) / 448.0).clamp_min(1e-12)
        y = blk / scale[:, None] if by_division else blk * (1.0 / scale)[:, None]
        q = y.clamp(-448.0, 448.0).to(FP8_DTYPE)
        out[:, k0:k0 + step] = q.double() * scale.double()[:, None]
    return out.to(x.device)


def midpoint_rows(rows: int, k: int, group: int, g: torch.Generator) -> torch.Tensor:
    """(rows, k) float32 rows whose values sit where ``x * (1 / scale)`` and ``x / scale`` round to different e4m3
    values (a float32 ulp from a midpoint of two e4m3 values), each ``group`` columns led by its largest value, which
    sets the scale (``group`` = k: per row)."""
    out = torch.empty(rows, k)
    for r in range(rows):
        for k0 in range(0, k, group):
            out[r, k0:k0 + group] = _midpoint_values(min(group, k - k0), g)
    return out


def _midpoint_values(count: int, g: torch.Generator) -> torch.Tensor:
    """``count`` float32 values, the first the largest: the others round apart (see ``midpoint_rows``) at its scale."""
    while True:  # some scales' reciprocals round so that no midpoint tells the two apart: draw another
        amax = torch.tensor(0.5 + 3.0 * float(torch.rand((), generator=g)), dtype=torch.float32)
        scale = (amax / 448.0).clamp_min(1e-12)
        inv = 1.0 / scale
        found = []
        for e, j in ((e, j) for e in range(6) for j in range(8)):  # midpoints m = 2^e (1 + (2j + 1) / 16) in [1, 64)
            x = (torch.tensor(2.0**e * (1 + (2 * j + 1) / 16)) * scale).float()
            for toward in (float("inf"), -float("inf")):
                cand = x
                for _ in range(4):
                    if (cand / scale).to(FP8_DTYPE).float() != (cand * inv).to(FP8_DTYPE).float():
                        found.append(float(cand))
                        break
                    cand = torch.nextafter(cand, torch.tensor(toward))
        if len(found) >= 4:
            break
    picks = torch.tensor(found)[torch.randint(0, len(found), (count - 1,), generator=g)]
    signs = torch.where(torch.rand(count - 1, generator=g) < 0.5, -1.0, 1.0)
    return torch.cat([amax[None], picks * signs])


def _group(cfg: ops.GemvConfig, k: int) -> int | None:
    """The oracle's K group for ``cfg`` over K = ``k``: the launch's BLOCK_K (``mrow_w8a8b``) or the whole row."""
    return min(cfg.block_k, 1 << (k - 1).bit_length()) if cfg.variant == "mrow_w8a8b" else None


def _lc(stage: str, cfg: ops.GemvConfig) -> ops.LaunchConfig:
    base = ops.LaunchConfig.for_device(DEVICE, SMALL, use_pdl=False, fp8=True)
    return replace(base, tuned=((stage, 16, cfg),))


def _cfg(variant: str, stage: str, small: tuple[int, int]) -> ops.GemvConfig:
    if GPU:
        bn, bk, nw, ns = GPU_TILES[stage]
        return ops.GemvConfig(variant, bn, bk, nw, ns)
    return ops.GemvConfig(variant, *small)


def _fp8_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w, scale = quantize_rows_fp8(torch.randn(n, k, generator=g) / k**0.5)
    return w.to(DEVICE), scale.to(DEVICE), dequantized(w, scale, torch.float64).to(DEVICE)


def _check(out: torch.Tensor, want_q: torch.Tensor, want_x: torch.Tensor, tol_x: float = TOL_X) -> None:
    """``out`` within TOL_Q of the quantized-rows oracle and within TOL_X of the unquantized one, and (interpreter)
    closer to the first by 100x where quantizing made a difference (not for a row dominated by one exact outlier):
    the rows were quantized, as the oracle quantizes them."""
    err_q, err_x = _rel(out, want_q), _rel(out, want_x)
    assert err_q < TOL_Q, (err_q, err_x)
    assert err_x < tol_x, (err_q, err_x)
    if not GPU and err_x > 1e-3:
        assert err_q * 100 < err_x, (err_q, err_x)


# rows 1..16 (padding rows inside the 16-row MMA and, on the interpreter, in the power-of-two tile); ragged N and K.
# 13 and 16 rows in the interpreter's slow tier (the same oracle as the others); on a GPU (a compile per row count and
# shape) 1, 8 and 16 rows
ROWS = [1, 8, 16] if GPU else [1, 2, 3, 6, 8, *(pytest.param(r, marks=pytest.mark.slow) for r in (13, 16))]
GEMV_SHAPES = [(40, 100), (64, 160)] if not GPU else [(4096, 4096), (4096, 14336)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
def test_w8a8_gemv_residual_matches_quantized_oracle(variant: str, rows: int) -> None:
    """o_proj / down's multi-row kernel (``gemv_residual``) with and without the residual, each K a ragged or a whole
    number of K blocks, against float64 on the dequantized weights and rows."""
    g = _gen(rows)
    cfg = _cfg(variant, "down", (16, 32))
    for (n, k), has_res in zip(GEMV_SHAPES, (True, False), strict=True):
        w, scale, wd = _fp8_weight(n, k, g)
        a = torch.randn(rows, k, generator=g).to(DEVICE, DTYPE)
        res = torch.randn(rows, n, generator=g).to(DEVICE, DTYPE) if has_res else None
        out = torch.full((rows, n), float("nan"), device=DEVICE, dtype=DTYPE)
        ops.gemv_residual(a, w, res, out, _lc("down", cfg), stage="down", scale=scale)
        base = res.double() if res is not None else 0.0
        _check(out, base + quantized_rows(a, _group(cfg, k)) @ wd.T, base + a.double() @ wd.T)


@pytest.mark.skipif(GPU, reason="bf16 rows hold no planted float32 midpoints; TOL_Q on a GPU is 1e-2")
@pytest.mark.parametrize("variant", VARIANTS)
def test_w8a8_rounds_midpoints_as_times_the_reciprocal(variant: str) -> None:
    """Rows planted where x * (1 / scale) and x / scale round to different e4m3 values: the kernel multiplies by the
    reciprocal (as the oracle), which a division oracle would fail by far more than TOL_Q (a random row meets such a
    value about once in a few hundred runs: CI did)."""
    g = _gen(45)
    cfg = _cfg(variant, "down", (16, 32))
    n, k = GEMV_SHAPES[1]
    w, scale, wd = _fp8_weight(n, k, g)
    group = _group(cfg, k)
    a = midpoint_rows(3, k, group or k, g).to(DEVICE, DTYPE)
    out = torch.full((3, n), float("nan"), device=DEVICE, dtype=DTYPE)
    ops.gemv_residual(a, w, None, out, _lc("down", cfg), stage="down", scale=scale)
    want_q = quantized_rows(a, group) @ wd.T
    assert _rel(want_q, quantized_rows(a, group, by_division=True) @ wd.T) > 100 * TOL_Q  # the test tells them apart
    _check(out, want_q, a.double() @ wd.T)


@pytest.mark.parametrize("variant", VARIANTS)
def test_w8a8_keeps_large_small_and_zero_rows(variant: str) -> None:
    """Rows of a bf16 model's large activations (~1e5 - 8e5: fp16 holds none of them unscaled; the per-row scale
    does), ordinary, tiny (1e-3), all-zero rows (scale 1e-12: zeros, never 0 / 0) and a row with one outlier, each
    against the oracle on its own (no residual: a row's sums alone); the zero rows' outputs are exactly 0."""
    g = _gen(40)
    cfg = _cfg(variant, "down", (16, 32))
    n, k = GEMV_SHAPES[1]
    w, scale, wd = _fp8_weight(n, k, g)
    mags = torch.tensor([8e5, 1.0, 1e-3, 0.0, 2e5, 1.0, 0.0, 1.3e5])[:, None]
    a = torch.randn(8, k, generator=g) * mags
    a[5, 7] = 5e4  # one outlier in an ordinary row: the others quantized at its scale
    a = a.to(DEVICE, DTYPE)
    out = torch.full((8, n), float("nan"), device=DEVICE, dtype=DTYPE)
    ops.gemv_residual(a, w, None, out, _lc("down", cfg), stage="down", scale=scale)
    assert float(a.double().abs().max()) > 65504.0
    want_q = quantized_rows(a, _group(cfg, k)) @ wd.T
    want_x = a.double() @ wd.T
    assert torch.isfinite(out).all()
    for row in (0, 1, 2, 4, 5, 7):
        _check(out[row], want_q[row], want_x[row])
    assert not out[3].any() and not out[6].any()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 8, 16] if GPU else [1, 3, 8, 16])
def test_w8a8_norm_gate_up_matches_quantized_oracle(variant: str, rows: int) -> None:
    """RMSNorm + gate-up + SiLU: the rows times the norm weight are what is quantized (1 / rms after the MMA)."""
    g = _gen(50 + rows)
    shape = LLAMA8B if GPU else SMALL
    h, i = shape.hidden_size, shape.intermediate_size
    cfg = _cfg(variant, "gate_up", (16, 32))
    w, scale, wd = _fp8_weight(2 * i, h, g)
    gamma = (1.0 + 0.3 * torch.randn(h, generator=g)).to(DEVICE, DTYPE)
    x = (torch.randn(rows, h, generator=g) * torch.logspace(-1, 2, rows)[:, None]).to(DEVICE, DTYPE)
    act = torch.full((rows, i), float("nan"), device=DEVICE, dtype=DTYPE)
    ops.norm_gate_up(x, gamma, w, act, shape.rms_eps, _lc("gate_up", cfg), scale=scale)
    xd = x.double()
    rstd = 1.0 / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + shape.rms_eps)

    def silu_mul(xg: torch.Tensor) -> torch.Tensor:
        gate, up = (xg * rstd @ wd.T).split(i, dim=-1)
        return torch.nn.functional.silu(gate) * up

    xg = x.float() * gamma.float()  # the kernel's float32 product, quantized
    _check(act, silu_mul(quantized_rows(xg, _group(cfg, h))), silu_mul(xd * gamma.double()), 1.5 * TOL_X)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [6, 8] if GPU else [1, 6, 8])
def test_w8a8_qkv_rope_kv_write_matches_quantized_oracle(variant: str, rows: int) -> None:
    """RMSNorm + QKV + RoPE + the K/V write (model-dtype cache): q and the written slots against the oracle, every
    other slot untouched."""
    g = _gen(60 + rows)
    shape = LLAMA8B if GPU else SMALL
    h = shape.hidden_size
    cfg = _cfg(variant, "qkv", (2, 32))
    w, scale, wd = _fp8_weight(shape.qkv_size, h, g)
    gamma = (1.0 + 0.3 * torch.randn(h, generator=g)).to(DEVICE, DTYPE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim))
    weights = type("W", (), dict(input_norm=gamma, qkv=w, qkv_scale=scale, rope_inv_freq=inv_freq.to(DEVICE)))()
    slots = 64 + 8 * rows
    meta = decode_meta([5 + 3 * j for j in range(rows)], slots, 64, DEVICE, generator=g)
    kv = random_kv(shape, slots, DTYPE, DEVICE, generator=g)
    before = KVCache(kv.k.clone(), kv.v.clone())
    x = (torch.randn(rows, h, generator=g) * 3).to(DEVICE, DTYPE)
    q = torch.full((rows, shape.q_size), float("nan"), device=DEVICE, dtype=DTYPE)
    ops.qkv_rope(x, weights, kv, meta, q, shape, _lc("qkv", cfg))  # type: ignore[arg-type]
    rstd = 1.0 / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + shape.rms_eps)

    def qkv(xg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rq, rk, rv = (xg * rstd @ wd.T).split([shape.q_size, shape.kv_size, shape.kv_size], -1)
        rq = apply_rope(rq.view(rows, shape.num_heads, -1), meta.positions, inv_freq.to(DEVICE)).double().reshape(rows, -1)
        rk = apply_rope(rk.view(rows, shape.num_kv_heads, -1), meta.positions, inv_freq.to(DEVICE)).double()
        return rq, rk, rv.view(rows, shape.num_kv_heads, -1)

    loc = meta.out_cache_loc.long()
    want_q, want_x = qkv(quantized_rows(x.float() * gamma.float(), _group(cfg, h))), qkv(x.double() * gamma.double())
    _check(q, want_q[0], want_x[0])
    _check(kv.k[loc], want_q[1], want_x[1])
    _check(kv.v[loc], want_q[2], want_x[2])
    others = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    others[loc] = False
    assert torch.equal(kv.k[others], before.k[others]) and torch.equal(kv.v[others], before.v[others])


def test_w8a8_on_model_dtype_weights_runs_the_mrow_kernel() -> None:
    """A W8A8 entry on model-dtype weights has nothing to quantize against: the launch runs ``mrow`` (``MMA`` 1), as
    exact as the model-dtype kernels."""
    g = _gen(70)
    # o_proj's GPU tile: down's 64 x 512 x 3 stages of bf16 weights need 320 KiB of shared memory (H200: 227 KiB)
    cfg = _cfg("mrow_w8a8", "o_proj", (16, 32))
    assert cfg.mma_for(False) == 1 and cfg.mma_for(True) == 4
    n, k = GEMV_SHAPES[0]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, DTYPE)
    a = torch.randn(3, k, generator=g).to(DEVICE, DTYPE)
    out = torch.full((3, n), float("nan"), device=DEVICE, dtype=DTYPE)
    ops.gemv_residual(a, w, None, out, _lc("down", cfg), stage="down")
    assert _rel(out, a.double() @ w.double().T) < (2e-2 if GPU else 1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_w8a8_split_k_matches_quantized_oracle(variant: str) -> None:
    """o_proj / down split over K (``GemvConfig.split_k``: more programs for 64-row tiles) against the oracle, twice
    on one workspace (the counters zero again after each launch): ``mrow_w8a8``'s splits all take the rows' scales
    from all of K, ``mrow_w8a8b``'s blocks are the splits' K blocks."""
    g = _gen(80)
    split = 3 if not GPU else 2
    bn, bk, nw, ns = (16, 32, 4, 3) if not GPU else (64, 256, 4, 3)
    cfg = ops.GemvConfig(variant, bn, bk, nw, ns, split_k=split)
    n, k = (40, split * bk * 2) if not GPU else (4096, 14336)
    assert ops.split_k_of(cfg, k) == split
    w, scale, wd = _fp8_weight(n, k, g)
    part = torch.full((split * 8 * n,), float("nan"), device=DEVICE)
    counts = torch.zeros(-(-n // bn), device=DEVICE, dtype=torch.int32)
    for rows in (8, 3) if not GPU else (8, 8):  # (a GPU: one compile)
        a = (torch.randn(rows, k, generator=g) * torch.logspace(0, 4, rows)[:, None]).to(DEVICE, DTYPE)
        res = torch.randn(rows, n, generator=g).to(DEVICE, DTYPE)
        out = torch.full((rows, n), float("nan"), device=DEVICE, dtype=DTYPE)
        ops.gemv_residual(a, w, res, out, _lc("down", cfg), stage="down", scale=scale, split_ws=(part, counts))
        for row in range(rows):  # rows of 1 .. 1e4: each on its own (the residual is noise for the large ones)
            _check(out[row].double() - res[row].double(), quantized_rows(a, _group(cfg, k))[row] @ wd.T,
                   a[row].double() @ wd.T)
        assert int(counts.abs().sum()) == 0
