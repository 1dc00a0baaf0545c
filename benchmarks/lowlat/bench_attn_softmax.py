"""lowlat's attention kernels and decode step on a CUDA GPU, for comparing two source trees side by side (never collected
by pytest). Run once per tree, alternating, in one device call:

    PYTHONPATH=<tree>/packages/lowlat/src python3 benchmarks/lowlat/bench_attn_softmax.py --tag base --json out.json

(1) Correctness against float64 on fresh random bf16 inputs, outputs and partials poisoned with NaN: split-KV decode
attention (``ops.attention``: one split, a merge launch, the fused merge), ``ops.rows_attention`` (verify runs and
decode rows) against a float64 softmax over each row's own prefix; the amd plugin's persistent layer against
``reference_decoder_layer`` (float32). (2) Timings, Llama-3-8B shape, median us of CUDA-graph replays of 32 launches
(one per layer's KV cache, so the graph's reads are not one buffer in L2): attention alone (the tuned launch config
of this GPU, PDL off), and a decode step of an ``--layers``-layer stack (nvidia and amd-persistent plugins).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields, replace
from functools import partial
from typing import Any

import torch

from lowlat import Coverage, KVCache, LayerShape, LowlatConfig, reference_decoder_layer
from lowlat.build import BuildContext
from lowlat.guards import detect_setup
from lowlat.kernels import ops
from lowlat.layer import ForwardMeta, LayerWeights, rope_inv_freq
from lowlat.testing import decode_meta

SHAPE = LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
DEV = torch.device("cuda")
BF16 = torch.bfloat16
SCALE = 1  # --smoke: contexts / 64 at a tiny shape on the CPU (TRITON_INTERPRET=1), no graphs: checks the script runs


def c(n: int) -> int:
    """A context length of the full run, scaled for --smoke."""
    return max(1, n // SCALE)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    if not bool(torch.isfinite(a).all()):
        return float("nan")
    return float((a - b).norm() / b.norm())


def attention_f64(q: torch.Tensor, kv: KVCache, meta: ForwardMeta) -> torch.Tensor:
    """Each row's heads over the first seq_len positions of its table row, in float64 (batched per row)."""
    b, g = q.shape[0], SHAPE.group_size
    qd = q.view(b, SHAPE.num_heads, SHAPE.head_dim).double()
    out = torch.empty_like(qd)
    table, rows, lens = meta.req_to_token.long(), meta.req_pool_indices.long(), meta.seq_lens.long()
    for i in range(b):
        slots = table[rows[i], : int(lens[i])]
        k = kv.k[slots].double().repeat_interleave(g, 1)  # (n, NQ, D)
        v = kv.v[slots].double().repeat_interleave(g, 1)
        s = torch.einsum("hd,nhd->hn", qd[i], k) * SHAPE.head_dim**-0.5
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, 1), v)
    return out.reshape(b, -1)


def rows_meta(runs: list[tuple[int, int]], max_ctx: int, slots: int, g: torch.Generator) -> ForwardMeta:
    """Runs (prefix, rows) of distinct requests: row j of a run at position prefix + j over its own table row."""
    table = torch.randperm(slots, generator=g)[: len(runs) * max_ctx].view(len(runs), max_ctx).to(torch.int32)
    req = torch.tensor([i for i, (_, n) in enumerate(runs) for _ in range(n)], dtype=torch.int64)
    pos = torch.tensor([p + j for p, n in runs for j in range(n)], dtype=torch.int64)
    lens = (pos + 1).to(torch.int32)
    loc = table[req, pos].to(torch.int64)
    return ForwardMeta(table.to(DEV), req.to(DEV), lens.to(DEV), pos.to(DEV), loc.to(DEV), max_seq_len=max_ctx)


def buffers(b: int, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    part_o = torch.full((b, SHAPE.num_heads, splits, SHAPE.head_dim), float("nan"), device=DEV)
    part_lse = torch.full((b, SHAPE.num_heads, splits), float("nan"), device=DEV)
    out = torch.full((b, SHAPE.q_size), float("nan"), device=DEV, dtype=BF16)
    return part_o, part_lse, out


def per_cache(fn: Any, kvs: list[KVCache], q: torch.Tensor, meta: ForwardMeta, part_o: torch.Tensor,
              part_lse: torch.Tensor, out: torch.Tensor, lc: ops.LaunchConfig, splits: int) -> None:
    """One attention launch (``fn``: ``ops.attention`` or ``ops.rows_attention``) per layer's KV cache."""
    for kv in kvs:
        fn(q, kv, meta, part_o, part_lse, out, SHAPE, lc, splits)


def replay_us(fn: Any, iters: int) -> float:
    if DEV.type == "cpu":
        fn()
        return 0.0
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e) * 1000)
    times.sort()
    return times[len(times) // 2]


def gpu_layer(g: torch.Generator) -> LayerWeights:
    def lin(o: int, i: int) -> torch.Tensor:
        return (torch.randn(o, i, generator=g, device=DEV) * i**-0.5).to(BF16)

    h = SHAPE.hidden_size
    return LayerWeights(
        input_norm=(1 + 0.1 * torch.randn(h, generator=g, device=DEV)).to(BF16), qkv=lin(SHAPE.qkv_size, h),
        o_proj=lin(h, SHAPE.q_size), post_norm=(1 + 0.1 * torch.randn(h, generator=g, device=DEV)).to(BF16),
        gate_up=lin(2 * SHAPE.intermediate_size, h), down=lin(h, SHAPE.intermediate_size),
        rope_inv_freq=rope_inv_freq(SHAPE.head_dim, 500000.0, DEV),
    )


def build(name: str, weights: list[LayerWeights], max_b: int, max_ctx: int) -> Any:
    from lowlat.plugins import amd, nvidia

    cfg: dict[str, Any] = {"pdl": "auto"} if name == "nvidia" else {"amd_mode": "persistent"}
    setup = detect_setup("LlamaForCausalLM", "bfloat16", device=DEV.type, max_context=max_ctx)
    ctx = BuildContext(SHAPE, tuple(weights), DEV, BF16, BF16, Coverage(max_tokens=max_b),
                       LowlatConfig(measured_coverage=False, **cfg), setup, max_ctx)
    return nvidia.build(ctx) if name == "nvidia" else amd.build(ctx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--check", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        global SHAPE, DEV, SCALE
        SHAPE = LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96)
        DEV, SCALE, args.layers = torch.device("cpu"), 64, 1
    t0 = time.time()
    lc = ops.LaunchConfig.for_device(DEV, SHAPE, use_pdl=False)
    seed = int(time.time())
    g = torch.Generator().manual_seed(seed)  # metadata (host)
    gd = torch.Generator(device=DEV).manual_seed(seed)  # tensors (fresh every run)
    res: dict[str, Any] = {"tag": args.tag, "seed": seed, "check": {}, "us": {}}
    slots = 8 * c(4096) + 64
    kvs = [KVCache(torch.randn(slots, SHAPE.num_kv_heads, SHAPE.head_dim, generator=gd, device=DEV).to(BF16),
                   torch.randn(slots, SHAPE.num_kv_heads, SHAPE.head_dim, generator=gd, device=DEV).to(BF16))
           for _ in range(3 if args.smoke else 32)]
    if args.check:
        meta = decode_meta([1, c(700), c(4096)], slots, c(4096), DEV, generator=g)
        q = torch.randn(3, SHAPE.q_size, generator=gd, device=DEV).to(BF16)
        ref = attention_f64(q, kvs[0], meta)
        for splits, fused in ((1, False), (5, False), (5, True)):
            part_o, part_lse, out = buffers(3, splits)
            counts = torch.zeros(3 * SHAPE.num_kv_heads, dtype=torch.int32, device=DEV) if fused else None
            ops.attention(q, kvs[0], meta, part_o, part_lse, out, SHAPE, lc, splits, counts=counts)
            res["check"][f"attention s{splits}{' fused' if fused else ''}"] = rel(out, ref)
        rmeta = rows_meta([(c(600), 6), (0, 2), (c(100), 1)], c(1024) + 8, slots, g)
        q = torch.randn(9, SHAPE.q_size, generator=gd, device=DEV).to(BF16)
        ref = attention_f64(q, kvs[1], rmeta)
        for splits, wide in ((1, False), (5, False), (16, True)):
            part_o, part_lse, out = buffers(9, splits)
            used = torch.zeros(9, dtype=torch.int32, device=DEV) if wide else None
            ops.rows_attention(q, kvs[1], rmeta, part_o, part_lse, out, SHAPE, lc, splits, used=used)
            res["check"][f"rows s{splits}{' wide' if wide else ''}"] = rel(out, ref)
        w = [gpu_layer(gd)]
        built = build("amd-persistent", w, 8, c(4096))
        meta = decode_meta([5, c(900), c(3000)], slots, c(4096), DEV, generator=g)
        x = torch.randn(3, SHAPE.hidden_size, generator=gd, device=DEV).to(BF16)
        kv = KVCache(kvs[2].k.clone(), kvs[2].v.clone())
        ref_kv = KVCache(kvs[2].k.float(), kvs[2].v.float())
        w32 = LayerWeights(**{f.name: t.float() for f in fields(LayerWeights)
                              if (t := getattr(w[0], f.name)) is not None})
        ref = reference_decoder_layer(x.float(), w32, ref_kv, meta, SHAPE)
        out = built.forward(0, x, kv, meta)
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        built.check_errors()
        res["check"]["amd-persistent layer (vs float32)"] = rel(out, ref)
        del built, kv, ref_kv
    print(f"[{args.tag}] checks {res['check']} [{time.time() - t0:.0f}s]", flush=True)

    # attention alone: 32 launches (one per KV cache) in a graph
    for b, ctx in ((1, 4096), (8, 4096), (32, 1024)):
        meta = decode_meta([c(ctx)] * b, slots, c(ctx), DEV, generator=g)
        splits = ops.num_splits(b, SHAPE, c(ctx), lc, 16)
        q = torch.randn(b, SHAPE.q_size, generator=gd, device=DEV).to(BF16)
        part_o, part_lse, out = buffers(b, splits)
        res["us"][f"attention b{b} ctx{ctx} s{splits}"] = replay_us(
            partial(per_cache, ops.attention, kvs, q, meta, part_o, part_lse, out, lc, splits), args.iters) / len(kvs)
    for name, runs in (("rows verify 6+2", [(c(600), 6), (0, 2)]), ("rows decode 8", [(c(600) + i, 1) for i in range(8)])):
        rmeta = rows_meta(runs, c(1024) + 8, slots, g)
        b = int(rmeta.seq_lens.shape[0])
        splits = ops.num_splits(b, SHAPE, c(608), lc, 16)
        q = torch.randn(b, SHAPE.q_size, generator=gd, device=DEV).to(BF16)
        part_o, part_lse, out = buffers(b, splits)
        res["us"][f"{name} ctx{c(608)} s{splits}"] = replay_us(
            partial(per_cache, ops.rows_attention, kvs, q, rmeta, part_o, part_lse, out, lc, splits), args.iters) / len(kvs)
    print(f"[{args.tag}] attention done [{time.time() - t0:.0f}s]", flush=True)

    # decode step: an --layers stack in one graph
    weights = [gpu_layer(gd) for _ in range(args.layers)]
    for plugin in ("nvidia", "amd-persistent"):
        built = build(plugin, weights, 8, c(4096))
        for b in (1, 8):
            meta = decode_meta([c(4096)] * b, slots, c(4096), DEV, generator=g)
            meta = replace(meta, req_to_token=meta.req_to_token.contiguous())
            x0 = torch.randn(b, SHAPE.hidden_size, generator=gd, device=DEV).to(BF16)

            def step(built: Any = built, meta: ForwardMeta = meta, x0: torch.Tensor = x0) -> None:
                x = x0
                for i in range(args.layers):
                    x = built.forward(i, x, kvs[i], meta)

            res["us"][f"step {plugin} b{b} ctx4096 (per layer)"] = replay_us(step, args.iters) / args.layers
            if plugin == "amd-persistent":
                built.check_errors()
        del built
    print(f"[{args.tag}] done [{time.time() - t0:.0f}s]", flush=True)
    for k, v in res["us"].items():
        print(f"[{args.tag}] {k:40s} {v:8.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
