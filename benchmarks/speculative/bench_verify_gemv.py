"""GEMV kernels at the row counts of speculative verify steps, Llama-3-8B shapes, on a CUDA GPU (not collected by pytest).

For M = 1, 2, 4, 6, 8 rows and each projection of the 8B shape (qkv 4096->6144, o_proj 4096->4096, gate-up
4096->28672, down 14336->4096, LM head 4096->128256), side by side in one run:

- ``cublas``: ``torch.mm`` on the same matrices (plain projection, no norm or epilogue);
- ``rows``: lowlat's row-wise kernel with its tuned batch-1 config (the M = 1 kernel; at M > 1 its rows unrolled);
- ``dot``: lowlat's ``tl.dot`` kernel with the tuned batch-5..16 config (the batch-8 kernel of the verify steps);
- ``mrow`` / ``mrow_fma``: the multi-row kernels (``lowlat.kernels.mrow``), best of a config sweep at M = 8, its best
  three configs again at the other row counts.

lowlat's variants run the plugin's fused stage (qkv: norm + QKV + RoPE + KV write; gate-up: norm + gate-up + SiLU;
o_proj / down: + residual; the LM head: a plain projection, ``mrow`` only, else + a residual) as PDL-chained launches
over distinct weights in one CUDA graph (nothing from L2); every candidate is first checked against a float32 torch
reference. Prints us per launch, the ratio to the M = 1 kernel and to cuBLAS at the same M, and the best ``mrow``
configs per stage (for ``lowlat.kernels.tuning.TABLES``).

    python benchmarks/speculative/bench_verify_gemv.py [--budget-s 240] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lowlat"))
from bench_layer import LLAMA3_8B, gpu_layer, time_graph  # noqa: E402

from lowlat import KVCache, LayerShape  # noqa: E402
from lowlat.kernels import ops  # noqa: E402
from lowlat.reference import apply_rope, rms_norm  # noqa: E402
from lowlat.testing import decode_meta  # noqa: E402

G = ops.GemvConfig
MROW = [G("mrow", 16, 512, 4, 3), G("mrow", 16, 256, 4, 4), G("mrow", 16, 1024, 4, 2), G("mrow", 32, 256, 4, 4),
        G("mrow", 16, 512, 4, 4), G("mrow", 32, 512, 4, 3), G("mrow", 64, 256, 4, 3), G("mrow", 64, 128, 4, 4),
        G("mrow", 16, 512, 8, 3), G("mrow", 32, 512, 8, 3), G("mrow", 16, 1024, 4, 3), G("mrow", 128, 128, 8, 3)]
MROW_QKV = [G("mrow", 8, 512, 4, 3), G("mrow", 16, 256, 4, 4), G("mrow", 8, 1024, 4, 2), G("mrow", 16, 512, 4, 3),
            G("mrow", 4, 1024, 4, 3), G("mrow", 32, 256, 4, 3), G("mrow", 8, 512, 4, 4), G("mrow", 16, 512, 8, 3)]
FMA = [G("mrow_fma", 4, 256, 4, 2), G("mrow_fma", 8, 128, 4, 3), G("mrow_fma", 2, 512, 4, 2),
       G("mrow_fma", 4, 512, 8, 2), G("mrow_fma", 8, 256, 8, 2)]
STAGES = ("qkv", "o_proj", "gate_up", "down", "lm_head")
VOCAB = 128256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8,1,2,4,6", help="row counts, the sweep's first")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on the CPU (TRITON_INTERPRET=1): checks the script")
    args = ap.parse_args()
    t0 = time.time()
    dev, bf16, shape, vocab = torch.device("cuda"), torch.bfloat16, LLAMA3_8B, VOCAB
    timer = time_graph
    if args.cpu_smoke:
        dev, shape, vocab = torch.device("cpu"), LayerShape(64, 4, 2, 16, 96), 200
        MROW[:], MROW_QKV[:], FMA[:] = MROW[:1], MROW_QKV[:1], FMA[:1]

        def timer(fn: Any, iters: int) -> float:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
    torch.manual_seed(0)
    base = ops.LaunchConfig.for_device(dev, shape, use_pdl=True)
    plain = replace(base, tuned=())
    print(f"device={torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'} pdl={base.use_pdl}", flush=True)
    layers = [gpu_layer(shape, bf16, dev) for _ in range(2 if args.cpu_smoke else 16)]
    heads = [torch.randn(vocab, shape.hidden_size, device=dev, dtype=bf16) * shape.hidden_size**-0.5 for _ in range(3)]
    results: list[dict[str, Any]] = []
    top: dict[str, list[ops.GemvConfig]] = {}

    def bench(stage: str, m: int) -> None:
        c = 512
        slots = m * c + 64
        kvs = [KVCache(torch.zeros(slots, shape.num_kv_heads, shape.head_dim, device=dev, dtype=bf16),
                       torch.zeros(slots, shape.num_kv_heads, shape.head_dim, device=dev, dtype=bf16)) for _ in layers]
        meta = decode_meta([c] * m, slots, c, dev, generator=torch.Generator().manual_seed(m))
        meta = replace(meta, req_to_token=meta.req_to_token.contiguous())
        k_in = {"qkv": shape.hidden_size, "o_proj": shape.q_size, "gate_up": shape.hidden_size,
                "down": shape.intermediate_size, "lm_head": shape.hidden_size}[stage]
        a = torch.randn(m, k_in, device=dev, dtype=bf16) * (0.5 if stage == "down" else 1.0)
        mats = heads if stage == "lm_head" else [getattr(w, stage) for w in layers]
        n_out = mats[0].shape[0]
        out = torch.empty(m, n_out if stage != "gate_up" else shape.intermediate_size, device=dev, dtype=bf16)
        res = torch.randn(m, n_out, device=dev, dtype=bf16) if stage in ("o_proj", "down", "lm_head") else None
        q = torch.empty(m, shape.q_size, device=dev, dtype=bf16)
        mm_out = torch.empty(m, n_out, device=dev, dtype=bf16)
        wbytes = mats[0].numel() * 2

        def run(lc: ops.LaunchConfig, i: int, cfg: ops.GemvConfig) -> torch.Tensor:
            if stage == "qkv":
                ops.qkv_rope(a, layers[i], kvs[i], meta, q, shape, lc)
                return q
            if stage == "gate_up":
                ops.norm_gate_up(a, layers[i].post_norm, layers[i].gate_up, out, shape.rms_eps, lc)
                return out
            r = None if stage == "lm_head" and cfg.multi_row else res
            ops.gemv_residual(a, mats[i], r, out, lc, stage="down" if stage == "lm_head" else stage)
            return out

        def reference(cfg: ops.GemvConfig) -> torch.Tensor:
            w0 = layers[0]
            if stage == "qkv":
                rq = (rms_norm(a.float(), w0.input_norm.float(), shape.rms_eps) @ w0.qkv.float().T)[:, :shape.q_size]
                return apply_rope(rq.view(m, shape.num_heads, -1), meta.positions, w0.rope_inv_freq).reshape(m, -1)
            if stage == "gate_up":
                g, u = (rms_norm(a.float(), w0.post_norm.float(), shape.rms_eps) @ w0.gate_up.float().T).split(
                    shape.intermediate_size, -1)
                return torch.nn.functional.silu(g) * u
            ref = a.float() @ mats[0].float().T
            return ref if stage == "lm_head" and cfg.multi_row else ref + res.float()

        def timed(fn: Any) -> float:
            return timer(lambda: [fn(i) for i in range(len(mats))], args.iters) / len(mats)

        def record(variant: str, us: float, cfg: ops.GemvConfig | None = None, err: float = 0.0) -> None:
            results.append(dict(stage=stage, rows=m, variant=variant, us=us, gbs=wbytes / us / 1e3, err=err,
                                config=asdict(cfg) if cfg else None))

        record("cublas", timed(lambda i: torch.mm(a, mats[i].t(), out=mm_out)))
        lookup = "o_proj" if stage == "lm_head" else stage

        def try_cfg(variant: str, cfg: ops.GemvConfig) -> float | None:
            lc = replace(plain, tuned=((lookup if stage != "lm_head" else "down", 1 << 30, cfg),))
            try:
                got = run(lc, 0, cfg)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                ref = reference(cfg)
                err = float((got.float() - ref).norm() / ref.norm())
                if not err < 2e-2:
                    print(f"WRONG {stage} m={m} {cfg}: rel err {err:.2e}", flush=True)
                    return None
                us = timed(lambda i: run(lc, i, cfg))
            except Exception as exc:  # noqa: BLE001 - a config out of resources is skipped
                print(f"skip {stage} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                return None
            record(variant, us, cfg, err)
            return us

        try_cfg("rows", base.gemv_config(lookup, 1))
        if m > 1:
            try_cfg("dot", base.gemv_config(lookup, 16))
        first = m == int(args.rows.split(",")[0])
        cands = (MROW_QKV if stage == "qkv" else MROW) + FMA if first else top.get(stage, [])
        timed_cfgs = []
        for cfg in cands:
            if time.time() - t0 > args.budget_s:
                print(f"budget reached at {stage} m={m}", flush=True)
                break
            us = try_cfg(cfg.variant, cfg)
            if us is not None:
                timed_cfgs.append((us, cfg))
        if first:
            timed_cfgs.sort(key=lambda t: t[0])
            mr = [c for _, c in timed_cfgs if c.variant == "mrow"][:3]
            fm = [c for _, c in timed_cfgs if c.variant == "mrow_fma"][:1]
            top[stage] = mr + fm
        print(f"[{time.time() - t0:.0f}s] {stage} m={m} done", flush=True)

    stages = args.stages.split(",")
    for m in [int(v) for v in args.rows.split(",")]:
        for stage in stages:
            if time.time() - t0 > args.budget_s and m != 1:
                continue
            bench(stage, m)

    def best(stage: str, m: int, variant: str) -> dict[str, Any] | None:
        rs = [r for r in results if r["stage"] == stage and r["rows"] == m and r["variant"] == variant]
        return min(rs, key=lambda r: r["us"]) if rs else None

    print("\nus per launch (lowlat: fused stage, PDL-chained; cuBLAS: plain torch.mm); ratios to the M=1 row-wise "
          "kernel and to cuBLAS at the same M")
    print(f"{'stage':>8s} {'M':>2s} {'cublas':>7s} {'rows':>7s} {'dot':>7s} {'mrow':>7s} {'fma':>7s} "
          f"{'mrow/rows@1':>11s} {'mrow/cublas':>11s} {'GB/s':>5s}  mrow config")
    for stage in stages:
        r1 = best(stage, 1, "rows")
        for m in sorted({r["rows"] for r in results}):
            cells = {v: best(stage, m, v) for v in ("cublas", "rows", "dot", "mrow", "mrow_fma")}
            if cells["cublas"] is None:
                continue
            fmt = {v: f"{c['us']:7.2f}" if c else f"{'-':>7s}" for v, c in cells.items()}
            mr = cells["mrow"]
            ratio1 = f"{mr['us'] / r1['us']:11.2f}" if mr and r1 else f"{'-':>11s}"
            ratio2 = f"{mr['us'] / cells['cublas']['us']:11.2f}" if mr else f"{'-':>11s}"
            gbs = f"{mr['gbs']:5.0f}" if mr else "    -"
            cfg = tuple(mr["config"].values())[:5] if mr else ""
            print(f"{stage:>8s} {m:2d} {fmt['cublas']} {fmt['rows']} {fmt['dot']} {fmt['mrow']} {fmt['mrow_fma']} "
                  f"{ratio1} {ratio2} {gbs}  {cfg}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "elapsed_s": time.time() - t0}, f, indent=1)


if __name__ == "__main__":
    main()
