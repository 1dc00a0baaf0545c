"""The prefill GEMMs of one 8B layer, bf16 against `_scaled_mm` FP8 scale layouts (issue 33; CUDA GPU only).

At M = `--rows` tokens (a 4k-token prefill) and Llama-3-8B's four projections (qkv 6144 x 4096, o_proj 4096 x 4096,
gate-up 28672 x 4096, down 4096 x 14336), each timed with `triton.testing.do_bench` (median, L2 flushed, µs):

- `bf16`: `x @ w.T` on bf16 weights (cuBLAS);
- `fp8 rowwise`: what `Fp8Linear` runs: per-token activation scales (M, 1), per-channel weight scales (1, N), fast
  accumulation;
- `fp8 tensor`: one scale each (per-tensor), fast accumulation: cuBLASLt's other scaling mode, to see whether the
  outer-vector scaling costs kernel speed;
- `fp8 rowwise exact`: rowwise without fast accumulation.

Each FP8 result is checked against the float32 product of the dequantized operands first (relative Frobenius error).
TFLOP/s = 2 M N K / time. The table says what the 61% of the FP8 prefill layer spent in GEMMs could still give.

    python3 benchmarks/fp8/bench_prefill_gemm.py [--rows 4096] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import triton

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
E4M3 = torch.float8_e4m3fn


def bench(fn: Callable[[], object]) -> float:
    return 1e3 * float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 and its (rows, 1) float32 scales (amax / 448)."""
    scale = (t.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (t.float() / scale).clamp(-448, 448).to(E4M3), scale


def measure(name: str, n: int, k: int, m: int, gen: torch.Generator) -> dict[str, float | int | str]:
    """One projection's times (us) and relative errors."""
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x8, xs = quantize_rows(x)
    w8, ws = quantize_rows(w)
    xs_t = (x.float().abs().amax() / 448.0).reshape(())
    ws_t = (w.float().abs().amax() / 448.0).reshape(())
    x8t, w8t = (x.float() / xs_t).to(E4M3), (w.float() / ws_t).to(E4M3)
    ref = (x8.float() * xs) @ (w8.float() * ws).T
    ref_t = (x8t.float() * xs_t) @ (w8t.float() * ws_t).T

    def rowwise(fast: bool = True) -> torch.Tensor:
        return torch._scaled_mm(x8, w8.T, scale_a=xs, scale_b=ws.T, out_dtype=torch.bfloat16, use_fast_accum=fast)

    def tensor() -> torch.Tensor:
        return torch._scaled_mm(x8t, w8t.T, scale_a=xs_t, scale_b=ws_t, out_dtype=torch.bfloat16, use_fast_accum=True)

    err_r = float((rowwise().float() - ref).norm() / ref.norm())
    err_t = float((tensor().float() - ref_t).norm() / ref_t.norm())
    return dict(name=name, n=n, k=k, m=m, bf16_us=bench(lambda: x @ w.T), rowwise_us=bench(rowwise),
                tensor_us=bench(tensor), rowwise_exact_us=bench(lambda: rowwise(False)), err_rowwise=err_r,
                err_tensor=err_t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    print("| projection | N x K | bf16 us | fp8 rowwise us | fp8 tensor us | fp8 rowwise exact us | rowwise TFLOP/s "
          "| rel err rowwise / tensor |")
    print("|---|---|---|---|---|---|---|---|")
    cols = ["bf16_us", "rowwise_us", "tensor_us", "rowwise_exact_us"]
    out = []
    for name, (n, k) in SHAPES.items():
        r = measure(name, n, k, args.rows, gen)
        out.append(r)
        tflops = 2 * args.rows * n * k / float(r["rowwise_us"]) / 1e6
        print(f"| {name} | {n} x {k} | " + " | ".join(f"{float(r[c]):.1f}" for c in cols)
              + f" | {tflops:.0f} | {float(r['err_rowwise']):.1e} / {float(r['err_tensor']):.1e} |", flush=True)
    print("| layer | | " + " | ".join(f"{sum(float(r[c]) for r in out):.1f}" for c in cols) + " | | |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
