"""Decode attention when rows share a cached prefix (radix hits): does the L2 cache already
serve the shared pages, or does every row read its prefix from HBM?

Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16), one layer's call of
`lmserver.kernels.decode_attention` at `--batch` rows of `--prefix + --suffix` tokens, three
slot layouts: `distinct` (no sharing: every row has its own slots), `shared-grouped` (groups of
`--group` rows share their first `--prefix` slots; a group's rows are adjacent in the batch) and
`shared-shuffled` (the same sharing, rows in random order). Prints us per call and the HBM
bandwidth the call would need if every row read its KV from memory.

    python benchmarks/kernels/bench_shared_prefix_decode.py [--batch 256 --prefix 2048 --suffix 256 --group 16]
"""

from __future__ import annotations

import argparse

import torch

from lmserver.kernels.decode_attention import choose_num_kv_splits, decode_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bs, heads, kv_heads, d = args.batch, 32, 8, 128
    ctx = args.prefix + args.suffix
    groups = -(-bs // args.group)
    slots_distinct = bs * ctx + 1
    k = torch.randn(slots_distinct, kv_heads, d, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(slots_distinct, kv_heads, d, device=dev, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(bs, heads, d, device=dev, dtype=torch.bfloat16, generator=gen)
    seq_lens = torch.full((bs,), ctx, device=dev, dtype=torch.int32)
    rows = torch.arange(bs, device=dev)
    distinct = (1 + torch.arange(bs * ctx, device=dev, dtype=torch.int32)).view(bs, ctx)
    shared = distinct.clone()
    for b in range(bs):  # rows of group g take group g's prefix slots (those of its first row)
        shared[b, : args.prefix] = distinct[(b // args.group) * args.group, : args.prefix]
    perm = torch.randperm(bs, device=dev, generator=gen)
    splits = choose_num_kv_splits(bs, kv_heads, torch.cuda.get_device_properties(dev).multi_processor_count)
    bytes_all = bs * ctx * kv_heads * d * 2 * 2
    bytes_unique = (groups * args.prefix + bs * args.suffix) * kv_heads * d * 2 * 2
    print(f"batch {bs}, {groups} groups of {args.group}, context {ctx} ({args.prefix} shared), splits {splits}")
    print(f"KV bytes per call: {bytes_all / 1e9:.3f} GB read per row, {bytes_unique / 1e9:.3f} GB distinct")
    outs = {}
    for name, table, idx in (("distinct", distinct, rows), ("shared-grouped", shared, rows),
                             ("shared-shuffled", shared, perm)):
        outs[name], us = time_call(q[idx], k, v, table, idx, seq_lens, splits, args.iters)
        print(f"{name:>16}: {us:8.1f} us per call, {bytes_all / us / 1e3:7.0f} GB/s if every row read from HBM, "
              f"{bytes_unique / us / 1e3:7.0f} GB/s of distinct bytes", flush=True)
    # the same rows in another order give the same results (row b of the shuffled run is row perm[b])
    assert torch.equal(outs["shared-shuffled"], outs["shared-grouped"][perm])


def time_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, idx: torch.Tensor,
              seq_lens: torch.Tensor, splits: int, iters: int) -> tuple[torch.Tensor, float]:
    """(output, us per call) of decode_attention replayed `iters` times in one CUDA graph."""
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    for _ in range(3):
        decode_attention(q, k, v, table, idx, seq_lens, scale, out=out, num_kv_splits=splits)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            decode_attention(q, k, v, table, idx, seq_lens, scale, out=out, num_kv_splits=splits)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return out, 1e3 * start.elapsed_time(end) / iters

if __name__ == "__main__":
    main()
