"""Radix management time on a workload with no sharing (the paper's ablation: 0.2 s of a 74.3 s run).

Runs the offline `lmserver.Engine` (the same scheduler and KV manager as the server) on prompts of
random token ids, so no prefix is shared and the cache can only cost, with the radix cache on
and off, and reports the engine's own host time in the KV manager, in two parts:

- `radix_time_s`: radix-tree work (prefix matching, locking, insertion, eviction, and the `lpm`
  peeks that order the waiting queue in each round with a free request row): the paper's radix management time;
- `slot_time_s`: slot bookkeeping (KV slot allocation and freeing, the requests' slot arrays),
  work that runs with the radix cache off too.

Their sum is the KV manager's whole host time (what `radix_time_s` alone counted before the
split). Each is shown as a share of the wall time and in microseconds per request.

    python benchmarks/programs/bench_radix_overhead.py [--num-prompts 64 --input-len 256 --output-len 32]
        [--model-path DIR --load-format dummy --device cuda --dtype bfloat16 --concurrency 256]
    python benchmarks/programs/bench_radix_overhead.py --host-only --num-prompts 512 --concurrency 256

`--host-only` drives the scheduler and KV manager without a model (each forward returns a random
token at once), so only host bookkeeping runs: the per-request costs then show without the
forward's time, and the wall time is the scheduler's own.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any


def _engine_row(args: argparse.Namespace, disable: bool, rng: random.Random) -> dict[str, Any]:
    import torch

    from lmserver import Engine

    torch.set_num_threads(args.threads)
    engine = Engine(model_path=args.model_path, load_format=args.load_format, dtype=args.dtype,
                    device=args.device, max_running_requests=args.concurrency,
                    disable_radix_cache=disable)
    vocab = engine.core.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=[[99] * 8], sampling_params=params)  # warm-up (ids < 100: shares nothing)
    before = engine.core.get_stats()
    start = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - start
    after = engine.core.get_stats()
    engine.shutdown()
    cached = sum(o["meta_info"]["cached_tokens"] for o in out)
    return {"wall_s": wall, "cached_tokens": cached,
            "radix_time_s": after["radix_time_s"] - before["radix_time_s"],
            "slot_time_s": after.get("slot_time_s", 0.0) - before.get("slot_time_s", 0.0)}


def _host_only_row(args: argparse.Namespace, disable: bool, rng: random.Random) -> dict[str, Any]:
    """The engine loop with a stand-in forward: schedule, commit, append a token, finish."""
    from lmserver.io_struct import SamplingParams
    from lmserver.scheduler import KVManager, Req, Scheduler

    kv = KVManager(args.num_slots, 1, disable)
    sched = Scheduler(kv, max_running_requests=args.concurrency)
    for i in range(args.num_prompts):
        ids = [rng.randrange(100, 49152) for _ in range(args.input_len)]
        sched.add(Req(f"r{i}", ids, SamplingParams(max_new_tokens=args.output_len), args.output_len, arrival=i))
    start = time.perf_counter()
    while sched.has_work():
        decision = sched.schedule()
        sched.commit(decision)
        for item in decision.items:
            req = sched.reqs.get(item.rid)
            if req is None or item.prefix_len + len(item.token_ids) != req.fill_len:
                continue  # a prefill chunk that does not end the prompt samples nothing
            if req.remaining_new_tokens > 0:
                req.output_ids.append(rng.randrange(100, 49152))
            if req.remaining_new_tokens == 0:
                sched.finish(req, {"type": "length"})
    wall = time.perf_counter() - start
    sched.check_memory_invariant()
    stats = sched.stats()
    return {"wall_s": wall, "cached_tokens": 0, "radix_time_s": stats["radix_time_s"],
            "slot_time_s": stats["slot_time_s"]}


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
    ap.add_argument("--host-only", action="store_true", help="no model: scheduler and KV manager only")
    ap.add_argument("--num-slots", type=int, default=1 << 20, help="KV slots with --host-only")
    args = ap.parse_args()
    rows = []
    for disable in (False, True):
        rng = random.Random(0)  # the same prompts for both
        row = (_host_only_row if args.host_only else _engine_row)(args, disable, rng)
        n = args.num_prompts
        row = {"radix_cache": "off" if disable else "on", "requests": n, **row,
               "radix_share_pct": 100 * row["radix_time_s"] / row["wall_s"],
               "slot_share_pct": 100 * row["slot_time_s"] / row["wall_s"],
               "radix_us_per_req": 1e6 * row["radix_time_s"] / n, "slot_us_per_req": 1e6 * row["slot_time_s"] / n}
        rows.append(row)
        print("row", json.dumps(rows[-1]), flush=True)
    print("| radix cache | requests | wall s | radix tree s (share, us/request) | slot bookkeeping s "
          "(share, us/request) | cached tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['radix_cache']} | {r['requests']} | {r['wall_s']:.2f} | {r['radix_time_s']:.4f} "
              f"({r['radix_share_pct']:.3f}%, {r['radix_us_per_req']:.1f}) | {r['slot_time_s']:.4f} "
              f"({r['slot_share_pct']:.3f}%, {r['slot_us_per_req']:.1f}) | {r['cached_tokens']} |")


if __name__ == "__main__":
    main()
