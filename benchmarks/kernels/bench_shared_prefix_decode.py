"""Decode attention when rows share a cached prefix (radix hits): the plain flash-decoding kernel
(every row reads its whole KV) against cascade decode attention (a group's shared prefix read once
per chunk of rows), one layer in a CUDA graph.

Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16). At `--batch` rows of
`--prefix + --suffix` tokens, slot layouts: `distinct` (no sharing), `shared-grouped` (groups of
`--group` rows share their first `--prefix` slots; a group's rows are adjacent in the batch) and
`shared-shuffled` (the same sharing, rows in random order). Every timed call is first checked
against the float64 torch reference (max abs error). Then the same kernels at batch 1/8/64 with
nothing shared (the engine runs the plain kernel there; cascade with no group is shown for the
record). Prints a table of us per call, the bandwidth of the bytes a call must read and the
host time of the shared-prefix planner.

    python benchmarks/kernels/bench_shared_prefix_decode.py [--batch 256 --prefix 2048 --suffix 256 --group 16]
        [--sweep]   # also cascade launch parameters (block_n, warps, shared programs per SM)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from lmserver.kernels.cascade_decode import CascadeMetadata, cascade_decode_attention
from lmserver.kernels.decode_attention import choose_num_kv_splits, decode_attention
from lmserver.kernels.reference import decode_attention_ref
from lmserver.runner.attention.shared_prefix import SharedPrefixPlanner

HEADS, KV_HEADS, DIM = 32, 8, 128


def graph_us(fn: Callable[[], object], iters: int) -> float:
    """us per call of `fn` replayed `iters` times in one CUDA graph (after a warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


class Case:
    """One batch layout: q, caches, the request table and its sharing groups (batch rows)."""

    def __init__(self, bs: int, prefix: int, suffix: int, group: int, shared: bool, shuffled: bool,
                 gen: torch.Generator, k: torch.Tensor, v: torch.Tensor) -> None:
        dev = k.device
        ctx = prefix + suffix
        self.bs, self.ctx = bs, ctx
        self.q = torch.randn(bs, HEADS, DIM, device=dev, dtype=k.dtype, generator=gen)
        self.seq_lens = torch.full((bs,), ctx, device=dev, dtype=torch.int32)
        table = (1 + torch.arange(bs * ctx, device=dev, dtype=torch.int32)).view(bs, ctx)
        member_of = list(range(bs))
        if shuffled:
            member_of = torch.randperm(bs, device="cpu", generator=torch.Generator().manual_seed(1)).tolist()
        self.groups: list[tuple[list[int], int]] = []
        if shared:
            firsts = table[:, :prefix].clone()
            by_group: dict[int, list[int]] = {}
            for b in range(bs):  # batch row b is member m of group m // group: that group's prefix slots
                m = member_of[b]
                table[b, :prefix] = firsts[(m // group) * group]
                by_group.setdefault(m // group, []).append(b)
            self.groups = [(rows, prefix) for rows in by_group.values()]
        self.table = table
        self.rows = torch.arange(bs, device=dev)
        self.k, self.v = k, v
        distinct_tokens = bs * ctx - sum((len(r) - 1) * p for r, p in self.groups)
        self.bytes_all = bs * ctx * KV_HEADS * DIM * 2 * k.element_size()
        self.bytes_distinct = distinct_tokens * KV_HEADS * DIM * 2 * k.element_size()

    def reference(self) -> torch.Tensor:
        return decode_attention_ref(self.q, self.k, self.v, self.table, self.rows, self.seq_lens, DIM**-0.5)


def plain_fn(c: Case, num_sms: int) -> tuple[Callable[[], object], torch.Tensor]:
    splits = choose_num_kv_splits(c.bs, KV_HEADS, num_sms)
    out = torch.empty_like(c.q)
    p_out = torch.empty(c.bs, HEADS, splits, DIM, dtype=torch.float32, device=c.q.device)
    p_lse = torch.empty(c.bs, HEADS, splits, dtype=torch.float32, device=c.q.device)

    def fn() -> object:
        return decode_attention(c.q, c.k, c.v, c.table, c.rows, c.seq_lens, DIM**-0.5, out=out, num_kv_splits=splits,
                                partial_out=p_out, partial_lse=p_lse)

    return fn, out


def cascade_fn(c: Case, num_sms: int, block_n: int = 64, num_warps: int = 4, programs_per_sm: int = 2,
               shared_splits: int = 8, chunk_rows: int = 16) -> tuple[Callable[[], object], torch.Tensor]:
    """As the engine's triton backend calls it (TritonBackend.cascade_metadata's sizes)."""
    splits = choose_num_kv_splits(c.bs, KV_HEADS, num_sms)
    target = -(-programs_per_sm * num_sms // KV_HEADS)
    meta = CascadeMetadata(c.bs, max(-(-2 * c.bs // 3), target), shared_splits, chunk_rows, c.q.device,
                           target_work=target)
    meta.write(c.groups)
    out = torch.empty_like(c.q)
    n = shared_splits + splits
    p_out = torch.empty(c.bs, HEADS, n, DIM, dtype=torch.float32, device=c.q.device)
    p_lse = torch.empty(c.bs, HEADS, n, dtype=torch.float32, device=c.q.device)

    def fn() -> object:
        return cascade_decode_attention(c.q, c.k, c.v, c.table, c.rows, c.seq_lens, DIM**-0.5, meta, out=out,
                                        num_kv_splits=splits, partial_out=p_out, partial_lse=p_lse, block_n=block_n,
                                        num_warps=num_warps)

    return fn, out


def run(name: str, c: Case, fn_out: tuple[Callable[[], object], torch.Tensor], want: torch.Tensor, iters: int,
        rows: list[str]) -> float:
    fn, out = fn_out
    fn()
    torch.cuda.synchronize()
    err = (out.double() - want.double()).abs().max().item()
    assert err < 3e-2, f"{name}: max abs error {err} vs the float64 reference"
    us = graph_us(fn, iters)
    rows.append(f"| {name} | {c.bs} | {c.ctx} | {us:8.1f} | {c.bytes_all / us / 1e3:6.0f} | "
                f"{c.bytes_distinct / us / 1e3:6.0f} | {err:.1e} |")
    print(rows[-1], flush=True)
    return us


def planner_host_us(bs: int, prefix: int, suffix: int, group: int) -> tuple[float, float]:
    """Host time of SharedPrefixPlanner.plan for the benchmark's layout: (a fresh plan, a cached step)."""
    ctx = prefix + suffix
    planner = SharedPrefixPlanner(bs + 1, ctx + 8)
    for b in range(bs):
        g = b // group
        planner.record(b, 0, [*range(1 + g * prefix, 1 + (g + 1) * prefix),
                              *range(10**7 + b * suffix, 10**7 + (b + 1) * suffix - 1)])
    rows, lens = list(range(bs)), [ctx] * bs
    planner.plan(rows, lens)  # warm-up (numpy's first calls)
    t0 = time.perf_counter()
    for _ in range(5):
        planner.epoch += 1  # forces a fresh plan
        planner.plan(rows, lens)
    fresh = (time.perf_counter() - t0) / 5 * 1e6
    t0 = time.perf_counter()
    for _ in range(200):
        planner.plan(rows, lens)
    cached = (time.perf_counter() - t0) / 200 * 1e6
    return fresh, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also cascade launch parameters")
    args = ap.parse_args()
    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    bs, ctx = args.batch, args.prefix + args.suffix
    slots = bs * ctx + 1
    k = torch.randn(slots, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(slots, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; batch {bs}, groups of {args.group}, "
          f"context {ctx} ({args.prefix} shared)")
    rows = ["| kernel / layout | rows | context | us per call | GB/s if every row read | GB/s of distinct bytes "
            "| max abs err |", "|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    distinct = Case(bs, args.prefix, args.suffix, args.group, False, False, gen, k, v)
    grouped = Case(bs, args.prefix, args.suffix, args.group, True, False, gen, k, v)
    shuffled = Case(bs, args.prefix, args.suffix, args.group, True, True, gen, k, v)
    times = {}
    for label, c in (("distinct", distinct), ("shared-grouped", grouped), ("shared-shuffled", shuffled)):
        want = c.reference()
        times[f"plain {label}"] = run(f"plain, {label}", c, plain_fn(c, num_sms), want, args.iters, rows)
        times[f"cascade {label}"] = run(f"cascade, {label}", c, cascade_fn(c, num_sms), want, args.iters, rows)
        if args.sweep and c.groups:
            for block_n in (32, 64, 128):
                for warps in (4, 8):
                    for per_sm in (1, 2, 4):
                        run(f"cascade, {label}, block_n {block_n}, warps {warps}, {per_sm} programs/SM", c,
                            cascade_fn(c, num_sms, block_n, warps, per_sm), want, args.iters, rows)
    # nothing shared, decode shapes of benchmarks 1 and 3: the engine keeps the plain kernel there;
    # and small batches that share (parallel samples of one prompt)
    for small in (1, 8, 64):
        c = Case(small, args.prefix, args.suffix, args.group, False, False, gen, k, v)
        want = c.reference()
        run("plain, distinct", c, plain_fn(c, num_sms), want, args.iters, rows)
        run("cascade (no group), distinct", c, cascade_fn(c, num_sms), want, args.iters, rows)
        if small > 1:
            c = Case(small, args.prefix, args.suffix, min(small, args.group), True, False, gen, k, v)
            want = c.reference()
            run(f"plain, shared by {min(small, args.group)}", c, plain_fn(c, num_sms), want, args.iters, rows)
            run(f"cascade, shared by {min(small, args.group)}", c, cascade_fn(c, num_sms), want, args.iters, rows)
    fresh, cached = planner_host_us(bs, args.prefix, args.suffix, args.group)
    print(f"\nshared-grouped: cascade {times['cascade shared-grouped']:.1f} us vs plain {times['plain shared-grouped']:.1f} us "
          f"({times['plain shared-grouped'] / times['cascade shared-grouped']:.2f}x); shuffled "
          f"{times['plain shared-shuffled'] / times['cascade shared-shuffled']:.2f}x; distinct (no group) "
          f"{times['plain distinct'] / times['cascade distinct']:.2f}x")
    print(f"planner host time at {bs} rows: {fresh:.0f} us for a fresh plan, {cached:.1f} us for a cached step")


if __name__ == "__main__":
    main()
