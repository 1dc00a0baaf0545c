"""The nvidia plugin's decode stack with FP8 weights and FP8 KV against bf16, on a CUDA GPU (never collected by pytest).

A 32-layer Llama-3-8B-shaped stack (random bf16 weights; FP8 = the same weights quantized per output row with
``lowlat.quantize_layer_fp8``) in one CUDA graph at each batch of ``--batches``, context ``--context``: microseconds
per layer for bf16 weights + bf16 KV, FP8 weights + bf16 KV, FP8 weights + FP8 KV, against each one's memory floor
(weights + KV read at ``--bandwidth-tbs``). First, layer 0 of each against the reference layer (``lowlat.reference``:
the dequantized weights in float32, the same cache) on fresh random inputs. ``--tables``: a JSON list of
``[stage, max_batch, variant, block_n, block_k, warps, stages(, vec(, acc2d))]`` entries to time as the FP8 stack's table too
(``fp8w+kv table``); ``--stacks``: which of the stacks to build and time. ``--merge-ab``: each stack also with the other
split-KV merge (``LaunchConfig.fused_merge`` flipped: a merge launch of its own, or the last split merging), timed
right before it; ``--attn-blocks``: each stack also with that decode-attention KV block at every batch; ``--attn-f16``:
each stack with an FP8 KV cache also with its attention's dots in fp16 (``LaunchConfig.attn_f16``, ``... attn-f16``,
timed right after it; with ``--attn-blocks`` at those blocks too; issues 33 / 34); ``--attn-warps``: each stack also with
its attention launches at that many warps (``LaunchConfig.attn_warps``); ``--profile``: each stack's per-kernel
marginal time per layer (``kprof.py``).

    python benchmarks/lowlat/bench_fp8_stack.py [--batches 1,4,8] [--context 512] [--stacks fp8w+kv,table] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kprof  # noqa: E402
from bench_layer import LLAMA3_8B, build_context, capture, gpu_layer, rel, time_graph  # noqa: E402

from lowlat import KVCache, quantize_layer_fp8, reference_decoder_layer  # noqa: E402
from lowlat.kernels import ops  # noqa: E402
from lowlat.layer import FP8_DTYPE  # noqa: E402
from lowlat.plugins import nvidia  # noqa: E402
from lowlat.reference import quantize_kv  # noqa: E402
from lowlat.testing import decode_meta  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.23)
    ap.add_argument("--tables", default="", help="JSON list of FP8 table entries to time as variant 'fp8-table'")
    ap.add_argument("--stacks", default="bf16,fp8w,fp8w+kv,table",
                    help="comma list of bf16, fp8w, fp8w+kv, table (table: with --tables)")
    ap.add_argument("--merge-ab", action="store_true",
                    help="also time each stack with the other split merge (LaunchConfig.fused_merge flipped)")
    ap.add_argument("--profile", action="store_true", help="per-kernel marginal time of each stack (kprof.py)")
    ap.add_argument("--attn-blocks", default="", help="comma list of decode-attention KV blocks: each stack also with "
                                                      "that block at every batch (LaunchConfig.attn_tuned)")
    ap.add_argument("--l2-prefetch", default="", help="comma list of MiB: each stack also with LaunchConfig.l2_prefetch "
                                                       "of that many MiB (0: none)")
    ap.add_argument("--attn-warps", default="", help="comma list of warps: each stack also with its attention launches "
                                                      "at that many warps (LaunchConfig.attn_warps)")
    ap.add_argument("--attn-f16", action="store_true",
                    help="each FP8-KV stack also with its attention's dots in fp16 (LaunchConfig.attn_f16)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    dev, bf16, shape, c = torch.device("cuda"), torch.bfloat16, LLAMA3_8B, args.context
    batches = [int(v) for v in args.batches.split(",")]
    torch.manual_seed(0)
    dense = [gpu_layer(shape, bf16, dev) for _ in range(args.layers)]
    fp8 = [quantize_layer_fp8(w) for w in dense]
    max_b = max(batches)
    slots = max_b * max(c, 2000) + 64  # the check's longest case: max_b requests of 2,000 tokens
    stacks: dict[str, Any] = {}
    chosen = set(args.stacks.split(","))
    for name, weights, kv_dtype in (("bf16", dense, bf16), ("fp8w", fp8, bf16), ("fp8w+kv", fp8, FP8_DTYPE)):
        if name not in chosen:
            continue
        ctx = replace(build_context(shape, weights, dev, max_b, c, pdl="auto"), kv_dtype=kv_dtype)
        stacks[name] = (nvidia.build(ctx), weights, kv_dtype)
    if args.tables and "table" in chosen:
        entries = tuple((e[0], e[1], ops.GemvConfig(*e[2:7], vec=e[7] if len(e) > 7 else 0,
                                                    acc2d=len(e) > 8 and bool(e[8])))
                        for e in json.loads(args.tables))
        bl = nvidia.build(replace(build_context(shape, fp8, dev, max_b, c, pdl="auto"), kv_dtype=FP8_DTYPE))
        bl.lc = replace(bl.lc, tuned=entries + bl.lc.tuned)  # first match wins: these, then the stack's own
        stacks["fp8w+kv table"] = (bl, fp8, FP8_DTYPE)
    if args.attn_f16:  # each FP8-KV stack, then the same with the attention's dots in fp16
        paired: dict[str, Any] = {}
        for name, (bl, weights, kv_dtype) in stacks.items():
            paired[name] = (bl, weights, kv_dtype)
            if kv_dtype == FP8_DTYPE:
                other = nvidia.build(replace(build_context(shape, weights, dev, max_b, c, pdl="auto"), kv_dtype=kv_dtype))
                other.lc = replace(bl.lc, attn_f16=True)
                paired[f"{name} attn-f16"] = (other, weights, kv_dtype)
        stacks = paired
    base = list(stacks)
    if args.merge_ab:  # the same stacks with the other split merge (first in the table: A before B)
        for name in base:
            bl, weights, kv_dtype = stacks[name]
            other = nvidia.build(replace(build_context(shape, weights, dev, max_b, c, pdl="auto"), kv_dtype=kv_dtype))
            other.lc = replace(bl.lc, fused_merge=not bl.lc.fused_merge)
            label = "fused merge" if other.lc.fused_merge else "merge launch"
            stacks = {f"{name} {label}": (other, weights, kv_dtype), **stacks}
    for block in [int(v) for v in args.attn_blocks.split(",") if v]:
        for name in base:
            bl, weights, kv_dtype = stacks[name]
            other = nvidia.build(replace(build_context(shape, weights, dev, max_b, c, pdl="auto"), kv_dtype=kv_dtype))
            other.lc = replace(bl.lc, attn_tuned=((1 << 30, block),))
            stacks[f"{name} attn{block}"] = (other, weights, kv_dtype)
    for warps in [int(v) for v in args.attn_warps.split(",") if v]:
        for name in base:
            bl, weights, kv_dtype = stacks[name]
            other = nvidia.build(replace(build_context(shape, weights, dev, max_b, c, pdl="auto"), kv_dtype=kv_dtype))
            other.lc = replace(bl.lc, attn_warps=warps)
            stacks[f"{name} attn-w{warps}"] = (other, weights, kv_dtype)
    for mib in [int(v) for v in args.l2_prefetch.split(",") if v]:
        for name in base:
            bl, weights, kv_dtype = stacks[name]
            other = nvidia.build(replace(build_context(shape, weights, dev, max_b, c, pdl="auto"), kv_dtype=kv_dtype))
            other.lc = replace(bl.lc, l2_prefetch=mib << 20)
            stacks[f"{name} pf{mib}"] = (other, weights, kv_dtype)
    print(f"device={torch.cuda.get_device_name()} build {time.time() - t0:.0f}s", flush=True)

    def caches(kv_dtype: torch.dtype, layers: int) -> list[KVCache]:
        out = []
        for _ in range(layers):
            k = torch.randn(slots, shape.num_kv_heads, shape.head_dim, device=dev)
            v = torch.randn(slots, shape.num_kv_heads, shape.head_dim, device=dev)
            if kv_dtype == FP8_DTYPE:
                out.append(KVCache(quantize_kv(k, 0.05, FP8_DTYPE), quantize_kv(v, 0.02, FP8_DTYPE), 0.05, 0.02))
            else:
                out.append(KVCache(k.to(bf16), v.to(bf16)))
        return out

    print("\ncheck, layer 0 against the reference (rel. L2 error of the output; of the K cache)")
    for name, (bl, weights, kv_dtype) in stacks.items():
        for b, ctx_len in ((1, c), (max_b, 2000)):
            g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs per run
            torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
            meta = decode_meta([ctx_len] * b, slots, max(c, ctx_len), dev, generator=g)
            kv = caches(kv_dtype, 1)[0]
            kv_ref = KVCache(kv.k.clone(), kv.v.clone(), kv.k_scale, kv.v_scale)
            x = torch.randn(b, shape.hidden_size, generator=g).to(dev, bf16)
            bl.out.fill_(float("nan"))
            out = bl.forward(0, x, kv, meta)
            ref = reference_decoder_layer(x, weights[0], kv_ref, meta, shape)
            print(f"  {name:14s} b={b} ctx={ctx_len}: out {rel(out, ref):.2e}  k {rel(kv.k.float(), kv_ref.k.float()):.2e}",
                  flush=True)

    rows = []
    print(f"\nstack of {args.layers} layers in one CUDA graph, ctx {c}: us per layer (floor: weights + KV at "
          f"{args.bandwidth_tbs} TB/s)")
    for b in batches:
        meta = decode_meta([c] * b, slots, c, dev, generator=torch.Generator().manual_seed(b))
        for name, (bl, weights, kv_dtype) in stacks.items():
            kvs = caches(kv_dtype, args.layers)
            x0 = torch.randn(b, shape.hidden_size, device=dev, dtype=bf16)

            def run(bl: Any = bl, kvs: list[KVCache] = kvs, x0: torch.Tensor = x0, meta: Any = meta) -> None:
                x = x0
                for i in range(args.layers):
                    x = bl.forward(i, x, kvs[i], meta)
            us = time_graph(run, args.iters) / args.layers
            if args.profile:
                graph = capture(run)
                print(f"  b={b} {name}: per-kernel (kprof, {args.layers} layers)\n"
                      + kprof.table(kprof.breakdown(graph.replay, reps=3), per=args.layers, unit="us per layer"), flush=True)
                del graph
            kv_bytes = b * c * shape.kv_size * 2 * (1 if kv_dtype == FP8_DTYPE else 2)
            floor = (shape.weight_bytes(weights[0].qkv.element_size()) + kv_bytes) / (args.bandwidth_tbs * 1e6)
            rows.append(dict(batch=b, stack=name, us=us, floor=floor))
            print(f"  b={b} {name:14s} {us:7.1f} us  floor {floor:6.1f}  {floor / us:4.0%}", flush=True)
            del kvs
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
