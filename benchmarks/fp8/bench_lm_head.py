"""The LM head at decode, bf16 cuBLAS against the FP8 head (`--quantize-lm-head`, issue 33; CUDA GPU only).

Shapes (K x N = hidden x vocab): Llama-3-8B 4096 x 128256, Mixtral-8x7B 4096 x 32000, SmolLM2-135M 576 x 49152. Per
shape and rows M (decode batch; 1, 2, 4, 8, 16 run lmserver's FP8 GEMV, more rows `Fp8Linear`'s `_scaled_mm` path with
the per-token activation quantizer, as the server's head runs them):

- check: the FP8 head against its dequantized weights in float64 (the tolerances of check_fp8_gpu.py: bf16 output
  rounding at <= 16 rows, per-token FP8 activations above);
- time (`triton.testing.do_bench` medians of CUDA-graph replays, as decode runs them: no host time; L2 flushed; us):
  bf16 `F.linear` (cuBLAS), the FP8 head as served (the GEMV launch `config_for` chooses: `TUNED` entry or the
  default rule), and the memory floors (weight bytes / a 1 GiB copy's bandwidth). `--sweep` also times check_fp8_gpu.py's row-wise and tensor-core tiles at <= 16 rows and prints
  the best per shape and M as `lmserver.kernels.fp8_gemv.TUNED` entries.

    python benchmarks/fp8/bench_lm_head.py [--rows 1 2 4 8 16 32] [--sweep] [--json out.json]

The exit status is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from check_fp8_gpu import DOT_SWEEP, ROWS_SWEEP, SCALED_MM_TOL, bench, copy_bandwidth, rel_error

HEADS = {"llama3-8b": (4096, 128256), "mixtral-8x7b": (4096, 32000), "smollm2-135m": (576, 49152)}  # (K, N)
GEMV_TOL = 1e-2  # bf16 output rounding over float32 sums


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """`fn` captured in a CUDA graph (after warm-up calls on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run(rows: list[int], sweep: bool, seed: int) -> tuple[list[dict[str, Any]], bool]:
    from torch import nn

    from lmserver.kernels.fp8_gemv import ROWS_MAX_M, Fp8GemvConfig, config_for, fp8_gemv
    from lmserver.kernels.fp8_ref import fp8_linear_ref
    from lmserver.layers.fp8_linear import GEMV_MAX_M, Fp8Linear

    gen = torch.Generator("cuda").manual_seed(seed)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e6:.2f} TB/s (floors: weight bytes / this)\n")
    print("| head | K x N | M | path | bf16 us | fp8 us | bf16 / fp8 | fp8 % of its floor | rel err | best tile |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    out, ok = [], True
    for name, (k, n) in HEADS.items():
        dense = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():  # rows of different magnitudes, as a trained head's (per-row scales differ)
            dense.weight.copy_(torch.randn(n, k, generator=gen, device="cuda")
                               * torch.logspace(-1, 0.5, n, device="cuda")[:, None] * 0.02)
        head = Fp8Linear.from_linear(dense, None)
        head.use_path("triton")
        w = dense.weight
        for m in rows:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16) * 3
            ref = fp8_linear_ref(x, head.weight, head.weight_scale, k, None, compute_dtype=torch.float64)
            err = rel_error(head(x), ref)
            gemv = m <= GEMV_MAX_M
            tol = GEMV_TOL if gemv or not head.scaled_mm else SCALED_MM_TOL
            ok &= err < tol
            t_bf16 = bench(graphed(lambda: F.linear(x, w)))  # noqa: B023
            t_fp8 = bench(graphed(lambda: head(x)))  # noqa: B023
            best = ""
            if sweep and gemv:
                cfgs = [Fp8GemvConfig(*c) for c in (ROWS_SWEEP if m <= ROWS_MAX_M else []) + DOT_SWEEP]
                times = []
                for c in cfgs:
                    try:
                        times.append(bench(graphed(lambda c=c: fp8_gemv(x, head.weight, head.weight_scale, k,  # noqa: B023
                                                                         config=c))))
                    except Exception as exc:  # noqa: BLE001 - a tile that does not compile is left out of the sweep
                        print(f"    sweep {c}: {type(exc).__name__}: {str(exc)[:120]}")
                        times.append(float("inf"))
                c = cfgs[times.index(min(times))]
                best = f"{c.variant} {c.block_n}/{c.block_k}/w{c.num_warps}/s{c.num_stages} {min(times):.1f} us"
                print(f'    TUNED: ("{torch.cuda.get_device_name()}", {m}, {k}, {n}): Fp8GemvConfig("{c.variant}", '
                      f'{c.block_n}, {c.block_k}, {c.num_warps}, {c.num_stages}),  # {min(times):.1f} us')
            path = (f"gemv {config_for(m, k, n, x.device).variant}" if gemv
                    else "_scaled_mm" if head.scaled_mm else "dequantize")
            floor = k * n / bw  # FP8 bytes; bf16's is twice
            row = {"head": name, "K": k, "N": n, "M": m, "path": path, "bf16_us": t_bf16, "fp8_us": t_fp8,
                   "fp8_floor_us": floor, "bf16_floor_us": 2 * floor, "rel_err": err, "tol": tol, "best": best}
            out.append(row)
            print(f"| {name} | {k}x{n} | {m} | {path} | {t_bf16:.1f} | {t_fp8:.1f} | {t_bf16 / t_fp8:.2f}x | "
                  f"{100 * floor / t_fp8:.0f}% | {err:.1e}{'' if err < tol else ' FAIL'} | {best} |", flush=True)
    return out, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--sweep", action="store_true", help="also time GEMV tiles at <= 16 rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_lm_head.py needs a CUDA GPU")
        return 2
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    rows, ok = run(args.rows, args.sweep, args.seed)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "args": vars(args), "ok": ok,
                                               "rows": rows}, indent=1))
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
