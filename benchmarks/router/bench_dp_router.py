"""Data parallelism: shared-prefix workload across 2 replicas, cache-aware vs round-robin routing.

Starts `lmserver serve --dp-size 2 --router-policy P` for each policy (and a single replica as
the hit-rate reference), sends the same shuffled shared-prefix workload through the native
`/generate` API at a fixed concurrency, and prints throughput and cache hit rate
(sum cached_tokens / sum prompt_tokens, as the server reports them per request).

    python benchmarks/router/bench_dp_router.py [--groups 8 --per-group 8 ...] [--json out.json]

On GPUs (each replica on its own GPU: `--dp-size` narrows CUDA_VISIBLE_DEVICES per replica), e.g. the
Llama-3-8B shape with dummy weights:

    python benchmarks/router/bench_dp_router.py --groups 64 --per-group 16 --system-words 2000 \
        --question-words 100 --output-len 32 --concurrency 64 --max-total-tokens 100000 \
        --context-length 4096 --server-args "--model-path MODEL_DIR --load-format dummy --dtype bfloat16"
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import shlex
import threading
import time
from typing import Any

import httpx

from lmserver.testing import ServerProcess

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "mountain",
    "cloud",
    "stone",
    "paper",
    "window",
    "garden",
    "silver",
    "orange",
    "music",
    "planet",
    "engine",
    "yellow",
    "forest",
    "ocean",
    "bridge",
    "candle",
    "market",
    "winter",
    "summer",
]


def make_workload(
    groups: int, per_group: int, system_words: int, question_words: int, seed: int
) -> list[str]:
    rng = random.Random(seed)
    systems = [
        f"System {g}: " + " ".join(rng.choice(WORDS) for _ in range(system_words)) for g in range(groups)
    ]
    prompts = [
        systems[g] + "\nQuestion: " + " ".join(rng.choice(WORDS) for _ in range(question_words))
        for g in range(groups)
        for _ in range(per_group)
    ]
    rng.shuffle(prompts)
    return prompts


def group_of(text: str) -> int:
    """The workload group of a prompt (its "System g:" header)."""
    return int(text.split(":", 1)[0].removeprefix("System "))


def run_policy(args: argparse.Namespace, prompts: list[str], dp_size: int, policy: str) -> dict[str, Any]:
    """`policy` "direct" sends each prompt straight to replica (group mod dp_size), bypassing the
    router (an oracle cache-aware routing with no proxy: isolates the router's own cost)."""
    direct = policy == "direct"
    server_args = [
        "--dp-size",
        str(dp_size),
        "--router-policy",
        "round_robin" if direct else policy,
        "--context-length",
        str(args.context_length),
        "--max-total-tokens",
        str(args.max_total_tokens),
        *shlex.split(args.server_args),
    ]
    srv = ServerProcess(server_args, core=None, env={"OMP_NUM_THREADS": str(args.threads)}).start(
        timeout_s=900
    )
    local = threading.local()  # one client (one connection) per sender thread
    clients: list[httpx.Client] = []
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}

    replicas = [f"http://127.0.0.1:{srv.port + 1 + i}" for i in range(dp_size)] if dp_size > 1 else [srv.base_url]

    def one(text: str) -> dict[str, Any]:
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=600)
            clients.append(local.client)
        base = replicas[group_of(text) % len(replicas)] if direct else srv.base_url
        r = local.client.post(f"{base}/generate", json={"text": text, "sampling_params": params})
        r.raise_for_status()
        return r.json()["meta_info"]  # type: ignore[no-any-return]

    try:
        # warm-up on each replica directly (kernel compilation is not part of the measurement);
        # its tokens share nothing with the workload's prompts
        for url in replicas:
            httpx.post(f"{url}/generate", json={"text": "warm up " * 40, "sampling_params": params},
                       timeout=600).raise_for_status()
            httpx.post(f"{url}/flush_cache", timeout=60)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            metas = list(pool.map(one, prompts))
        elapsed = time.perf_counter() - start
        # the router's view: requests served per worker and health (a worker dropped under load
        # would leave its share to the other one)
        workers = httpx.get(f"{srv.base_url}/workers", timeout=30).json()["workers"] if dp_size > 1 else []
    finally:
        for c in clients:
            c.close()
        srv.stop()
        if args.log_tail:
            print(srv.log_tail(args.log_tail), flush=True)
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    out_tokens = sum(m["completion_tokens"] for m in metas)
    return {
        "dp_size": dp_size,
        "policy": policy,
        "requests": len(metas),
        "seconds": elapsed,
        "req_per_s": len(metas) / elapsed,
        "output_tok_per_s": out_tokens / elapsed,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens,
        "workers": workers,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--system-words", type=int, default=200)
    p.add_argument("--question-words", type=int, default=20)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=2600, help="KV slots per replica")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--server-args", default="", help="more `lmserver serve` options (model, dtype, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="cache_aware,round_robin",
                   help="router policies for the 2-replica runs; `direct` = client-side routing by group, no router")
    p.add_argument("--log-tail", type=int, default=0, help="print the last N server log lines after each run")
    p.add_argument("--no-single", action="store_true", help="skip the single-replica reference")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    prompts = make_workload(args.groups, args.per_group, args.system_words, args.question_words, args.seed)
    plan = ([] if args.no_single else [(1, "cache_aware")]) + [(2, pol) for pol in args.policies.split(",")]
    runs = []
    for dp_size, policy in plan:
        runs.append(run_policy(args, prompts, dp_size, policy))
        r = runs[-1]
        served = ", ".join(f"{w.get('served')} served{'' if w.get('healthy') else ' (unhealthy)'}" for w in r["workers"])
        print(f"done: {dp_size} replica(s), {policy}: {r['req_per_s']:.2f} req/s, hit rate {r['hit_rate']:.3f}, "
              f"{r['seconds']:.1f} s{'; workers: ' + served if served else ''}", flush=True)
    print(
        f"\nshared prefix: {args.groups} groups x {args.per_group} prompts, ~{args.system_words}-word system "
        f"prompt, {args.output_len} output tokens, concurrency {args.concurrency}, "
        f"{args.max_total_tokens} KV slots per replica {args.server_args}"
    )
    print(f"{'replicas':>8} {'policy':>14} {'req/s':>8} {'out tok/s':>10} {'hit rate':>9} {'seconds':>8}")
    for r in runs:
        print(
            f"{r['dp_size']:>8} {r['policy']:>14} {r['req_per_s']:>8.2f} {r['output_tok_per_s']:>10.1f} "
            f"{r['hit_rate']:>9.3f} {r['seconds']:>8.1f}"
        )
    by = {(r["dp_size"], r["policy"]): r for r in runs}
    if (2, "cache_aware") in by and (2, "round_robin") in by:
        ratio = by[2, "cache_aware"]["req_per_s"] / by[2, "round_robin"]["req_per_s"]
        print(f"cache-aware / round-robin throughput: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
