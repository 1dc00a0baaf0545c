"""Serving benchmark: a load generator for any OpenAI-compatible (or SGLang-native) server.

Prompts are token-id lists, so input lengths are exact without a local tokenizer; `ignore_eos`
makes output lengths exact on servers that honour it (lmserver, SGLang, vLLM). Streaming is used
to time the first token (TTFT) and the gaps between chunks (ITL).

    python benchmarks/serving/bench_serving.py --base-url http://127.0.0.1:30000 \
        --dataset random --num-prompts 64 --random-input-len 256 --random-output-len 64 \
        --request-rate inf --max-concurrency 16 --json result.json

Prints SGLang's "Serving Benchmark Result" block; `--json PATH` writes the same fields.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass
class Prompt:
    input_ids: list[int]
    output_len: int


@dataclass
class Result:
    success: bool = False
    error: str = ""
    input_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def random_dataset(rng: random.Random, n: int, input_len: int, output_len: int, range_ratio: float,
                   vocab: tuple[int, int]) -> list[Prompt]:
    """SGLang's `random`: lengths uniform in [len * range_ratio, len], random token ids."""
    out = []
    for _ in range(n):
        il = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        ol = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        out.append(Prompt([rng.randrange(*vocab) for _ in range(il)], ol))
    return out


def shared_prefix_dataset(rng: random.Random, groups: int, per_group: int, system_len: int, question_len: int,
                          output_len: int, vocab: tuple[int, int]) -> list[Prompt]:
    """SGLang's `generated-shared-prefix`: `groups` system prompts, each shared by `per_group` questions."""
    out = []
    for _ in range(groups):
        system = [rng.randrange(*vocab) for _ in range(system_len)]
        for _ in range(per_group):
            out.append(Prompt(system + [rng.randrange(*vocab) for _ in range(question_len)], output_len))
    rng.shuffle(out)
    return out


def _payload(api: str, model: str, p: Prompt) -> tuple[str, dict[str, Any]]:
    if api == "native":
        return "/generate", {"input_ids": p.input_ids, "stream": True, "sampling_params": {
            "max_new_tokens": p.output_len, "temperature": 0, "ignore_eos": True}}
    return "/v1/completions", {"model": model, "prompt": p.input_ids, "max_tokens": p.output_len,
                               "temperature": 0, "stream": True, "ignore_eos": True,
                               "stream_options": {"include_usage": True}}


async def one_request(client: httpx.AsyncClient, api: str, model: str, p: Prompt) -> Result:
    path, body = _payload(api, model, p)
    res = Result(input_len=len(p.input_ids))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = str(data["error"])
                    return res
                now = time.perf_counter()
                if api == "native":
                    produced = data["meta_info"]["completion_tokens"] > 0
                    res.output_len = data["meta_info"]["completion_tokens"]
                else:
                    if data.get("usage"):
                        res.output_len = data["usage"]["completion_tokens"]
                    produced = bool(data.get("choices")) and bool(data["choices"][0].get("text"))
                if produced:
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.success = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run(args: argparse.Namespace, prompts: list[Prompt], model: str) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=max(args.max_concurrency or 0, 256))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout_s, limits=limits,
                                 headers=headers) as client:
        for p in prompts[: args.warmup_requests]:
            warm = await one_request(client, args.api, model, Prompt(p.input_ids, min(p.output_len, 16)))
            if not warm.success:
                raise SystemExit(f"warm-up request failed: {warm.error}")
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed + 1)

        async def limited(p: Prompt) -> Result:
            if sem is None:
                return await one_request(client, args.api, model, p)
            async with sem:
                return await one_request(client, args.api, model, p)

        tasks = []
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _stats(prefix: str, values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s] or [0.0]
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {f"mean_{prefix}_ms": statistics.fmean(ms), f"median_{prefix}_ms": statistics.median(ms),
            f"p99_{prefix}_ms": p99}


def summarize(args: argparse.Namespace, results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    summary: dict[str, Any] = {
        "backend": args.api, "dataset": args.dataset, "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "completed": len(ok), "failed": len(results) - len(ok),
        "duration": duration, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "input_throughput": total_in / duration,
        "output_throughput": total_out / duration, "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(r.latency for r in ok) / duration,
        **_stats("e2e_latency", [r.latency for r in ok]), **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", tpots), **_stats("itl", [x for r in ok for x in r.itl]),
        "errors": sorted({r.error for r in results if not r.success})[:5],
    }
    return summary


def print_summary(s: dict[str, Any]) -> None:
    rate = "inf" if s["request_rate"] == float("inf") else s["request_rate"]
    rows = [
        ("Backend:", s["backend"]), ("Traffic request rate:", rate),
        ("Max request concurrency:", s["max_concurrency"] or "not set"),
        ("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
        ("Benchmark duration (s):", f"{s['duration']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Input token throughput (tok/s):", f"{s['input_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_throughput']:.2f}"),
        ("Concurrency:", f"{s['concurrency']:.2f}"),
    ]
    print("\n{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    for k, v in rows:
        print(f"{k:<40} {v!s:<10}")
    for title, key in (("End-to-End Latency", "e2e_latency"), ("Time to First Token", "ttft"),
                       ("Time per Output Token (excl. 1st token)", "tpot"), ("Inter-Token Latency", "itl")):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper().replace('_LATENCY', '')} (ms):"
            if key == "e2e_latency":
                label = f"{stat.capitalize() if stat != 'p99' else 'P99'} E2E Latency (ms):"
            print(f"{label:<40} {s[f'{stat}_{key}_ms']:<10.2f}")
    print("=" * 50)
    if s["errors"]:
        print("errors:", *s["errors"], sep="\n  ")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--api", choices=("openai", "native"), default="openai",
                    help="openai: streaming /v1/completions; native: streaming /generate")
    ap.add_argument("--model", default=None, help="model name; default: the first of /v1/models")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=64)
    ap.add_argument("--random-range-ratio", type=float, default=1.0)
    ap.add_argument("--sp-num-groups", type=int, default=4)
    ap.add_argument("--sp-prompts-per-group", type=int, default=16)
    ap.add_argument("--sp-system-prompt-len", type=int, default=512)
    ap.add_argument("--sp-question-len", type=int, default=64)
    ap.add_argument("--sp-output-len", type=int, default=64)
    ap.add_argument("--vocab-range", type=int, nargs=2, default=(1000, 20000),
                    help="token ids are drawn from [lo, hi) (avoids special tokens)")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--warmup-requests", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--json", default=None, help="write the result fields (and the arguments) here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    vocab = (args.vocab_range[0], args.vocab_range[1])
    if args.dataset == "random":
        prompts = random_dataset(rng, args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, vocab)
    else:
        prompts = shared_prefix_dataset(rng, args.sp_num_groups, args.sp_prompts_per_group,
                                        args.sp_system_prompt_len, args.sp_question_len, args.sp_output_len, vocab)
    model = args.model
    if model is None and args.api == "openai":
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(args.base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    results, duration = asyncio.run(run(args, prompts, model or ""))
    summary = summarize(args, results, duration)
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "args": {k: v for k, v in vars(args).items()},
                       "per_request": [asdict(r) for r in results]}, f, indent=1, default=str)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
