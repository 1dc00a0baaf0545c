"""FP8 on a CUDA GPU: every FP8 kernel against its dequantized float32 / float64 reference on fresh
random inputs, then FP8 GEMV vs bf16 GEMV timings at the Llama-3-8B decode shapes (issue 33).

    python benchmarks/fp8/check_fp8_gpu.py [--seed N] [--sweep] [--json out.json]

Checks (each prints PASS / FAIL with its relative error; the exit status is 1 when one fails):
- `fp8_gemv` (Triton; the chosen, the row-wise and the tensor-core kernel) at M = 1, 3, 8, 16 on
  the 8B shapes, per-channel and 128-column group scales, with a bias, and on strided rows;
- `Fp8Linear` forward on each path (the GEMV up to 16 rows; `torch._scaled_mm` or dequantize for
  a 512-row prefill), against the float64 dequantized linear (the `_scaled_mm` path quantizes
  activations per token, so its tolerance is wider);
- decode attention (1 and 8 splits) and extend attention reading an FP8 KV cache with scales;
- the Triton attention backend over an FP8 KV pool against torch_native (prefill chunks + decode).

Timings (`triton.testing.do_bench`, median, L2 flushed): y = x @ W.T for M = 1, 2, 4, 8, 16 at
4096x6144 (qkv), 4096x4096 (o), 4096x28672 (gate-up), 14336x4096 (down) (K x N), bf16 `F.linear`
(cuBLAS) vs the FP8 GEMV (the launch `config_for` chooses), and the FP8 memory floor (weight bytes
/ a 1 GiB copy's bandwidth). `--sweep` also times row-wise and tensor-core tile configurations and
prints the best per shape and M as entries for `lmserver.kernels.fp8_gemv.TUNED`.
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

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
DEVICE = "cuda"
ACT = torch.bfloat16  # activation dtype
ATTN: dict[str, Any] = {  # Llama-3-8B heads; lengths up to 4k tokens
    "shape": (32, 8, 128), "decode_seq_lens": [1, 17, 300, 4096, 513, 64, 2, 1000],
    "extend_prefix_lens": [0, 700, 33, 4000], "extend_lens": [300, 90, 1000, 64],
    "backend_chunks": [[300, 90, 7], [64, 1, 500]],
}
BF16_TOL = 1e-2  # bf16 output rounding over an fp32 accumulation
SCALED_MM_TOL = 6e-2  # + per-token FP8 activations


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.rows: list[dict[str, Any]] = []

    def check(self, name: str, err: float, tol: float) -> None:
        ok = err < tol
        print(f"{'PASS' if ok else 'FAIL'}  {name}: rel err {err:.2e} (tol {tol:.0e})", flush=True)
        self.rows.append({"check": name, "rel_err": err, "tol": tol, "ok": ok})
        if not ok:
            self.failed.append(name)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = out.double() - ref.double()
    if not torch.isfinite(diff).all():
        return float("inf")
    return float(diff.norm() / ref.double().norm().clamp_min(1e-30))


def check_gemv(c: Checks, gen: torch.Generator) -> None:
    from lmserver.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv
    from lmserver.kernels.fp8_ref import fp8_linear_ref, quantize_fp8

    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, generator=gen, device=DEVICE)
        for group in (None, 128):
            weight, scale = quantize_fp8(w, group)
            group_k = k if group is None else group
            bias = torch.randn(n, generator=gen, device=DEVICE).to(ACT)
            for m in (1, 3, 8, 16):
                x = torch.randn(m, k, generator=gen, device=DEVICE).to(ACT)
                ref = fp8_linear_ref(x, weight, scale, group_k, bias, compute_dtype=torch.float64)
                for variant, cfg in (("auto", None), ("rows", Fp8GemvConfig("rows", 4, 2048, 8, 1)),
                                     ("dot", Fp8GemvConfig("dot", 32, 512, 4, 4))):
                    if variant == "rows" and m > 8:
                        continue
                    out = fp8_gemv(x, weight, scale, group_k, bias, config=cfg)
                    c.check(f"fp8_gemv {variant} {name} {k}x{n} M={m} {'g128' if group else 'per-channel'}",
                            rel_error(out, ref), BF16_TOL)
            wide = torch.randn(8, 2 * k, generator=gen, device=DEVICE).to(ACT)
            ref = fp8_linear_ref(wide[:, :k], weight, scale, group_k, None, compute_dtype=torch.float64)
            c.check(f"fp8_gemv {name} strided rows {'g128' if group else 'per-channel'}",
                    rel_error(fp8_gemv(wide[:, :k], weight, scale, group_k), ref), BF16_TOL)


def check_quantizer(c: Checks, gen: torch.Generator) -> None:
    from lmserver.kernels.fp8_quant import quantize_fp8_per_token
    from lmserver.kernels.fp8_ref import quantize_fp8_per_token as reference

    x = torch.randn(777, 14336, generator=gen, device=DEVICE).to(ACT) * 3
    (q, s), (q_ref, s_ref) = quantize_fp8_per_token(x), reference(x)
    # the fraction of FP8 bytes that differ from torch's (each at most the neighbouring e4m3 value), scales equal
    codes = (q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs()
    differ = float((codes > 0).double().mean()) if torch.equal(s, s_ref) and int(codes.max()) <= 1 else float("inf")
    c.check("per-token FP8 quantizer (Triton) vs torch: fraction of bytes one e4m3 step apart", differ, 1e-3)


def check_linear_paths(c: Checks, gen: torch.Generator) -> None:
    from lmserver.kernels.fp8_ref import fp8_linear_ref
    from lmserver.layers.fp8_linear import Fp8Linear

    for group in (None, 128):
        k, n = SHAPES["qkv"]
        dense = torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=ACT)
        with torch.no_grad():
            dense.weight.copy_(torch.randn(n, k, generator=gen, device=DEVICE))
        layer = Fp8Linear.from_linear(dense, group)
        layer.use_path("triton")
        tag = "g128" if group else "per-channel"
        for m in (1, 8, 16, 512):
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(ACT)
            ref = fp8_linear_ref(x, layer.weight, layer.weight_scale, layer.group_k, compute_dtype=torch.float64)
            path = "gemv" if m <= 16 else ("_scaled_mm" if layer.scaled_mm else "dequantize")
            tol = SCALED_MM_TOL if path == "_scaled_mm" else BF16_TOL
            c.check(f"Fp8Linear {tag} M={m} ({path})", rel_error(layer(x), ref), tol)


def check_attention(c: Checks, cpu_gen: torch.Generator) -> None:
    from lmserver.kernels import reference as ref
    from lmserver.kernels.decode_attention import decode_attention
    from lmserver.kernels.extend_attention import extend_attention
    from lmserver.kernels.fp8_ref import FP8_DTYPE, quantize_kv_fp8
    from lmserver.kernels.testing import random_paged_batch
    from lmserver.runner.attention.testing import compare_backends
    from lmserver.runner.attention.torch_native import TorchNativeBackend
    from lmserver.runner.attention.triton_backend import TritonBackend

    heads, kv_heads, dim = ATTN["shape"]
    k_scale, v_scale = 0.05, 0.02
    seq = ATTN["decode_seq_lens"]
    b = random_paged_batch([s - 1 for s in seq], [1] * len(seq), heads, kv_heads, dim, ACT, DEVICE, cpu_gen)
    k8, v8 = quantize_kv_fp8(b.k_cache * 3, k_scale), quantize_kv_fp8(b.v_cache, v_scale)
    k_ref, v_ref = k8.double() * k_scale, v8.double() * v_scale
    want = ref.decode_attention_ref(b.q, k_ref, v_ref, b.req_to_token, b.req_pool_indices, b.seq_lens, dim**-0.5)
    for splits in (1, 8):
        out = decode_attention(b.q, k8, v8, b.req_to_token, b.req_pool_indices, b.seq_lens, dim**-0.5,
                               num_kv_splits=splits, k_scale=k_scale, v_scale=v_scale)
        c.check(f"decode_attention FP8 KV splits={splits}", rel_error(out, want), 1.6e-2)
    prefix, ext = ATTN["extend_prefix_lens"], ATTN["extend_lens"]
    b = random_paged_batch(prefix, ext, heads, kv_heads, dim, ACT, DEVICE, cpu_gen)
    k8, v8 = quantize_kv_fp8(b.k_cache, k_scale), quantize_kv_fp8(b.v_cache, v_scale)
    want = ref.extend_attention_ref(b.q, b.k_extend, b.v_extend, k8.double() * k_scale, v8.double() * v_scale,
                                    b.req_to_token, b.req_pool_indices, b.prefix_lens, b.extend_lens,
                                    b.extend_start_loc, dim**-0.5)
    out = extend_attention(b.q, b.k_extend, b.v_extend, k8, v8, b.req_to_token, b.req_pool_indices, b.prefix_lens,
                           b.extend_lens, b.extend_start_loc, dim**-0.5, max(ext), k_scale=k_scale, v_scale=v_scale)
    c.check("extend_attention FP8 KV prefix", rel_error(out, want), 1.6e-2)
    try:
        compare_backends(TorchNativeBackend, TritonBackend, device=DEVICE, shape=ATTN["shape"], dtype=ACT,
                         num_slots=4096, width=1024, chunks=ATTN["backend_chunks"], decode_steps=4, tol=1.6e-2,
                         kv_cache_dtype=FP8_DTYPE)
        c.check("triton backend vs torch_native, FP8 KV pool", 0.0, 1.0)
    except AssertionError as exc:
        print(f"      {exc}")
        c.check("triton backend vs torch_native, FP8 KV pool", float("inf"), 1.0)


def bench(fn: Callable[[], Any]) -> float:
    """Median microseconds of `fn` (triton.testing.do_bench flushes L2 between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")) * 1e3


def copy_bandwidth() -> float:
    """Device-memory bytes per microsecond of a large copy (read + write): the floor's bandwidth."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    return 2 * a.numel() / bench(lambda: b.copy_(a))


ROWS_SWEEP = [("rows", bn, bk, nw, 1) for bn, bk, nw in
              ((2, 1024, 4), (4, 1024, 4), (4, 2048, 8), (4, 4096, 8), (8, 2048, 8), (8, 1024, 4), (16, 512, 4),
               (8, 4096, 8), (16, 1024, 8), (16, 2048, 8), (32, 512, 8), (8, 1024, 8), (16, 1024, 4))]
DOT_SWEEP = [("dot", bn, bk, 4, ns) for bn, bk, ns in
             ((16, 256, 4), (16, 512, 4), (32, 256, 4), (32, 512, 4), (64, 256, 3), (32, 1024, 3), (16, 1024, 3),
              (64, 256, 4), (64, 512, 3), (128, 256, 3), (32, 256, 5), (16, 256, 6))]


def time_prefill(gen: torch.Generator, m: int = 4096) -> list[dict[str, Any]]:
    """Prefill GEMMs at M rows: bf16 cuBLAS vs `torch._scaled_mm` (row-wise scales, with and without
    fast accumulation) and the per-token activation quantizer, each error against float64."""
    from lmserver.kernels.fp8_quant import quantize_fp8_per_token
    from lmserver.kernels.fp8_ref import fp8_linear_ref, quantize_fp8

    rows = []
    print("\n| shape | K x N | M | bf16 us | quantize us | _scaled_mm us | fast-accum us | fp8 total (fast) / bf16 "
          "speed | rel err accurate / fast |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, generator=gen, device=DEVICE).to(ACT)
        weight, scale = quantize_fp8(w, None)
        x = torch.randn(m, k, generator=gen, device=DEVICE).to(ACT)
        srow = scale.view(1, -1).contiguous()
        xq, xs = quantize_fp8_per_token(x)

        def mm(fast: bool) -> torch.Tensor:
            return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=srow, out_dtype=ACT,  # noqa: B023
                                    use_fast_accum=fast)

        t_bf16 = bench(lambda: F.linear(x, w))  # noqa: B023
        t_q = bench(lambda: quantize_fp8_per_token(x))  # noqa: B023
        t_mm, t_fast = bench(lambda: mm(False)), bench(lambda: mm(True))  # noqa: B023
        ref = fp8_linear_ref(x, weight, scale, k, compute_dtype=torch.float64)
        e_acc, e_fast = rel_error(mm(False), ref), rel_error(mm(True), ref)
        row = {"shape": name, "K": k, "N": n, "M": m, "bf16_us": t_bf16, "quant_us": t_q, "scaled_mm_us": t_mm,
               "scaled_mm_fast_us": t_fast, "speedup_fast": t_bf16 / (t_q + t_fast), "err": e_acc, "err_fast": e_fast}
        rows.append(row)
        print(f"| {name} | {k}x{n} | {m} | {t_bf16:.1f} | {t_q:.1f} | {t_mm:.1f} | {t_fast:.1f} | "
              f"{row['speedup_fast']:.2f}x | {e_acc:.1e} / {e_fast:.1e} |", flush=True)
    return rows


def time_gemv(sweep: bool, gen: torch.Generator) -> list[dict[str, Any]]:
    from lmserver.kernels.fp8_gemv import ROWS_MAX_M, Fp8GemvConfig, config_for, fp8_gemv
    from lmserver.kernels.fp8_ref import quantize_fp8

    bw = copy_bandwidth()
    print(f"\ncopy bandwidth {bw / 1e6:.2f} TB/s (the floor: weight bytes / this)")
    rows = []
    print("\n| shape | K x N | M | bf16 us | fp8 us (chosen) | fp8 us (best) | speedup | fp8 % of floor | best config |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, generator=gen, device=DEVICE).to(ACT)
        weight, scale = quantize_fp8(w, None)
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(ACT)
            t_bf16 = bench(lambda: F.linear(x, w))  # noqa: B023
            chosen = config_for(m, k, n, x.device)
            configs = [chosen]
            if sweep:
                configs += [Fp8GemvConfig(*c) for c in (ROWS_SWEEP if m <= ROWS_MAX_M else []) + DOT_SWEEP]
            times = [bench(lambda cfg=cfg: fp8_gemv(x, weight, scale, k, config=cfg)) for cfg in configs]  # noqa: B023
            t_best = min(times)
            cfg = configs[times.index(t_best)]
            floor_us = k * n / bw
            row = {"shape": name, "K": k, "N": n, "M": m, "bf16_us": t_bf16, "fp8_us": times[0], "fp8_best_us": t_best,
                   "speedup": t_bf16 / t_best, "floor_us": floor_us, "pct_floor": floor_us / t_best,
                   "config": vars(cfg), "chosen": vars(chosen)}
            rows.append(row)
            print(f"| {name} | {k}x{n} | {m} | {t_bf16:.1f} | {times[0]:.1f} | {t_best:.1f} | {row['speedup']:.2f}x | "
                  f"{100 * row['pct_floor']:.0f}% | {cfg.variant} {cfg.block_n}/{cfg.block_k}/w{cfg.num_warps}/"
                  f"s{cfg.num_stages} |", flush=True)
    if sweep:  # entries for lmserver.kernels.fp8_gemv.TUNED
        dev = torch.cuda.get_device_name()
        print("\nTUNED entries:")
        for r in rows:
            c = r["config"]
            print(f'    ("{dev}", {r["M"]}, {r["K"]}, {r["N"]}): Fp8GemvConfig("{c["variant"]}", {c["block_n"]}, '
                  f'{c["block_k"]}, {c["num_warps"]}, {c["num_stages"]}),')
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="default: fresh inputs (a random seed, printed)")
    parser.add_argument("--sweep", action="store_true", help="also time GEMV tile configurations")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_fp8_gpu.py needs a CUDA GPU (none is visible)")
        return 2
    from lmserver.layers.fp8_linear import fp8_unsupported_reason

    why = fp8_unsupported_reason("cuda")
    if why is not None:
        print(why)
        return 2
    seed = args.seed if args.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"{torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), torch "
          f"{torch.__version__}, seed {seed}\n")
    gen = torch.Generator(DEVICE).manual_seed(seed)
    c = Checks()
    check_gemv(c, gen)
    check_quantizer(c, gen)
    check_linear_paths(c, gen)
    check_attention(c, torch.Generator().manual_seed(seed))
    timings = time_gemv(args.sweep, gen)
    prefill = time_prefill(gen)
    print(f"\n{len(c.rows) - len(c.failed)} of {len(c.rows)} checks passed"
          + (f"; FAILED: {', '.join(c.failed)}" if c.failed else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": seed, "checks": c.rows, "timings": timings, "prefill": prefill}, indent=2))
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
