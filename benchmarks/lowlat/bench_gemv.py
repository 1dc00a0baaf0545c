"""Per-stage sweep of the ``nvidia`` plugin's decode-layer kernels on a CUDA GPU (never collected by pytest).

Each stage of a Llama-style layer (`--shape`: Llama-3-8B or SmolLM2; qkv = norm + QKV + RoPE + KV write, attention at
context 512, o_proj + residual, norm + gate-up + SiLU, down + residual) runs as 32 PDL-chained
launches over 32 layers' distinct weights in one CUDA graph (so no weight comes from L2), for
every candidate kernel configuration (``dot`` and ``rows``), next to cuBLAS
(``torch.mm``) on the same matrices. Every candidate is checked against a float32 torch reference
first. Prints microseconds per launch, GB/s, the best candidate per stage and batch, the sum of
the stages against the bandwidth floor, and the ``lowlat.kernels.tuning.TABLES`` entry to paste.

    python benchmarks/lowlat/bench_gemv.py [--batches 1,8] [--budget-s 300] [--json out.json] [--fp8]

``--fp8``: the layers' projections in FP8 e4m3 with per-row scales (``lowlat.quantize_layer_fp8``), checked against
the dequantized weights; cuBLAS then runs on bf16 copies of the dequantized weights (the bf16 path's time), and the
entries printed are for ``lowlat.kernels.tuning.FP8_TABLES``. With ``--fp8`` each GEMV stage also times
``torch._scaled_mm`` (cuBLASLt W8A8, the outside baseline of the W8A8 kernels ``mrow_w8a8*``) on the FP8 weights of
all the layers: the rows quantized per token beforehand (e4m3, float32 scales (M, 1); not timed), M padded to 16 rows,
the weights' per-row scales (1, N), bf16 out; the GEMM only (no norm, RoPE, SiLU or residual). A last table gives
each stage's best time per variant (row-wise, ``mrow_f16s``, ``mrow_w8a8``, ``mrow_w8a8b``, cuBLAS, ``scaled_mm``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_layer import SHAPES, gpu_layer, time_graph  # noqa: E402

from lowlat import KVCache, LayerShape, quantize_layer_fp8  # noqa: E402
from lowlat.kernels import ops  # noqa: E402
from lowlat.kernels.tuning import shape_key  # noqa: E402
from lowlat.layer import dequantized  # noqa: E402
from lowlat.reference import apply_rope, decode_attention, rms_norm  # noqa: E402
from lowlat.testing import decode_meta  # noqa: E402

DOT_BLOCKS = [(16, 256), (16, 512), (32, 128), (32, 256), (64, 128), (64, 256), (8, 512)]
ROWS_BLOCKS = [(4, 1024), (8, 512), (16, 256), (16, 512), (32, 256), (8, 1024)]
# attention: (block_n, splits); splits 0 = the plugin's heuristic (ops.num_splits), 1 = no merge launch
ATTN_CHOICES = [(bn, sp) for bn in (32, 64, 128) for sp in (0, 1, 2, 4, 8)]
QKV_ROWS_BLOCKS = [(4, 1024), (8, 512), (8, 1024), (16, 512)]
WARPS_STAGES = [(4, 3), (4, 4), (8, 3)]


def candidates(stage: str, fp8: bool = False) -> list[ops.GemvConfig]:
    """Every config of ``stage`` to sweep; ``fp8``: each row-wise one also with 8- and 16-element weight loads (vec 8:
    in the activation's layout; vec 16: the activation loaded in the weight tile's layout, ``lowlat.kernels.gemv``)."""
    out = []
    blocks = [(p, k) for p in (8, 16, 32) for k in (128, 256, 512)] if stage == "qkv" else DOT_BLOCKS
    for (bn, bk), (nw, ns) in itertools.product(blocks, WARPS_STAGES):
        out.append(ops.GemvConfig("dot", bn, bk, nw, ns))
    rows = QKV_ROWS_BLOCKS if stage == "qkv" else ROWS_BLOCKS  # qkv: block_n = rotary pairs per tile
    for (bn, bk), (nw, ns) in itertools.product(rows, [(4, 2), (4, 3), (8, 2)]):
        out.extend(ops.GemvConfig("rows", bn, bk, nw, ns, vec=v) for v in ((0, 8, 16) if fp8 else (0,)))
    return out


def configs_from_arg(text: str) -> Any:
    """``--configs``: a per-stage candidate list from ``[B@][stage=]variant:block_n:block_k:warps:stages`` entries
    (``B@``: at batch B only); the returned ``cands(stage, batch=0)`` gives a stage's configs at ``batch`` (0: all)."""
    entries: list[tuple[str, ops.GemvConfig, int]] = []
    for item in filter(None, text.split(",")):
        only_b, _, item = item.rpartition("@")
        stage, _, spec = item.rpartition("=")
        variant, *nums = spec.split(":")
        if len(nums) not in (4, 5, 6, 7):
            raise SystemExit(f"--configs: {item!r} is not "
                             "[stage=]variant:block_n:block_k:warps:stages[:vec[:acc2d[:split_k]]]")
        vals = [int(v) for v in nums]
        entries.append((stage, ops.GemvConfig(variant, *vals[:4], vec=vals[4] if len(vals) >= 5 else 0,
                                              acc2d=len(vals) >= 6 and vals[5] == 1,
                                              split_k=vals[6] if len(vals) == 7 else 0), int(only_b or 0)))

    def cands(stage: str, batch: int = 0) -> list[ops.GemvConfig]:
        return [cfg for only, cfg, b in entries if only in ("", stage) and (not batch or b in (0, batch))]
    return cands


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--stages", default="qkv,attention,o_proj,gate_up,down")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.23)
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop sweeping after this long")
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default="",
                    help="time only these GEMV configs instead of the sweep: comma list of [stage=]variant:block_n:"
                         "block_k:warps:stages[:vec[:acc2d[:split_k]]] (qkv: block_n = rotary pairs; vec: GemvConfig.vec; "
                         "acc2d 1: GemvConfig.acc2d; split_k: GemvConfig.split_k, o_proj / down multi-row), e.g. "
                         "qkv=rows:4:1024:8:2,dot:32:256:4:3,rows:4:4096:8:2:8")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on the CPU (TRITON_INTERPRET=1): checks the script")
    ap.add_argument("--fp8", action="store_true", help="FP8 e4m3 projections with per-row scales")
    args = ap.parse_args()
    t0 = time.time()
    dev, bf16, shape = torch.device("cuda"), torch.bfloat16, SHAPES[args.shape]
    timer = time_graph

    def cands(stage: str, batch: int = 0) -> list[ops.GemvConfig]:
        return candidates(stage, args.fp8)
    if args.configs:
        cands = configs_from_arg(args.configs)
    if args.cpu_smoke:
        dev, shape = torch.device("cpu"), LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                                     intermediate_size=96)

        def timer(fn: Any, iters: int) -> float:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6

        def cands(stage: str, batch: int = 0) -> list[ops.GemvConfig]:
            first: dict[str, ops.GemvConfig] = {}  # the first candidate of each variant
            for c in candidates(stage):
                first.setdefault(c.variant, c)
            return list(first.values())
    torch.manual_seed(0)
    weights = [gpu_layer(shape, bf16, dev) for _ in range(args.layers)]
    if args.fp8:
        weights = [quantize_layer_fp8(w) for w in weights]
    dense = {name: dequantized(getattr(weights[0], name), getattr(weights[0], f"{name}_scale"), bf16)
             for name in ("qkv", "o_proj", "gate_up", "down")}  # cuBLAS's bf16 matrices (layer 0's, reused)
    base = replace(ops.LaunchConfig.for_device(dev, shape, use_pdl=True, fp8=args.fp8), tuned=())
    gpu_name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device={gpu_name} sms={base.num_sms} pdl={base.use_pdl}", flush=True)
    c = args.context
    results: list[dict[str, Any]] = []
    best: dict[tuple[str, int], tuple[float, Any]] = {}  # GemvConfig, or (block_n, splits) for attention
    def bench_batch(b: int) -> None:
        slots = b * c + 64
        kvs = [KVCache(torch.randn(slots, shape.num_kv_heads, shape.head_dim, device=dev, dtype=bf16),
                       torch.randn(slots, shape.num_kv_heads, shape.head_dim, device=dev, dtype=bf16))
               for _ in range(args.layers)]
        meta = decode_meta([c] * b, slots, c, dev, generator=torch.Generator().manual_seed(b))
        meta = replace(meta, req_to_token=meta.req_to_token.contiguous())
        x = torch.randn(b, shape.hidden_size, device=dev, dtype=bf16)
        attn_in = torch.randn(b, shape.q_size, device=dev, dtype=bf16)
        act_in = torch.randn(b, shape.intermediate_size, device=dev, dtype=bf16) * 0.5
        q = torch.empty(b, shape.q_size, device=dev, dtype=bf16)
        attn_out = torch.empty(b, shape.q_size, device=dev, dtype=bf16)
        out_h = torch.empty(b, shape.hidden_size, device=dev, dtype=bf16)
        act = torch.empty(b, shape.intermediate_size, device=dev, dtype=bf16)
        qkv_out = torch.empty(b, shape.qkv_size, device=dev, dtype=bf16)
        gu_out = torch.empty(b, 2 * shape.intermediate_size, device=dev, dtype=bf16)
        max_splits = 16
        part_o = torch.empty(b, shape.num_heads, max_splits, shape.head_dim, device=dev, dtype=torch.float32)
        part_lse = torch.empty(b, shape.num_heads, max_splits, device=dev, dtype=torch.float32)
        # split-K partials (up to 8 splits) and zero counters (one per output tile of 16 or more rows)
        split_ws = (torch.empty(8 * b * shape.hidden_size, device=dev, dtype=torch.float32),
                    torch.zeros(shape.hidden_size // 16 + 1, device=dev, dtype=torch.int32))
        el = weights[0].qkv.element_size()
        wb = {"qkv": weights[0].qkv.numel() * el, "o_proj": weights[0].o_proj.numel() * el,
              "gate_up": weights[0].gate_up.numel() * el, "down": weights[0].down.numel() * el,
              "attention": b * c * shape.num_kv_heads * shape.head_dim * 2 * 2}

        def run_stage(stage: str, lc: ops.LaunchConfig, i: int, splits: int = 0) -> torch.Tensor:
            w = weights[i]
            if stage == "qkv":
                ops.qkv_rope(x, w, kvs[i], meta, q, shape, lc)
                return q
            if stage == "attention":
                if splits == 0:
                    splits = ops.num_splits(b, shape, c, lc, max_splits)
                ops.attention(attn_in, kvs[i], meta, part_o, part_lse, attn_out, shape, lc, splits)
                return attn_out
            if stage == "o_proj":
                ops.gemv_residual(attn_in, w.o_proj, x, out_h, lc, stage="o_proj", scale=w.o_proj_scale,
                                  split_ws=split_ws)
                return out_h
            if stage == "gate_up":
                ops.norm_gate_up(x, w.post_norm, w.gate_up, act, shape.rms_eps, lc, scale=w.gate_up_scale)
                return act
            ops.gemv_residual(act_in, w.down, x, out_h, lc, stage="down", scale=w.down_scale, split_ws=split_ws)
            return out_h

        def reference(stage: str) -> torch.Tensor | None:
            w = weights[0]
            if stage == "o_proj":
                return x.float() + attn_in.float() @ dense["o_proj"].float().T
            if stage == "down":
                return x.float() + act_in.float() @ dense["down"].float().T
            if stage == "gate_up":
                g, u = (rms_norm(x.float(), w.post_norm.float(), shape.rms_eps) @ dense["gate_up"].float().T).split(
                    shape.intermediate_size, -1)
                return torch.nn.functional.silu(g) * u
            if stage == "qkv":  # q only (the K/V cache writes: the kernel tests and bench_layer)
                rq = (rms_norm(x.float(), w.input_norm.float(), shape.rms_eps) @ dense["qkv"].float().T)[:, :shape.q_size]
                return apply_rope(rq.view(b, shape.num_heads, -1), meta.positions, w.rope_inv_freq).reshape(b, -1)
            if stage == "attention":
                return decode_attention(attn_in.float().view(b, shape.num_heads, -1), KVCache(kvs[0].k.float(), kvs[0].v.float()),
                                        meta, shape.head_dim**-0.5).reshape(b, -1)
            return None

        def cublas(stage: str, i: int) -> None:
            w = dense if args.fp8 else vars(weights[i])  # NOTE: FP8: layer 0's bf16 matrices for every layer (L2-warm)
            a, wt, o = {"qkv": (x, w["qkv"], qkv_out), "o_proj": (attn_in, w["o_proj"], out_h),
                        "gate_up": (x, w["gate_up"], gu_out), "down": (act_in, w["down"], out_h)}[stage]
            torch.mm(a, wt.t(), out=o)

        def timed(fn: Any) -> float:
            return timer(lambda: [fn(i) for i in range(args.layers)], args.iters) / args.layers

        qrows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # stage -> (e4m3 rows padded to 16, (16, 1) scales)
        if args.fp8 and dev.type == "cuda":
            mp = max(16, -(-b // 16) * 16)
            for stage, a in (("qkv", x), ("o_proj", attn_in), ("gate_up", x), ("down", act_in)):
                rows = torch.zeros(mp, a.shape[1], device=dev, dtype=torch.float32)
                rows[:b] = a.float()
                sc = (rows.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
                qrows[stage] = ((rows / sc).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), sc)

        def scaled_mm(stage: str, i: int) -> None:
            w = weights[i]
            wt, ws = {"qkv": (w.qkv, w.qkv_scale), "o_proj": (w.o_proj, w.o_proj_scale),
                      "gate_up": (w.gate_up, w.gate_up_scale), "down": (w.down, w.down_scale)}[stage]
            q, sc = qrows[stage]
            torch._scaled_mm(q, wt.t(), scale_a=sc, scale_b=ws.view(1, -1), out_dtype=bf16)

        for stage in args.stages.split(","):
            if stage != "attention":
                us = timed(lambda i, stage=stage: cublas(stage, i))
                results.append(dict(batch=b, stage=stage, variant="cublas", us=us, gbs=wb[stage] / us / 1e3))
            if stage in qrows:
                try:
                    us = timed(lambda i, stage=stage: scaled_mm(stage, i))
                    results.append(dict(batch=b, stage=stage, variant="scaled_mm", us=us, gbs=wb[stage] / us / 1e3))
                except Exception as exc:  # noqa: BLE001 - a torch without row-wise scaled_mm: no baseline
                    print(f"skip scaled_mm {stage} b={b}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            todo = ATTN_CHOICES if stage == "attention" else cands(stage, b)
            ref = reference(stage)

            def try_one(cfg: Any, stage: str = stage, ref: torch.Tensor | None = ref) -> None:
                sp = cfg[1] if stage == "attention" else 0
                lc = replace(base, attn_block_n=cfg[0], attn_tuned=()) if stage == "attention" else replace(base, tuned=((stage, 1 << 30, cfg),))
                try:
                    got = run_stage(stage, lc, 0, sp)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    err = float((got.float() - ref).norm() / ref.norm()) if ref is not None else 0.0
                    # W8A8 (rows rounded to e4m3: ~2.6% rms per projection, ~4% through SiLU(g) x u) against the
                    # unquantized rows; their exact oracle is w8a8_cases.py's
                    if not err < (8e-2 if isinstance(cfg, ops.GemvConfig) and cfg.w8a8 else 2e-2):
                        print(f"WRONG {stage} b={b} {cfg}: rel err {err:.2e}", flush=True)
                        return
                    us = timed(lambda i: run_stage(stage, lc, i, sp))
                except Exception as exc:  # noqa: BLE001 - a config out of resources is skipped
                    print(f"skip {stage} b={b} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    return
                results.append(dict(batch=b, stage=stage, variant=str(cfg), us=us, gbs=wb[stage] / us / 1e3, err=err))
                if us < best.get((stage, b), (float("inf"), None))[0]:
                    best[(stage, b)] = (us, cfg)

            for cfg in todo:
                if time.time() - t0 > args.budget_s:
                    print(f"budget reached: {stage} b={b} stopped", flush=True)
                    break
                try_one(cfg)
            if stage != "attention" and (stage, b) in best and time.time() - t0 <= args.budget_s and not args.configs:
                # the winner again on a grid of 1, 2 or 4 programs per SM that loop over the tiles
                for k in (1, 2, 4):
                    try_one(replace(best[(stage, b)][1], programs=k * base.num_sms))
            print(f"[{time.time() - t0:.0f}s] b={b} {stage}: best {best.get((stage, b))}", flush=True)

    for b in [int(v) for v in args.batches.split(",")]:
        bench_batch(b)

    print(f"\nbest per stage (us per launch; GB/s; cuBLAS torch.mm on the same matrices), ctx {c}")
    print(f"{'bs':>3s} {'stage':>9s} {'best us':>8s} {'GB/s':>6s} {'cublas us':>9s} {'ratio':>6s}  config")
    tables = []
    for (stage, b), (us, cfg) in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cb = next((r["us"] for r in results if r["batch"] == b and r["stage"] == stage and r["variant"] == "cublas"), float("nan"))
        gbs = next(r["gbs"] for r in results if r["batch"] == b and r["stage"] == stage and r["us"] == us)
        print(f"{b:3d} {stage:>9s} {us:8.2f} {gbs:6.0f} {cb:9.2f} {cb / us:6.2f}  {cfg}")
        if stage != "attention":
            tables.append((stage, b, cfg))
    for b in sorted({b for _, b in best}):
        tot = sum(us for (s, bb), (us, _) in best.items() if bb == b)
        floor = (shape.weight_bytes(weights[0].qkv.element_size()) + b * c * shape.num_kv_heads * shape.head_dim * 4) / (args.bandwidth_tbs * 1e6)
        print(f"b={b}: sum of best stages {tot:.1f} us per layer (floor {floor:.1f}: {floor / tot:.0%} of the bandwidth)")
    kinds = ("rows", "mrow_f16s", "mrow_w8a8", "mrow_w8a8b", "cublas", "scaled_mm")
    print(f"\nbest us per variant (GEMV stages; cublas: bf16 weights; scaled_mm: W8A8 GEMM only)\n{'bs':>3s} {'stage':>8s} "
          + " ".join(f"{k:>10s}" for k in kinds))
    for b in sorted({r["batch"] for r in results}):
        for stage in ops.GEMV_STAGES:
            per = {k: min((r["us"] for r in results if r["batch"] == b and r["stage"] == stage
                           and (r["variant"] == k or r["variant"].startswith(f"GemvConfig(variant='{k}'"))),
                          default=float("nan")) for k in kinds}
            if any(v == v for v in per.values()):
                print(f"{b:3d} {stage:>8s} " + " ".join(f"{per[k]:10.2f}" for k in kinds))
    print("\nFP8_TABLES entry:" if args.fp8 else "\nTABLES entry:")
    print(f"    ({gpu_name!r}, {shape_key(shape)}): (")
    for stage, b, cfg in tables:
        programs = f", {cfg.programs}" if cfg.programs else ""
        vec = f", vec={cfg.vec}" if cfg.vec else ""
        vec += ", acc2d=True" if cfg.acc2d else ""
        vec += f", split_k={cfg.split_k}" if cfg.split_k else ""
        print(f"        ({stage!r}, {b}, GemvConfig({cfg.variant!r}, {cfg.block_n}, {cfg.block_k}, {cfg.num_warps}, "
              f"{cfg.num_stages}{programs}{vec})),")
    print("    ),")
    for (stage, b), (us, cfg) in sorted(best.items()):
        if stage == "attention":
            print(f"attention b={b}: attn_block_n {cfg[0]}, splits {cfg[1] or 'heuristic'} ({us:.2f} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "best": [dict(stage=s, batch=b, **asdict(cfg)) for s, b, cfg in tables]}, f, indent=1)


if __name__ == "__main__":
    main()
