"""Multi-turn chat whose histories outgrow the device KV pool, with and without the host tier.

Issue 31's measurement: `--conversations` chats of `--turns` turns (a system prompt, user turns
of random token ids, `--output-len` greedy tokens each, `ignore_eos`), served round by round
(every chat's turn k before any chat's turn k + 1, `--concurrency` requests at a time), so a
chat's history is pushed out of a small device pool (`--max-total-tokens`) by the other chats
before its next turn. Without the tier each turn recomputes its history; with
`--enable-hierarchical-cache` it is loaded back from the host pool. One process, one engine per
setting in turn (the offline engine's core driven directly: TTFT is the time from a request's
submission to the step that returns its first token).

    python benchmarks/serving/bench_hicache.py --model-path .devdata/llama8b \\
        --engine-args "--load-format dummy --dtype bfloat16 --device cuda" --max-total-tokens 20000 \\
        --host-kv-size-gb 10 --json $OUT/hicache.json

Prints one row per setting (wall time, requests/s, output and prompt tokens/s, TTFT p50/p90,
cache hit rate, host-tier counters) and the ratios tier / plain. The `control` setting is the
same server with a device pool that holds the whole working set (`--control-total-tokens`, default
the working set plus a margin): nothing is evicted, so every setting's greedy outputs should equal
its outputs token for token (the exactness check of the tier: same weights, KV reused in both).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from typing import Any

from lmserver.engine.offline import Engine
from lmserver.io_struct import GenerateReq, SamplingParams


def _engine_kwargs(text: str) -> dict[str, Any]:
    """`--load-format dummy --dtype bfloat16` -> {"load_format": "dummy", "dtype": "bfloat16"}."""
    out: dict[str, Any] = {}
    parts = text.split()
    i = 0
    while i < len(parts):
        key = parts[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(parts) and not parts[i + 1].startswith("--"):
            value: Any = parts[i + 1]
            for cast in (int, float):
                try:
                    value = cast(value)
                    break
                except ValueError:
                    pass
            out[key] = value
            i += 2
        else:
            out[key] = True
            i += 1
    return out


def _workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(100, vocab) for _ in range(args.system_len)] for _ in range(args.conversations)]
    users = [[[rng.randrange(100, vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    return systems, users


def run_setting(args: argparse.Namespace, name: str, extra: dict[str, Any]) -> dict[str, Any]:
    kwargs = {"max_total_tokens": args.max_total_tokens, **_engine_kwargs(args.engine_args), **extra}
    t0 = time.perf_counter()
    engine = Engine(args.model_path, max_running_requests=args.concurrency,
                    cuda_graph_max_bs=args.concurrency, context_length=args.context_length, **kwargs)
    start_s = time.perf_counter() - t0
    core = engine.core
    try:
        vocab = core.vocab_size
        systems, users = _workload(args, vocab)
        params = SamplingParams.from_dict({"temperature": 0.0, "max_new_tokens": args.output_len, "ignore_eos": True})
        # warm-up (kernels, graphs) on a prompt of its own, then an empty cache
        warm = GenerateReq("warm", [7] * 64, params)
        core.add_request(warm)
        while core.has_work():
            core.step()
        assert core.flush_cache()
        stats0 = core.get_stats()
        histories = [list(s) for s in systems]
        order = [(t, c) for t in range(args.turns) for c in range(args.conversations)]
        done_turns = [0] * args.conversations  # turns finished per chat
        outputs: dict[str, list[int]] = {}
        submitted: dict[str, float] = {}
        ttft: dict[str, float] = {}
        running: dict[str, int] = {}
        prompt_tokens = 0
        nxt = 0
        t_start = time.perf_counter()
        while nxt < len(order) or running:
            while nxt < len(order) and len(running) < args.concurrency:
                t, c = order[nxt]
                if done_turns[c] != t:  # its previous turn still runs
                    break
                histories[c] = histories[c] + users[c][t]
                rid = f"c{c}t{t}"
                core.add_request(GenerateReq(rid, list(histories[c]), params))
                prompt_tokens += len(histories[c])
                submitted[rid] = time.perf_counter()
                running[rid] = c
                outputs[rid] = []
                nxt += 1
            for out in core.step():
                if out.rid not in running:
                    continue
                if out.new_token_ids and out.rid not in ttft:
                    ttft[out.rid] = time.perf_counter() - submitted[out.rid]
                outputs[out.rid].extend(out.new_token_ids)
                if out.finished:
                    c = running.pop(out.rid)
                    histories[c] = histories[c] + outputs[out.rid]
                    done_turns[c] += 1
        wall = time.perf_counter() - t_start
        stats = core.get_stats()
        core.check_memory_invariant()
    finally:
        engine.shutdown()
        del engine, core
        gc.collect()
        try:
            import torch

            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - CPU-only torch
            pass
    out_tokens = sum(len(v) for v in outputs.values())
    t_sorted = sorted(ttft.values())
    row = {
        "setting": name, "startup_s": round(start_s, 1), "wall_s": wall, "requests": len(outputs),
        "req_per_s": len(outputs) / wall, "output_tok_per_s": out_tokens / wall, "prompt_tok_per_s": prompt_tokens / wall,
        "ttft_p50_ms": 1000 * statistics.median(t_sorted), "ttft_p90_ms": 1000 * t_sorted[int(0.9 * (len(t_sorted) - 1))],
        "cache_hit_rate": (stats["cached_tokens"] - stats0["cached_tokens"]) / max(1, stats["prompt_tokens"] - stats0["prompt_tokens"]),
        **{k: v for k, v in stats.items() if k.startswith("hicache_")},
        "outputs": outputs,
    }
    print(f"{name:8s} wall {wall:7.1f} s  req/s {row['req_per_s']:6.2f}  out tok/s {row['output_tok_per_s']:8.1f}  "
          f"prompt tok/s {row['prompt_tok_per_s']:9.0f}  TTFT p50 {row['ttft_p50_ms']:8.1f} ms  p90 {row['ttft_p90_ms']:8.1f} ms  "
          f"hit {row['cache_hit_rate']:.3f}  host hits {row.get('hicache_host_hits', '-')}  "
          f"loaded {row.get('hicache_loaded_tokens', '-')}  offloaded {row.get('hicache_offloaded_tokens', '-')}  "
          f"(startup {start_s:.1f} s)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--engine-args", default="", help="ServerConfig fields as CLI flags, e.g. '--dtype bfloat16'")
    ap.add_argument("--max-total-tokens", type=int, default=20000, help="the device KV pool (tokens)")
    ap.add_argument("--host-kv-size-gb", type=float, default=None)
    ap.add_argument("--write-policy", default="write_back", choices=["write_back", "write_through"])
    ap.add_argument("--io-backend", default="auto", choices=["auto", "kernel", "direct"])
    ap.add_argument("--control-total-tokens", type=int, default=None,
                    help="the control's device pool (default: the working set plus 10%% and 4,096 tokens)")
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settings", nargs="+", default=["hicache", "plain", "control"],
                    choices=["hicache", "plain", "control"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    final = args.system_len + args.turns * (args.user_len + args.output_len)
    print(f"{args.conversations} chats x {args.turns} turns, final history {final} tokens, working set "
          f"{args.conversations * final} tokens = {args.conversations * final / args.max_total_tokens:.2f}x the device "
          f"pool ({args.max_total_tokens}); concurrency {args.concurrency}", flush=True)
    rows = []
    for name in args.settings:
        extra: dict[str, Any] = {}
        if name == "hicache":
            extra = {"enable_hierarchical_cache": True, "host_kv_size_gb": args.host_kv_size_gb,
                     "hicache_write_policy": args.write_policy, "hicache_io_backend": args.io_backend}
        elif name == "control":
            extra = {"max_total_tokens": args.control_total_tokens
                     or int(1.1 * args.conversations * final) + 4096}
        rows.append(run_setting(args, name, extra))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f)
    by = {r["setting"]: r for r in rows}
    if "hicache" in by and "plain" in by:
        h, p = by["hicache"], by["plain"]
        same = sum(h["outputs"][k] == p["outputs"][k] for k in p["outputs"])
        summary: dict[str, Any] = {
            "throughput_ratio": h["req_per_s"] / p["req_per_s"], "ttft_p50_ratio": h["ttft_p50_ms"] / p["ttft_p50_ms"],
            "same_outputs": same, "requests": len(p["outputs"])}
        print(f"tier / plain: throughput {summary['throughput_ratio']:.2f}x  TTFT p50 {summary['ttft_p50_ratio']:.2f}x  "
              f"same greedy outputs {same}/{len(p['outputs'])}", flush=True)
        if "control" in by:
            ctl = by["control"]["outputs"]
            for name in ("hicache", "plain"):
                summary[f"{name}_same_as_control"] = sum(by[name]["outputs"][k] == ctl[k] for k in ctl)
            print(f"same greedy outputs as the never-evicting control: tier {summary['hicache_same_as_control']}/"
                  f"{len(ctl)}, plain {summary['plain_same_as_control']}/{len(ctl)}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows, "summary": summary}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
