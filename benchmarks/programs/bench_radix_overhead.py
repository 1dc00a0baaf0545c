"""Radix management time on a workload with no sharing (the paper's ablation: 0.2 s of a 74.3 s run).

Runs the offline `lmserver.Engine` (the same scheduler and KV manager as the server) on prompts of
random token ids, so no prefix is shared and the cache can only cost, with the radix cache on
and off, and reports the engine's own `radix_time_s` (host time in prefix matching, locking,
insertion, eviction and the slot bookkeeping around them) as a share of the wall time.

    python benchmarks/programs/bench_radix_overhead.py [--num-prompts 64 --input-len 256 --output-len 32]
        [--model-path DIR --load-format dummy --device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from lmserver import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32, help="max running requests")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    rows = []
    for disable in (False, True):
        engine = Engine(model_path=args.model_path, load_format=args.load_format, dtype=args.dtype,
                        device=args.device, max_running_requests=args.concurrency,
                        disable_radix_cache=disable)
        vocab = engine.core.vocab_size
        prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
        params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=[prompts[0][:8]], sampling_params=params)  # warm-up
        before = engine.core.get_stats()["radix_time_s"]
        start = time.perf_counter()
        out = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - start
        radix = engine.core.get_stats()["radix_time_s"] - before
        cached = sum(o["meta_info"]["cached_tokens"] for o in out)
        engine.shutdown()
        rows.append({"radix_cache": "off" if disable else "on", "requests": len(prompts), "wall_s": wall,
                     "radix_time_s": radix, "radix_share_pct": 100 * radix / wall, "cached_tokens": cached})
        print("row", json.dumps(rows[-1]), flush=True)
    print("| radix cache | requests | wall s | radix management s | share of run time | cached tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['radix_cache']} | {r['requests']} | {r['wall_s']:.2f} | {r['radix_time_s']:.4f} | "
              f"{r['radix_share_pct']:.3f}% | {r['cached_tokens']} |")


if __name__ == "__main__":
    main()
