"""The per-token FP8 activation quantizers of the `_scaled_mm` prefill, old vs new (issue 33; CUDA GPU only).

At M = 4096 rows (a 4k-token prefill, Llama-3-8B widths), each case checked against the torch reference first:

- down_proj's input: `silu_and_mul` then `quantize_fp8_per_token` (two launches; the quantizer with the old
  one-pass launch, 16,384-column tile and 16 warps, and with the launch `quant_launch` chooses now) vs the fused
  `silu_and_mul_quantize_fp8` (one launch); then the whole step with the `_scaled_mm` GEMM (14336 x 4096).
- qkv's / gate_up's input: `fused_add_rmsnorm` then `quantize_fp8_per_token` (two launches) vs the fused
  `rmsnorm_quantize_fp8` (one launch: residual add, RMSNorm and the quantizer), hidden 4096.
- the standalone quantizer at K = 4096 (o_proj's input) and K = 14336: old launch vs chosen.

`--sweep` also times every `QuantLaunch` of SWEEP (each checked to give the chosen launch's bytes) and prints the
best per case. Times: `triton.testing.do_bench` medians (L2 flushed), µs; GB/s = bytes read and written / time.

    PYTHONPATH=packages/server/src python3 benchmarks/fp8/bench_quant_kernels.py [--sweep] [--json out.json]

The exit status is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable

import torch
import triton

from lmserver.kernels.activation import silu_and_mul
from lmserver.kernels.fp8_quant import (
    QuantLaunch,
    quant_launch,
    quantize_fp8_per_token,
    rmsnorm_quantize_fp8,
    silu_and_mul_quantize_fp8,
)
from lmserver.kernels.fp8_ref import quantize_fp8
from lmserver.kernels.fp8_ref import quantize_fp8_per_token as reference
from lmserver.kernels.norm import fused_add_rmsnorm
from lmserver.kernels.reference import fused_add_rmsnorm_ref, silu_and_mul_ref

ACT = torch.bfloat16
OLD_WIDE = QuantLaunch(16384, 16)  # the launch of 14,336-wide rows before the fused kernel: one 16k tile, 16 warps
# 4 to 64 columns per thread; two passes with and without the L2 eviction hints
SWEEP = [QuantLaunch(b, w, h) for b in (1024, 2048, 4096, 8192, 16384) for w in (2, 4, 8, 16, 32)
         for h in (True, False) if 128 <= b // w <= 2048]


def sweep_for(k: int) -> list[QuantLaunch]:
    """SWEEP's launches for rows of k values (one-pass ones once, none past twice the padded row)."""
    return [c for c in SWEEP if c.block_k <= 2 * triton.next_power_of_2(k) and (c.l2_hints or c.block_k < k)]


def bench(fn: Callable[[], object]) -> float:
    return 1e3 * float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def old_launch(k: int) -> QuantLaunch:
    """The quantizer's launch before (one pass: the padded row, 512 columns per warp, 1-16 warps)."""
    block = triton.next_power_of_2(k)
    return QuantLaunch(block, max(1, min(16, block // 512)))


def close_to_reference(q: torch.Tensor, scale: torch.Tensor, act: torch.Tensor) -> bool:
    """Scales within one bf16 ulp of torch's, every byte torch's or one e4m3 step from it, on at most 1e-3 of them
    (Triton's SiLU may round an activation one bf16 ulp off torch's; the plain quantizer: all equal on the H200)."""
    q_ref, s_ref = reference(act)
    codes = (q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs()
    scale_err = float(((scale - s_ref).abs() / s_ref).max())
    differ = float((codes > 0).double().mean())
    print(f"scale rel err {scale_err:.1e}, bytes one step off {differ:.1e}, largest step {int(codes.max())}")
    return scale_err <= 2.0**-7 and int(codes.max()) <= 1 and differ <= 1e-3


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[1], b[1]) and torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))


class Report:
    """Checks passed so far, the timed rows and the best sweep launch per case."""

    def __init__(self) -> None:
        self.ok = True
        self.rows: list[dict[str, object]] = []
        self.best: dict[str, tuple[float, QuantLaunch]] = {}

    def check(self, good: bool, name: str) -> None:
        self.ok &= good
        print(f"{'PASS' if good else 'FAIL'} {name}", flush=True)

    def time(self, case: str, variant: str, fn: Callable[[], object], nbytes: int,
             launch: QuantLaunch | None = None) -> None:
        us = bench(fn)
        self.rows.append({"case": case, "variant": variant, "us": us, "GBps": nbytes / us / 1e3})
        print(f"| {case} | {variant} | {us:.1f} | {nbytes / us / 1e3:.0f} |", flush=True)
        if launch is not None and us < self.best.get(case, (float("inf"), launch))[0]:
            self.best[case] = (us, launch)


def graded(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(m, k) bf16 rows of magnitudes 1e-2 to 1e1."""
    return (torch.randn(m, k, generator=gen, device="cuda") * torch.logspace(-2, 1, m, device="cuda")[:, None]).to(ACT)


def down_input(r: Report, m: int, h: int, d: int, sweep: bool, gen: torch.Generator) -> None:
    """down_proj's input: two launches (old, chosen quantizer launch) vs the fused one, alone and with the GEMM."""
    gate_up = graded(m, 2 * d, gen)
    act = silu_and_mul(gate_up)
    fused = silu_and_mul_quantize_fp8(gate_up)
    r.check(close_to_reference(*fused, silu_and_mul_ref(gate_up)), "fused SiLU-and-mul + quantizer vs torch")
    for launch in (OLD_WIDE, None):
        r.check(same(fused, quantize_fp8_per_token(act, launch)),
                f"fused == silu_and_mul + quantizer ({launch or 'chosen launch'})")
    weight, wscale = quantize_fp8(torch.randn(h, d, generator=gen, device="cuda").to(ACT) * 0.02, None)
    wt, srow = weight.t(), wscale.view(1, -1).contiguous()

    def gemm(xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(xq, wt, scale_a=xs, scale_b=srow, out_dtype=ACT, use_fast_accum=True)

    fused_bytes, act_bytes, q_bytes = m * 2 * d * 2 + m * d + 4 * m, m * d * 2, m * d + 4 * m
    print("\n| case | variant | us | GB/s |\n|---|---|---|---|")
    r.time("down input", "silu_and_mul", lambda: silu_and_mul(gate_up), m * 2 * d * 2 + act_bytes)
    r.time("down input", f"quantizer old {OLD_WIDE}", lambda: quantize_fp8_per_token(act, OLD_WIDE),
           act_bytes + q_bytes)
    r.time("down input", f"quantizer chosen {quant_launch(d)}", lambda: quantize_fp8_per_token(act),
           act_bytes + q_bytes)
    r.time("down input", "silu_and_mul + quantizer old",
           lambda: quantize_fp8_per_token(silu_and_mul(gate_up), OLD_WIDE), fused_bytes + 2 * act_bytes)
    r.time("down input", f"fused chosen {quant_launch(d, gated=True)}", lambda: silu_and_mul_quantize_fp8(gate_up), fused_bytes)
    r.time("down step", "silu_and_mul + quantizer old + _scaled_mm",
           lambda: gemm(*quantize_fp8_per_token(silu_and_mul(gate_up), OLD_WIDE)), fused_bytes + 2 * act_bytes)
    r.time("down step", "fused + _scaled_mm", lambda: gemm(*silu_and_mul_quantize_fp8(gate_up)), fused_bytes)
    for launch in sweep_for(d) if sweep else []:
        if same(silu_and_mul_quantize_fp8(gate_up, launch), fused):
            r.time("fused sweep", str(launch), functools.partial(silu_and_mul_quantize_fp8, gate_up, launch),
                   fused_bytes, launch)
        else:
            r.check(False, f"fused {launch}: the chosen launch's bytes")


def norm_input(r: Report, m: int, h: int, gen: torch.Generator) -> None:
    """qkv's / gate_up's input: fused_add_rmsnorm + quantizer (two launches) vs the fused norm + quantizer."""
    x, residual = graded(m, h, gen), graded(m, h, gen).flip(0).contiguous()
    weight = (torch.rand(h, generator=gen, device="cuda") + 0.5).to(ACT)
    normed, summed = fused_add_rmsnorm_ref(x, residual, weight, 1e-5)
    res = residual.clone()
    fused = rmsnorm_quantize_fp8(x, weight, 1e-5, res)
    r.check(torch.equal(res, summed), "fused norm + quantizer: the residual sum")
    r.check(close_to_reference(*fused, normed), "fused norm + quantizer vs torch")
    out, res = x.clone(), residual.clone()
    fused_add_rmsnorm(out, res, weight, 1e-5)
    r.check(same(fused, quantize_fp8_per_token(out)), "fused == fused_add_rmsnorm + quantizer")
    xs, rs = x.clone(), residual.clone()  # the timed calls add into rs again and again: the bytes are the same

    def two() -> object:
        fused_add_rmsnorm(xs, rs, weight, 1e-5)
        return quantize_fp8_per_token(xs)

    r.time("norm input", "fused_add_rmsnorm", lambda: fused_add_rmsnorm(xs, rs, weight, 1e-5), 4 * m * h * 2)
    r.time("norm input", "fused_add_rmsnorm + quantizer", two, 4 * m * h * 2 + m * h * 3 + 4 * m)
    r.time("norm input", "fused", lambda: rmsnorm_quantize_fp8(x, weight, 1e-5, rs), 3 * m * h * 2 + m * h + 4 * m)


def quantizer(r: Report, m: int, k: int, sweep: bool, gen: torch.Generator) -> None:
    """The standalone quantizer at width k: the old launch, the chosen one and (sweep) the others."""
    x = graded(m, k, gen)
    chosen = quantize_fp8_per_token(x)
    r.check(close_to_reference(*chosen, x), f"quantizer K={k} vs torch")
    for launch in dict.fromkeys([old_launch(k), quant_launch(k)] + (sweep_for(k) if sweep else [])):
        if not same(quantize_fp8_per_token(x, launch), chosen):
            r.check(False, f"quantizer K={k} {launch}: the chosen launch's bytes")
            continue
        tag = "old" if launch == old_launch(k) else "chosen" if launch == quant_launch(k) else "sweep"
        r.time(f"quantizer K={k}", f"{tag} {launch}", functools.partial(quantize_fp8_per_token, x, launch),
               m * k * 3 + 4 * m, launch)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=4096, help="rows (prompt tokens)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--launches", default="", help="with --sweep: these launches instead of SWEEP, "
                    "BLOCK_K:WARPS:HINTS,... (HINTS 0 / 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.launches:  # NOTE: module state of this script only (sweep_for reads SWEEP)
        SWEEP[:] = [QuantLaunch(*(int(v) for v in item.split(":")[:2]), bool(int(item.split(":")[2])))
                    for item in args.launches.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    print(torch.cuda.get_device_name(), f"M={args.m} hidden={args.hidden} inter={args.inter}")
    r = Report()
    down_input(r, args.m, args.hidden, args.inter, args.sweep, gen)
    norm_input(r, args.m, args.hidden, gen)
    for k in (args.hidden, args.inter):  # qkv, o_proj, gate_up inputs; a row as wide as down's input
        quantizer(r, args.m, k, args.sweep, gen)
    for case, (us, launch) in r.best.items():
        print(f"best {case}: {launch} {us:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "ok": r.ok, "rows": r.rows,
                       "best": {c: [us, lc.block_k, lc.num_warps, lc.l2_hints] for c, (us, lc) in r.best.items()}}, f, indent=1)
    print("all checks passed" if r.ok else "SOME CHECKS FAILED")
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
