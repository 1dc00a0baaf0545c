"""Fresh-prompt (no cached prefix) causal attention on a GPU: our Triton extend kernel next to torch's SDPA backends.

A prefill of prompts without a radix hit is plain causal attention per request; this times, for the Llama-3-8B
attention shape (32 query heads, 8 KV heads, head_dim 128, bf16), the extend kernel as the backend launches it
(`has_prefix=False`) with its default tile and launch order and variants, against `torch.nn.functional.
scaled_dot_product_attention` on the cuDNN, flash and memory-efficient backends, each called per request on views of
the packed (tokens, heads, dim) tensors and writing the packed output (the layout transposes are in the timing).
Every variant is checked against `reference.extend_attention_ref` (float64 softmax) before it is timed
(CUDA-graph replays, median; eager where a backend cannot be captured).

    python benchmarks/kernels/bench_prefill_attention.py [--lens 4096 2048,2048 8192] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_kernels import rel_error, time_graph  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128


def packed_inputs(lens: list[int]) -> dict:
    total = sum(lens)
    dt, dev = torch.bfloat16, "cuda"
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return {
        "q": torch.randn(total, HEADS, DIM, dtype=dt, device=dev),
        "k": torch.randn(total, KV_HEADS, DIM, dtype=dt, device=dev),
        "v": torch.randn(total, KV_HEADS, DIM, dtype=dt, device=dev),
        "lens": lens, "starts": starts,
        "req_to_token": torch.zeros(len(lens), max(lens), dtype=torch.int32, device=dev),
        "req_pool_indices": torch.arange(len(lens), device=dev),
        "prefix_lens": torch.zeros(len(lens), dtype=torch.int64, device=dev),
        "seq_lens": torch.tensor(lens, device=dev),
        "start_loc": torch.tensor(starts, device=dev),
    }


def triton_variant(**kw) -> Callable[[dict, torch.Tensor], None]:
    from lmserver.kernels.extend_attention import extend_attention

    def run(x: dict, out: torch.Tensor) -> None:
        extend_attention(x["q"], x["k"], x["v"], x["k"], x["v"], x["req_to_token"], x["req_pool_indices"],
                         x["prefix_lens"], x["seq_lens"], x["start_loc"], DIM**-0.5, max(x["lens"]), out=out,
                         has_prefix=False, **kw)
    return run


def sdpa_variant(backend: str, gqa: bool) -> Callable[[dict, torch.Tensor], None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    which = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    group = HEADS // KV_HEADS

    def run(x: dict, out: torch.Tensor) -> None:
        with sdpa_kernel(which):
            for start, n in zip(x["starts"], x["lens"], strict=True):
                q = x["q"][start:start + n].transpose(0, 1).unsqueeze(0)  # (1, H, n, D), a view
                k = x["k"][start:start + n].transpose(0, 1).unsqueeze(0)
                v = x["v"][start:start + n].transpose(0, 1).unsqueeze(0)
                if not gqa:
                    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=DIM**-0.5,
                                                                     enable_gqa=gqa)
                out[start:start + n].copy_(o.squeeze(0).transpose(0, 1))
    return run


def served_variant() -> Callable[[dict, torch.Tensor], None]:
    """`prefill_sdpa.causal_prefill` as the model calls it: q, k, v views of one packed qkv projection output."""
    from lmserver.kernels.prefill_sdpa import causal_prefill
    views: dict[int, tuple[torch.Tensor, ...]] = {}

    def run(x: dict, out: torch.Tensor) -> None:
        if id(x) not in views:  # the copy into the packed layout is made once per input set, outside the timing
            qkv = torch.cat([x["q"].flatten(1), x["k"].flatten(1), x["v"].flatten(1)], dim=1)
            q_w, kv_w = HEADS * DIM, KV_HEADS * DIM
            views[id(x)] = (qkv[:, :q_w].view(-1, HEADS, DIM), qkv[:, q_w:q_w + kv_w].view(-1, KV_HEADS, DIM),
                            qkv[:, q_w + kv_w:].view(-1, KV_HEADS, DIM))
        causal_prefill(*views[id(x)], x["lens"], DIM**-0.5, out)
    return run


VARIANTS: dict[str, Callable[[], Callable[[dict, torch.Tensor], None]]] = {
    "triton 64x64 w4 s3 light-first": lambda: triton_variant(heavy_first=False),
    "triton 64x64 w4 s3 heavy-first (default)": lambda: triton_variant(),
    "triton 128x64 w8 s3 heavy-first": lambda: triton_variant(block_m=128, block_n=64, num_warps=8, heavy_first=True),
    "triton 128x128 w8 s2 heavy-first": lambda: triton_variant(block_m=128, block_n=128, num_warps=8, num_stages=2,
                                                               heavy_first=True),
    "sdpa cudnn gqa": lambda: sdpa_variant("cudnn", True),
    "prefill_sdpa on qkv views": lambda: served_variant(),
    "sdpa cudnn expanded": lambda: sdpa_variant("cudnn", False),
    "sdpa flash gqa": lambda: sdpa_variant("flash", True),
    "sdpa efficient expanded": lambda: sdpa_variant("efficient", False),
}


def first_calls(n: int) -> int:
    """Wall ms of the first and the second `prefill_sdpa.causal_prefill` call at each of n new prompt lengths."""
    import os
    import random
    import statistics
    import time

    from lmserver.kernels.prefill_sdpa import causal_prefill

    rng = random.Random(1)
    lengths = rng.sample(range(2048, 8192), n)
    firsts, seconds = [], []
    for length in lengths:
        x = packed_inputs([length])
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            causal_prefill(x["q"], x["k"], x["v"], [length], DIM**-0.5)
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
        firsts.append(times[0])
        seconds.append(times[1])
    env = os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "unset")
    print(f"TORCH_CUDNN_SDPA_AVOID_RECOMPILE={env}: {n} new lengths, first call ms median "
          f"{statistics.median(firsts):.2f} max {max(firsts):.2f}; second call median {statistics.median(seconds):.2f}"
          f" max {max(seconds):.2f}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lens", nargs="+", default=["4096", "2048,2048", "8192", "1024"],
                        help="batches: comma-separated prompt lengths of one prefill batch")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), help="which (names of VARIANTS)")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--first-calls", type=int, default=0,
                        help="instead: this many prompts of new lengths (2,048-8,191) through prefill_sdpa, the wall "
                             "time of each one's first and second call (a backend that plans per shape pays at the "
                             "first; TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 in the environment: torch's length-agnostic plans)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_prefill_attention needs a CUDA device.")
        return 2
    from lmserver.kernels.prefill_sdpa import length_agnostic_plans

    # TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 in the environment: torch's length-agnostic plans (q / k / v copied first)
    print(f"length-agnostic cuDNN plans: {length_agnostic_plans()}", flush=True)
    if args.first_calls:
        return first_calls(args.first_calls)
    from lmserver.kernels.reference import extend_attention_ref

    torch.manual_seed(0)
    rows = []
    for spec in args.lens:
        lens = [int(n) for n in spec.split(",")]
        sets = [packed_inputs(lens) for _ in range(2)]
        x0 = sets[0]
        ref = extend_attention_ref(x0["q"], x0["k"], x0["v"], x0["k"], x0["v"], x0["req_to_token"],
                                   x0["req_pool_indices"], x0["prefix_lens"], x0["seq_lens"], x0["start_loc"],
                                   DIM**-0.5)
        flops = sum(4 * HEADS * DIM * n * (n + 1) / 2 for n in lens)
        print(f"prompts {spec}: {flops / 1e9:.1f} GFLOP (causal)", flush=True)
        for name in args.variants:
            outs = [torch.empty_like(x["q"]) for x in sets]
            try:
                run = VARIANTS[name]()
                run(x0, outs[0])
                torch.cuda.synchronize()
                err = rel_error(outs[0], ref)
                us = time_graph(lambda i, run=run, outs=outs, sets=sets: run(sets[i % 2], outs[i % 2]), 2) if err < 2e-2 \
                    else float("inf")
            except Exception as exc:  # a backend this build or GPU lacks: the row says so
                err, us = float("nan"), float("inf")
                print(f"  {name}: failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                rows.append({"lens": spec, "variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            tflops = flops / (us * 1e-6) / 1e12
            print(f"  {name:36s} err {err:.1e}  {us:9.1f} us  {tflops:6.0f} TFLOP/s", flush=True)
            rows.append({"lens": spec, "variant": name, "err": err, "us": us, "tflops": tflops})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
