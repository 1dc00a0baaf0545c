"""The plugin's verify step against the generic one, old kernels against new, in one device call (CUDA GPU only).

Part 1, attention alone (no engine): the nvidia plugin's per-row split-KV attention (`ops.attention`, grid rows x KV
heads x splits) against `ops.rows_attention` (one leader program per run of a request's rows, its K/V read once for
them; the split count picked on the device from the number of requests), on a verify step (one request's 6 rows + 2
padding rows of length 1, the graph of 8 rows) and a decode step of 8 requests, Llama-3-8B shape, bf16. Each variant
is first checked against a float64 oracle on fresh random inputs (outputs poisoned with NaN first), then timed as 32
chained launches over 32 layers' own KV caches in one CUDA graph (median of replays, us per layer).

Part 2, the step (as `benchmarks/lowlat/bench_step_kernels.py`): per setting one `EngineCore` in this process
(dummy bf16 weights, CUDA graphs up to 8 rows, n-gram drafts: 5 per step, acceptance simulated at 3.5), one user's
request (random 512-token prompt, greedy; `--requests 2 --graph-rows 16`: two, the graph of 16), then the graph of 8
rows (which holds that request's last verify step of 6 rows; its verify graph where the engine captured one) replayed back to back (CUDA events) and under the torch profiler (each kernel's marginal time). Settings:
`spec` (generic verify: cuBLAS + lmserver's kernels), `spec+plugin-perrow` (the plugin with `rows_attention_up_to=0`:
the per-row attention, as before this change), `spec+plugin` (the plugin as built now), and `spec+plugin+...`: the
plugin with one GEMV stage's kernel at 2-8 rows swapped, or `rows-wide`: `rows_attention` on 16 splits of 64 tokens
whose unused splits return (`LaunchConfig.rows_wide_splits`; `VARIANTS`). `spec-fp8` / `spec-fp8+plugin-all`: the
generic and the plugin's verify step on FP8 weights and an FP8 KV cache (`auto+all-batches`: the plugin also where
its tables decline verify steps); `spec-fp8+plugin-all+attn-f16`: the same with the plugin's attention dots on the FP8
cache in fp16 (`LaunchConfig.attn_f16`, issues 33 / 34), `...+attn64` / `...+attn-f16-64` both at KV blocks of 64,
`...+attn-w8` / `...+attn-f16-w8` both at 8 warps per attention program; `...+verify-w0`: verify rows at the decode
rows' warps (`tuning.VERIFY_ATTN_WARPS` off); `...+mrow16`: the 2-8-row GEMV lines also at 9-16 rows.

`--attn-kv fp8` (part 1): FP8 (e4m3) caches (K scale 0.05, V scale 0.02), every variant timed twice, its dots widened
to bf16 and in fp16 (`LaunchConfig.attn_f16`, labelled `f16`), plus a decode step of one request; `--attn-context`
takes a comma list of contexts (each case at each); `--attn-grids stack`: only the per-row kernel and the stack's
`rows_attention` launch (no larger grids); `--attn-blocks 64,...`: those two also at each KV block; `--attn-warps 8`:
those two also at 8 warps (`LaunchConfig.attn_warps`).

`--alias-tables` (default on): on a GPU other than the H200 the plugin's measured tables (`lowlat.kernels.tuning`,
keyed by the GPU's name) are the H200's, copied under this GPU's name in this process only: the tiles were measured
on the H200, which has the H100's 132 SMs and architecture; without them an H100 runs the default tiles.

    python benchmarks/speculative/bench_verify_step.py --model-path MODEL_DIR [--json OUT/verify_step.json]
    python benchmarks/speculative/bench_verify_step.py --attn-kv fp8 --attn-context 512,4096 --attn-grids stack \
        --attn-blocks 64 [--json OUT/attn_f16.json]   # no --model-path: part 1 only (attention alone)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "lowlat"))

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def alias_tables(name: str, source: str = "NVIDIA H200") -> list[str]:
    """Copy every ``lowlat.kernels.tuning`` entry keyed by ``source`` under ``name`` (this process only)."""
    from lowlat.kernels import tuning

    copied = []
    for attr in dir(tuning):
        table = getattr(tuning, attr)
        if not (attr.isupper() and isinstance(table, dict)):
            continue
        for key in list(table):
            if isinstance(key, tuple) and key and key[0] == source:
                new = (name, *key[1:])
                if new not in table:
                    table[new] = table[key]
                    copied.append(attr)
    return sorted(set(copied))


# -- part 1: attention alone ---------------------------------------------------------------------------------------

LLAMA3_8B = dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)


def _meta(runs: list[tuple[int, int, int]], table_rows: int, context: int, slots: int, dev: torch.device,
          g: torch.Generator) -> Any:
    """Rows as (table row, prefix, rows) runs (row j of a run at position prefix + j); every table row's slots
    distinct (a scattered, paged layout)."""
    from lowlat.layer import ForwardMeta

    table = torch.randperm(slots, generator=g)[: table_rows * context].view(table_rows, context).to(torch.int32)
    req = torch.tensor([t for t, _, n in runs for _ in range(n)], dtype=torch.int64)
    pos = torch.tensor([p + j for _, p, n in runs for j in range(n)], dtype=torch.int64)
    lens = (pos + 1).to(torch.int32)
    loc = table[req, pos].to(torch.int64)
    return ForwardMeta(table.to(dev), req.to(dev), lens.to(dev), pos.to(dev), loc.to(dev), max_seq_len=context)


def _f64(q: torch.Tensor, kv: Any, meta: Any, group: int) -> torch.Tensor:
    """Float64 attention over the cache dequantized with its scales (an FP8 cache's; 1.0 otherwise)."""
    b, nq, d = q.shape
    table, rows, lens = meta.req_to_token.long(), meta.req_pool_indices.long(), meta.seq_lens.long()
    out = torch.empty(b, nq, d, dtype=torch.float64, device=q.device)
    for i in range(b):
        slots = table[rows[i], : lens[i]]
        k = kv.k[slots].double().repeat_interleave(group, 1) * kv.k_scale  # (n, nq, d)
        v = kv.v[slots].double().repeat_interleave(group, 1) * kv.v_scale
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * d**-0.5
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)
    return out


def attention_part(args: argparse.Namespace, results: dict[str, Any]) -> None:
    from lowlat import LayerShape
    from lowlat.kernels import ops
    from lowlat.kernels._jit import pdl_available

    dev = torch.device("cuda")
    shape = LayerShape(**LLAMA3_8B)
    lc = ops.LaunchConfig.for_device(dev, shape, use_pdl=pdl_available())
    layers, fp8 = 32, args.attn_kv == "fp8"
    for ctx in [int(c) for c in str(args.attn_context).split(",")]:
        cases = {  # verify: one request's 6 rows + 2 padding rows (table row 9, length 1); decode: 8 requests
            "verify 6+2": [(0, ctx - 6, 6), (9, 0, 2)],
            "verify 2x6 (16)": [(0, ctx - 6, 6), (1, ctx - 40, 6), (9, 0, 4)],
            "decode 8": [(i, ctx - 1 - 7 * i, 1) for i in range(8)],
            **({"decode 1": [(0, ctx - 1, 1)]} if fp8 else {}),
        }
        for case, runs in cases.items():
            _attention_case(f"{case} ctx{ctx}" if fp8 else case, runs, shape, lc, ctx, layers, dev, results, args)
            torch.cuda.empty_cache()


def _attention_case(case: str, runs: list[tuple[int, int, int]], shape: Any, lc: Any, ctx: int, layers: int,
                    dev: torch.device, results: dict[str, Any], args: argparse.Namespace) -> None:
    from bench_layer import time_graph

    from lowlat import KVCache
    from lowlat.kernels import ops
    from lowlat.layer import FP8_DTYPE
    from lowlat.reference import quantize_kv

    slots, max_splits = 10 * ctx + 64, 16
    g = torch.Generator().manual_seed(len(case))
    meta = _meta(runs, 10, ctx, slots, dev, g)
    b = int(meta.seq_lens.shape[0])
    fp8 = args.attn_kv == "fp8"

    def cache() -> KVCache:
        k, v = torch.randn(slots, 8, 128, device=dev), torch.randn(slots, 8, 128, device=dev)
        if fp8:  # an FP8 cache of N(0, 1) values at scales that use e4m3's range
            return KVCache(quantize_kv(k, 0.05, FP8_DTYPE), quantize_kv(v, 0.02, FP8_DTYPE), 0.05, 0.02)
        return KVCache(k.to(torch.bfloat16), v.to(torch.bfloat16))
    kvs = [cache() for _ in range(layers)]
    q = torch.randn(b, shape.q_size, device=dev, dtype=torch.bfloat16)
    part_o = torch.empty(b, shape.num_heads, max_splits, shape.head_dim, device=dev)
    part_lse = torch.empty(b, shape.num_heads, max_splits, device=dev)
    out = torch.empty_like(q)
    ref = _f64(q.view(b, shape.num_heads, -1), kvs[0], meta, shape.group_size).reshape(b, -1)
    per_row = ops.num_splits(b, shape, ctx, lc, max_splits)
    used = torch.zeros(b, dtype=torch.int32, device=dev)

    # each variant: (the launch's LaunchConfig change, its call given the changed config and a layer's cache)
    def per_row_call(lcv: Any, kv: Any, splits: int = per_row) -> None:
        ops.attention(q, kv, meta, part_o, part_lse, out, shape, lcv, splits)

    def rows_call(lcv: Any, kv: Any, splits: int, skip: bool = False) -> None:
        ops.rows_attention(q, kv, meta, part_o, part_lse, out, shape, lcv, splits, used=used if skip else None)

    Variant = tuple[Any, Any]
    same: Any = lambda x: x  # noqa: E731
    variants: dict[str, Variant] = {f"per-row ({per_row} splits, {b * 8 * per_row} programs)": (same, per_row_call)}
    # the stack's choice (the per-row split count, KV block attn_block), then larger grids (as many splits as blocks)
    grids = [(0, per_row)] + [(block, ops.rows_splits(b, shape, ctx, replace(lc, rows_attn_block=block), max_splits,
                                                       dev)) for block in (64, 32, 128)]
    for block, rows_s in [] if b == 1 else grids[:1] if args.attn_grids == "stack" else grids:
        lcb = replace(lc, rows_attn_block=block)
        variants[f"rows {ops.rows_block(b, lcb, dev)} ({rows_s}-split grid){' stack' if not block else ''}"] = (
            lambda x, block=block: replace(x, rows_attn_block=block), lambda lcv, kv, s=rows_s: rows_call(lcv, kv, s))
    for block in (64, 32) if args.attn_grids == "all" and b > 1 else ():  # LaunchConfig.rows_wide_splits: the
        rows_s = ops.rows_splits(b, shape, ctx, replace(lc, rows_attn_block=block), max_splits, dev)  # large grid,
        variants[f"rows {block} ({rows_s}-split grid, skip)"] = (  # its unused splits skipped
            lambda x, block=block: replace(x, rows_attn_block=block),
            lambda lcv, kv, s=rows_s: rows_call(lcv, kv, s, skip=True))
    for block in [int(v) for v in args.attn_blocks.split(",") if v]:  # the stack's two launches at another KV block
        splits_b = ops.num_splits(b, shape, ctx, replace(lc, attn_tuned=((1 << 30, block),)), max_splits)

        def at_block(x: Any, block: int = block) -> Any:
            return replace(x, attn_tuned=((1 << 30, block),))
        variants[f"per-row {block} ({splits_b} splits)"] = (at_block, lambda lcv, kv, s=splits_b: per_row_call(lcv, kv, s))
        if b > 1:
            variants[f"rows {block} ({splits_b}-split grid) stack"] = (
                at_block, lambda lcv, kv, s=splits_b: rows_call(lcv, kv, s))
    for warps in [int(v) for v in args.attn_warps.split(",") if v]:  # the stack's two launches at other warps

        def at_warps(x: Any, warps: int = warps) -> Any:
            return replace(x, attn_warps=warps)
        variants[f"per-row w{warps} ({per_row} splits)"] = (at_warps, per_row_call)
        if b > 1:
            variants[f"rows w{warps} ({per_row}-split grid) stack"] = (
                at_warps, lambda lcv, kv: rows_call(lcv, kv, per_row))
    # FP8 caches: each variant with the dots widened to bf16 (the default), then in fp16 (LaunchConfig.attn_f16)
    modes = ((False, ""), (True, " f16")) if fp8 else ((False, ""),)
    calls = {f"{name}{tag}": (lambda kv, call=call, lcv=change(replace(lc, attn_f16=f16)): call(lcv, kv))
             for name, (change, call) in variants.items() for f16, tag in modes}
    for name, fn in calls.items():
        out.fill_(float("nan"))
        fn(kvs[0])
        torch.cuda.synchronize()
        err = float((out.double() - ref).norm() / ref.norm())
        ok = bool(err < 2e-2 and not torch.isnan(out).any())

        def chain(fn: Any = fn) -> None:
            for kv in kvs:
                fn(kv)
        us = time_graph(chain, 30) / layers
        results["attention"].append(dict(case=case, variant=name, rel_err=err, ok=ok, us_per_layer=us))
        log(f"attention {case:16s} {name:36s} rel err {err:.2e} {'ok' if ok else 'FAILED'}  {us:7.2f} us/layer")


# -- part 2: the step ----------------------------------------------------------------------------------------------

def _first(stage: str, cfg_args: tuple[Any, ...]) -> Any:
    """A LaunchConfig change: ``stage`` at 1 < rows <= 8 on GemvConfig(*cfg_args) (its entry before the table's)."""
    from lowlat.kernels.ops import GemvConfig

    def change(lc: Any) -> Any:
        one = tuple(e for e in lc.tuned if e[0] == stage and e[1] == 1)
        return replace(lc, tuned=one + ((stage, 8, GemvConfig(*cfg_args)),) + lc.tuned)
    return change


def _mrow16(lc: Any) -> Any:
    """A LaunchConfig change: each stage's 9-16-row entry replaced by its 2-8-row line (``mrow_f16s`` in the H200 8B
    FP8 table; the W8A8 call of 2026-12-03 timed them at 16 rows: qkv 20.56, o_proj 9.47, gate-up 49.33, down 25.07
    us), for FP8 verify steps of 2 requests (12 rows, the graph of 16)."""
    eight = {e[0]: e[2] for e in lc.tuned if e[1] == 8}
    return replace(lc, tuned=tuple((s, b, eight.get(s, c)) if b == 16 else (s, b, c) for s, b, c in lc.tuned))


# setting -> (bench_step_kernels setting, LaunchConfig change on a GPU or None)
VARIANTS: dict[str, tuple[str, Any]] = {
    "spec": ("spec", None),
    "spec+plugin-perrow": ("spec+plugin", lambda lc: replace(lc, rows_attention_up_to=0)),
    "spec+plugin": ("spec+plugin", None),
    "spec+plugin+rows-wide": ("spec+plugin", lambda lc: replace(lc, rows_wide_splits=16, rows_attn_block=64)),
    "spec+plugin+oproj-dot": ("spec+plugin", _first("o_proj", ("dot", 32, 256, 4, 4))),
    "spec+plugin+down-mrow": ("spec+plugin", _first("down", ("mrow", 32, 512, 4, 3))),
    "spec+plugin+qkv-dot64": ("spec+plugin", _first("qkv", ("dot", 64, 256, 4, 3))),
    "spec-fp8": ("spec-fp8", None),
    "spec-fp8+plugin-all": ("spec-fp8+plugin-all", None),
    # the plugin's attention dots on the FP8 cache in fp16 (LaunchConfig.attn_f16; issues 33 / 34), and both ways at
    # KV blocks of 64 (the fp16 kernels at the tuned 128 spill in sm_90 code at 8 rows: benchmarks/fp8/GPU_NOTES.md)
    "spec-fp8+plugin-all+attn-f16": ("spec-fp8+plugin-all", lambda lc: replace(lc, attn_f16=True)),
    "spec-fp8+plugin-all+attn64": ("spec-fp8+plugin-all", lambda lc: replace(lc, attn_tuned=((1 << 30, 64),))),
    "spec-fp8+plugin-all+attn-f16-64": ("spec-fp8+plugin-all",
                                        lambda lc: replace(lc, attn_f16=True, attn_tuned=((1 << 30, 64),))),
    "spec-fp8+plugin-all+attn-w8": ("spec-fp8+plugin-all", lambda lc: replace(lc, attn_warps=8)),
    # the verify attention at the decode launch's warps (tuning.VERIFY_ATTN_WARPS off): the verify graphs' gain
    "spec-fp8+plugin-all+verify-w0": ("spec-fp8+plugin-all", lambda lc: replace(lc, verify_attn_warps=0)),
    "spec-fp8+plugin-all+mrow16": ("spec-fp8+plugin-all", _mrow16),
    "spec-fp8+plugin-all+attn-f16-w8": ("spec-fp8+plugin-all", lambda lc: replace(lc, attn_f16=True, attn_warps=8)),
}


def step_part(args: argparse.Namespace, results: dict[str, Any]) -> None:
    import kprof
    from bench_e2e import prompts_for, run
    from bench_layer import replay_us
    from bench_step_kernels import SETTINGS, launch_change, make_core

    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    for setting in args.settings:
        base, change = VARIANTS[setting]
        t0 = time.monotonic()
        with launch_change(change):
            core = make_core(args.model_path, SETTINGS[base], args.context, graph_max_bs=max(8, args.graph_rows))
        build_s = time.monotonic() - t0
        run(core, prompts_for(args.requests, vocab, 99, 64), 8)  # warm-up
        _, rates, steps = run(core, prompts_for(args.requests, vocab, 1), args.new_tokens)
        stats = {k: v for k, v in core.get_stats().items() if "lowlat" in k or k.startswith("spec")}
        log(f"=== {setting}: built in {build_s:.0f}s; engine c={args.requests} {statistics.median(rates):.1f} tok/s per "
            "user, step median "
            f"{1e6 * statistics.median(steps):.0f} us; {stats}")
        graphs = core.runner.cuda_graph
        rows = args.graph_rows
        verify = graphs.verify_graphs.get(rows)  # captured where the plugin's verify launch differs (or its path)
        graph = verify if verify is not None else graphs.graphs.get(rows)
        if graph is None:
            log(f"  no graph of {rows} rows")
        else:
            us = [replay_us(graph, 50) for _ in range(3)]
            kernels = kprof.breakdown(graph.replay, reps=3)
            kind = "verify graph" if verify is not None else "decode graph"
            log(f"  {kind} of {rows} rows (the last verify step): replay {us} us\n"
                + kprof.table(kernels, top=args.top, unit="us per replay"))
            results["step"].append(dict(setting=setting, requests=args.requests, graph_rows=rows, replay_us=us,
                                        engine_tok_s=statistics.median(rates),
                                        step_median_us=1e6 * statistics.median(steps), kernels=kernels,
                                        stats=stats))
        del core, graph, graphs, verify
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="config.json + tokenizer (part 2; none: part 1 only)")
    ap.add_argument("--settings", nargs="+", default=["spec", "spec+plugin-perrow", "spec+plugin"],
                    choices=list(VARIANTS))
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--requests", type=int, default=1, help="part 2: concurrent requests (6 verify rows each)")
    ap.add_argument("--graph-rows", type=int, default=8,
                    help="part 2: the graph timed (the padded size of the requests' verify rows: 8 for 1, 16 for 2)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--attn-context", default="608",
                    help="part 1: the rows' context, or a comma list (512 + 96 as part 2; 0: skip part 1)")
    ap.add_argument("--attn-kv", default="bf16", choices=["bf16", "fp8"],
                    help="part 1: the caches' dtype (fp8: each variant also with LaunchConfig.attn_f16)")
    ap.add_argument("--attn-grids", default="all", choices=["all", "stack"],
                    help="part 1: every rows_attention grid, or the stack's launches only")
    ap.add_argument("--attn-blocks", default="", help="part 1: comma list of KV blocks to time the stack's launches at")
    ap.add_argument("--attn-warps", default="", help="part 1: comma list of warps to time the stack's launches at")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--alias-tables", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    results: dict[str, Any] = {"device": name, "attention": [], "step": [], "aliased": []}
    if args.alias_tables and name != "NVIDIA H200":
        results["aliased"] = alias_tables(name)
        log(f"{name}: the H200's tuning entries copied under this name: {results['aliased']}")
    log(f"device {name}, torch {torch.__version__}")
    try:
        if args.attn_context not in ("", "0"):
            attention_part(args, results)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    if args.model_path:
        try:
            step_part(args, results)
        finally:
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    print("\nattention, us per layer (32 chained launches in one CUDA graph):")
    for r in results["attention"]:
        print(f"  {r['case']:16s} {r['variant']:36s} {r['us_per_layer']:7.2f}  err {r['rel_err']:.1e} "
              f"{'ok' if r['ok'] else 'FAILED'}")
    print(f"verify step, graph of {args.graph_rows} rows, {args.requests} request(s) (us per replay, 3 x median of 50):")
    for r in results["step"]:
        print(f"  {r['setting']:20s} {min(r['replay_us']):9.1f}  {r['replay_us']}  engine {r['engine_tok_s']:.1f} tok/s")


if __name__ == "__main__":
    main()
