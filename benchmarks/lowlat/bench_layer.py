"""Decoder-layer benchmark of lowlat's plugins on a CUDA GPU (never collected by pytest).

One script per device call: (1) correctness of every plugin's layer against the torch reference
on fresh random bf16 inputs (Llama-3-8B shape, batch 1 and 8), (2) a 32-layer Llama-3-8B-shaped
bf16 stack captured in one CUDA graph at batch 1/4/8 and context 512/4096: microseconds per layer
for generic eager, generic + torch.compile (batch 1 only, if time allows), nvidia (PDL and not),
amd persistent and amd staged; achieved GB/s against a copy bandwidth (default 4.23 TB/s).

    python benchmarks/lowlat/bench_layer.py [--layers 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import replace
from typing import Any

import torch

from lowlat import (
    Coverage,
    ForwardMeta,
    KVCache,
    LayerShape,
    LayerWeights,
    LowlatConfig,
    reference_decoder_layer,
)
from lowlat.build import BuildContext
from lowlat.guards import detect_setup
from lowlat.kernels._jit import pdl_available
from lowlat.layer import rope_inv_freq
from lowlat.testing import decode_meta

LLAMA3_8B = LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
SMOLLM2 = LayerShape(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)
SHAPES = {"llama3-8b": LLAMA3_8B, "smollm2": SMOLLM2}


def gpu_layer(shape: LayerShape, dtype: torch.dtype, dev: torch.device) -> LayerWeights:
    def lin(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, device=dev, dtype=dtype) * i**-0.5

    h = shape.hidden_size
    return LayerWeights(
        input_norm=1 + 0.1 * torch.randn(h, device=dev, dtype=dtype), qkv=lin(shape.qkv_size, h),
        o_proj=lin(h, shape.q_size), post_norm=1 + 0.1 * torch.randn(h, device=dev, dtype=dtype),
        gate_up=lin(2 * shape.intermediate_size, h), down=lin(h, shape.intermediate_size),
        rope_inv_freq=rope_inv_freq(shape.head_dim, 500000.0, dev),
    )


CHECK_CASES = ((1, 512), (8, 4096), (3, 1000))  # (batch, context) of the correctness check


def build_context(shape: LayerShape, weights: list[LayerWeights], dev: torch.device, max_b: int, max_ctx: int,
                  **cfg: Any) -> BuildContext:
    """A bf16 build for every batch and context the timings and the check use (``CHECK_CASES``), at every batch,
    not only those measured faster end to end."""
    max_b, max_ctx = max(max_b, max(b for b, _ in CHECK_CASES)), max(max_ctx, max(c for _, c in CHECK_CASES))
    setup = detect_setup("LlamaForCausalLM", "bfloat16", device="cuda", max_context=max_ctx)
    return BuildContext(shape, tuple(weights), dev, torch.bfloat16, torch.bfloat16, Coverage(max_tokens=max_b),
                        LowlatConfig(measured_coverage=False, **cfg), setup, max_ctx)


def builders(shape: LayerShape, weights: list[LayerWeights], dev: torch.device, max_b: int, max_ctx: int) -> dict[str, Any]:
    from lowlat.plugins import amd, nvidia

    def ctx(**cfg: Any) -> BuildContext:
        return build_context(shape, weights, dev, max_b, max_ctx, **cfg)

    out: dict[str, Any] = {}
    for name, fn in [
        ("nvidia", lambda: nvidia.build(ctx(pdl="auto"))),
        ("nvidia-nopdl", lambda: nvidia.build(ctx(pdl="off"))),
        ("nvidia-1split", lambda: nvidia.build(ctx(pdl="auto", max_attn_splits=1))),  # attention in one launch
        ("nvidia-pdl-early", lambda: _release(nvidia.build(ctx(pdl="auto")), "early")),
        ("nvidia-pdl-late", lambda: _release(nvidia.build(ctx(pdl="auto")), "late")),
        ("amd-persistent", lambda: amd.build(ctx(amd_mode="persistent"))),
        ("amd-staged", lambda: amd.build(ctx(amd_mode="staged"))),
    ]:
        try:
            out[name] = fn()
        except Exception:
            print(f"BUILD FAILED {name}:\n{traceback.format_exc()}")
    return out


def _release(built: Any, release: str) -> Any:
    """The same stack with every kernel releasing its dependent launch at ``release`` (LaunchConfig.pdl_release)."""
    built.lc = replace(built.lc, pdl_release=release)
    return built


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check(built: dict[str, Any], shape: LayerShape, w0: LayerWeights, dev: torch.device) -> list[tuple[str, int, int, float, float]]:
    rows = []
    for b, c in CHECK_CASES:
        g = torch.Generator().manual_seed(b * 7 + c)
        meta = decode_meta([c] * b, b * c + 64, c, dev, generator=g)
        k = torch.randn(b * c + 64, shape.num_kv_heads, shape.head_dim, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        x = torch.randn(b, shape.hidden_size, device=dev, dtype=torch.bfloat16)
        kv_ref = KVCache(k.clone(), v.clone())
        ref = reference_decoder_layer(x, w0, kv_ref, meta, shape)
        for name, bl in built.items():
            kv = KVCache(k.clone(), v.clone())
            try:
                bl.out.fill_(float("nan"))
                out = bl.forward(0, x, kv, meta)
                torch.cuda.synchronize()
                if hasattr(bl, "check_errors") and getattr(bl, "mode", "") == "persistent":
                    bl.check_errors()
                rows.append((name, b, c, rel(out, ref), max(rel(kv.k, kv_ref.k), rel(kv.v, kv_ref.v))))
            except Exception as exc:
                print(f"CHECK FAILED {name} b={b} c={c}: {exc!r}")
                rows.append((name, b, c, float("nan"), float("nan")))
    return rows


def capture(fn: Any) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn`` (run twice on a side stream first: compiles and allocations stay out of it)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_us(graph: Any, iters: int) -> float:
    """Median microseconds of one replay of ``graph`` (CUDA events around each, after 3 warm-up replays)."""
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    times.sort()
    return times[len(times) // 2]


def time_graph(fn: Any, iters: int) -> float:
    """Median microseconds of one replay of a graph capturing ``fn``."""
    return replay_us(capture(fn), iters)


SWEEP = [(16, 256, 4, 3), (32, 128, 4, 4), (16, 512, 4, 3), (32, 256, 8, 3), (64, 128, 4, 3), (16, 128, 4, 4)]


def sweep(built: dict[str, Any], kvs: list[KVCache], shape: LayerShape, dev: torch.device, args: Any) -> None:
    """Time the nvidia stack at batch 1 and 8, context 512, per GEMV block config; keep the best
    (by the sum) for nvidia and nvidia-nopdl and report it as their launch config."""
    print("\nGEMV config sweep (nvidia, ctx 512): block_n block_k warps stages -> us/layer bs1, bs8")
    best, best_us = None, float("inf")
    for bn, bk, nw, ns in SWEEP:
        bl = built["nvidia"]
        bl.lc = replace(bl.lc, gemv_block_n=bn, gemv_block_k=bk, num_warps=nw, num_stages=ns)
        tot = 0.0
        cells = []
        for b in (1, 8):
            meta = decode_meta([512] * b, kvs[0].k.shape[0], 512, dev, generator=torch.Generator().manual_seed(b))
            x0 = torch.randn(b, shape.hidden_size, device=dev, dtype=torch.bfloat16)

            def plug(bl: Any = bl, meta: ForwardMeta = meta, x0: torch.Tensor = x0) -> None:
                x = x0
                for i in range(args.layers):
                    x = bl.forward(i, x, kvs[i], meta)
            try:
                us = time_graph(plug, args.iters) / args.layers
            except Exception as exc:
                print(f"  sweep failed {bn, bk, nw, ns}: {exc!r}")
                us = float("inf")
            tot += us
            cells.append(f"{us:7.1f}")
        print(f"  {bn:4d} {bk:4d} {nw:2d} {ns:2d} -> {' '.join(cells)}")
        if tot < best_us:
            best, best_us = (bn, bk, nw, ns), tot
    assert best is not None
    bn, bk, nw, ns = best
    print(f"  best: block_n={bn} block_k={bk} warps={nw} stages={ns}")
    for name in ("nvidia", "nvidia-nopdl", "amd-staged"):
        if name in built:
            built[name].lc = replace(built[name].lc, gemv_block_n=bn, gemv_block_k=bk, num_warps=nw, num_stages=ns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.23)
    ap.add_argument("--compile-budget-s", type=float, default=90.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", type=int, default=1, help="1: sweep GEMV block configs for nvidia first")
    ap.add_argument("--tuning", default=None, help="bench_gemv.py --json output: also time `nvidia-tuned` with its best "
                                                    "configs per stage and batch")
    args = ap.parse_args()
    t_start = time.time()
    dev = torch.device("cuda")
    shape = SHAPES[args.shape]
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__} pdl_available={pdl_available()}")
    torch.manual_seed(0)
    weights = [gpu_layer(shape, torch.bfloat16, dev) for _ in range(args.layers)]
    built = builders(shape, weights, dev, max(batches), max(contexts))
    print("built:", {k: f"{v.workspace_bytes / 2**20:.1f} MiB, pdl={v.lc.use_pdl}" for k, v in built.items()})
    if args.tuning and "nvidia" in built:
        from lowlat.kernels.ops import GemvConfig
        from lowlat.plugins import nvidia

        with open(args.tuning) as f:
            entries = sorted(json.load(f)["best"], key=lambda e: e["batch"])
        tuned = tuple((e["stage"], e["batch"], GemvConfig(e["variant"], e["block_n"], e["block_k"], e["num_warps"],
                                                           e["num_stages"], e.get("programs", 0))) for e in entries)
        bl = nvidia.build(build_context(shape, weights, dev, max(batches), max(contexts), pdl="auto"))
        bl.lc = replace(bl.lc, tuned=tuned)
        built["nvidia-tuned"] = bl
        print("nvidia-tuned:", tuned)
    rows = check(built, shape, weights[0], dev)
    print("\ncorrectness vs torch reference (relative L2 error; bf16)")
    print(f"{'plugin':16s} {'bs':>3s} {'ctx':>5s} {'out err':>9s} {'kv err':>9s}")
    for name, b, c, e_out, e_kv in rows:
        print(f"{name:16s} {b:3d} {c:5d} {e_out:9.2e} {e_kv:9.2e}")
    print(f"[{time.time() - t_start:.0f}s]", flush=True)

    slots = max(batches) * max(contexts) + 64
    kvs = [KVCache(torch.randn(slots, shape.num_kv_heads, shape.head_dim, device=dev, dtype=torch.bfloat16),
                   torch.randn(slots, shape.num_kv_heads, shape.head_dim, device=dev, dtype=torch.bfloat16))
           for _ in range(args.layers)]
    if "nvidia" in built and args.sweep:
        sweep(built, kvs, shape, dev, args)
    compiled = torch.compile(reference_decoder_layer, dynamic=False)
    results: list[dict[str, Any]] = []
    wbytes = shape.weight_bytes(2)
    for c in contexts:
        for b in batches:
            meta = decode_meta([c] * b, slots, c, dev, generator=torch.Generator().manual_seed(b + c))
            meta = replace(meta, req_to_token=meta.req_to_token.contiguous())
            x0 = torch.randn(b, shape.hidden_size, device=dev, dtype=torch.bfloat16)
            kv_bytes = b * c * shape.num_kv_heads * shape.head_dim * 2 * 2
            floor_us = (wbytes + kv_bytes) / (args.bandwidth_tbs * 1e12) * 1e6
            variants: dict[str, Any] = {}

            def generic(fn: Any = reference_decoder_layer, meta: ForwardMeta = meta, x0: torch.Tensor = x0) -> None:
                x = x0
                for i in range(args.layers):
                    x = fn(x, weights[i], kvs[i], meta, shape)

            variants["generic-eager"] = generic
            if b == 1 and time.time() - t_start < args.compile_budget_s + 60:
                variants["generic-compile"] = lambda meta=meta, x0=x0: generic(compiled, meta, x0)
            for name, bl in built.items():
                def plug(bl: Any = bl, meta: ForwardMeta = meta, x0: torch.Tensor = x0) -> None:
                    x = x0
                    for i in range(args.layers):
                        x = bl.forward(i, x, kvs[i], meta)
                variants[name] = plug
            for name, fn in variants.items():
                try:
                    us = time_graph(fn, args.iters) / args.layers
                    if name == "amd-persistent":
                        built[name].check_errors()
                except Exception as exc:
                    print(f"BENCH FAILED {name} b={b} c={c}: {exc!r}")
                    us = float("nan")
                gbs = (wbytes + kv_bytes) / (us * 1e-6) / 1e9
                results.append(dict(variant=name, batch=b, context=c, us_per_layer=us, gb_s=gbs, floor_us=floor_us,
                                    frac_of_bw=gbs / (args.bandwidth_tbs * 1e3)))
            print(f"done b={b} c={c} [{time.time() - t_start:.0f}s]", flush=True)

    print(f"\nus per layer (32-layer stack in one CUDA graph; GB/s vs {args.bandwidth_tbs} TB/s)")
    names = list(dict.fromkeys(r["variant"] for r in results))
    print(f"{'ctx':>5s} {'bs':>3s} {'floor':>7s} " + " ".join(f"{n:>20s}" for n in names))
    for c in contexts:
        for b in batches:
            cells = []
            floor = next(r["floor_us"] for r in results if r["batch"] == b and r["context"] == c)
            for n in names:
                r = next((r for r in results if r["variant"] == n and r["batch"] == b and r["context"] == c), None)
                cells.append(f"{'-':>20s}" if r is None else f"{r['us_per_layer']:8.1f} ({r['gb_s']:5.0f} GB/s)")
            print(f"{c:5d} {b:3d} {floor:7.1f} " + " ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"check": rows, "bench": results}, f, indent=1)


if __name__ == "__main__":
    main()
