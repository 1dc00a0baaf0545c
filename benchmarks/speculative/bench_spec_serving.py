"""Speculative decoding through the HTTP server: per-user decode tokens/s, with and without speculation.

One `lmserver serve` per setting (dummy weights, CUDA graphs, greedy, EOS ignored), each driven
with streaming `/generate` requests of random `--input-len`-token prompts at each concurrency of
`--concurrency` (every user sends `--rounds` requests one after the other). Per-user decode
tokens/s: the median over requests of (tokens - 1) / (time from the first to the last token).
Settings (`--settings`, in one run, side by side):

- `plain`: no speculation, `--lowlat-plugins off`;      `plain+lowlat`: the same with `auto`;
- `spec`: `--speculative-algorithm ngram --speculative-simulate-accept-length A
  --speculative-num-draft-tokens D` (every step verifies D drafts and accepts A - 1 on average,
  whatever the random weights say: the seed's measurement method); `spec+lowlat`: with `auto`;
  `spec+lowlat-all`: `auto+all-batches` (the plugin also on verify steps its measured tables decline; with
  `--quantization fp8 --kv-cache-dtype fp8_e4m3` in `--server-args`: FP8 verify steps);
- `eagle`: the same acceptance with an EAGLE head (`--eagle-head FOLDER`) proposing the drafts, so
  its cost (a catch-up forward and D - 1 head steps, each with the target's LM head) is paid;
- `draft`: the same with a draft model (`--draft-model FOLDER`, its config.json is enough with `--load-format
  dummy`: random weights) proposing them (`--speculative-algorithm draft_model`).

Verify steps of up to `--cuda-graph-max-bs` rows replay the decode graphs as decode rows. The
server's own counters (`/get_server_info`) give the measured acceptance length, verify steps,
and lowlat plugin steps per kind.

    python benchmarks/speculative/bench_spec_serving.py --model-path MODEL_DIR \\
        --server-args "--load-format dummy --dtype bfloat16 --device cuda --context-length 4096" \\
        --concurrency 1 8 --json OUT/spec_serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import time
from typing import Any

import httpx

SETTINGS = {
    "plain": ["--lowlat-plugins", "off"],
    "plain+lowlat": ["--lowlat-plugins", "auto"],
    "spec": ["SPEC", "--lowlat-plugins", "off"],
    "spec+lowlat": ["SPEC", "--lowlat-plugins", "auto"],
    "spec+lowlat-all": ["SPEC", "--lowlat-plugins", "auto+all-batches"],
    "eagle": ["EAGLE", "--lowlat-plugins", "off"],
    "eagle+lowlat": ["EAGLE", "--lowlat-plugins", "auto"],
    "draft": ["DRAFT", "--lowlat-plugins", "off"],
    "draft+lowlat": ["DRAFT", "--lowlat-plugins", "auto"],
}


async def one_request(client: httpx.AsyncClient, url: str, ids: list[int], max_new: int) -> tuple[int, float]:
    """Streams one greedy request; returns (tokens, seconds from the first token to the last)."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    first = last = 0.0
    tokens = 0
    async with client.stream("POST", url + "/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            n = json.loads(line[5:])["meta_info"]["completion_tokens"]
            now = time.perf_counter()
            if n > tokens:
                if tokens == 0:
                    first = now
                tokens, last = n, now
    return tokens, last - first


async def drive(url: str, concurrency: int, rounds: int, input_len: int, max_new: int, vocab: int,
                seed: int) -> list[float]:
    """`concurrency` users, `rounds` requests each; returns per-request decode tokens/s."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(concurrency * rounds)]
    speeds: list[float] = []
    async with httpx.AsyncClient() as client:
        async def user(u: int) -> None:
            for k in range(rounds):
                n, dt = await one_request(client, url, prompts[u * rounds + k], max_new)
                if n > 1 and dt > 0:
                    speeds.append((n - 1) / dt)

        await asyncio.gather(*(user(u) for u in range(concurrency)))
    return speeds


def run_setting(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from lmserver.testing import ServerProcess

    extra: list[str] = []
    for a in SETTINGS[name]:
        if a in ("SPEC", "EAGLE", "DRAFT"):
            extra += ["--speculative-num-draft-tokens", str(args.draft_tokens),
                      "--speculative-simulate-accept-length", str(args.accept_length)]
            extra += {"SPEC": ["--speculative-algorithm", "ngram"],
                      "EAGLE": ["--speculative-algorithm", "eagle", "--speculative-draft-model-path", args.eagle_head],
                      "DRAFT": ["--speculative-algorithm", "draft_model",
                                "--speculative-draft-model-path", args.draft_model]}[a]
        else:
            extra.append(a)
    cmd = ["--model-path", args.model_path, *shlex.split(args.server_args),
           "--cuda-graph-max-bs", str(args.cuda_graph_max_bs), *extra]
    srv = ServerProcess(cmd, core=None)
    t0 = time.perf_counter()
    srv.start(timeout_s=600)
    start_s = time.perf_counter() - t0
    out: dict[str, Any] = {"setting": name, "start_s": round(start_s, 1), "by_concurrency": {}}
    try:
        asyncio.run(drive(srv.base_url, 1, 1, args.input_len, 32, args.vocab, 0))  # warm-up
        for c in args.concurrency:
            speeds = asyncio.run(drive(srv.base_url, c, args.rounds, args.input_len, args.output_len, args.vocab,
                                       1000 + c))
            out["by_concurrency"][c] = round(statistics.median(speeds), 1)
            print(f"  {name:13s} c={c:<3d} {out['by_concurrency'][c]:8.1f} tok/s per user", flush=True)
        info = httpx.get(srv.base_url + "/get_server_info", timeout=60).json().get("scheduler", {})
        out["server"] = {k: v for k, v in info.items()
                         if k.startswith(("spec_", "lowlat_plugin", "cuda_graph")) or k in ("forwards",)}
    finally:
        srv.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--server-args", default="--load-format dummy --dtype bfloat16 --device cuda")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS),
                   default=[s for s in SETTINGS if not s.startswith(("eagle", "draft"))])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2, help="requests per user, one after the other")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    p.add_argument("--draft-tokens", type=int, default=5)
    p.add_argument("--accept-length", type=float, default=3.5)
    p.add_argument("--cuda-graph-max-bs", type=int, default=64)
    p.add_argument("--eagle-head", help="eagle settings: the EAGLE head's folder (its config.json is enough with "
                                        "--load-format dummy)")
    p.add_argument("--draft-model", help="draft settings: the draft model's folder (its config.json is enough with "
                                         "--load-format dummy)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    for name, folder, flag in (("eagle", args.eagle_head, "--eagle-head"), ("draft", args.draft_model, "--draft-model")):
        if folder is None and any(s.split("+")[0] == name for s in args.settings):
            p.error(f"the {name} settings need {flag}")
    results = [run_setting(name, args) for name in args.settings]
    by = {r["setting"]: r["by_concurrency"] for r in results}
    print("\n| setting | " + " | ".join(f"c={c} tok/s per user" for c in args.concurrency) + " |")
    print("|---|" + "---|" * len(args.concurrency))
    for r in results:
        print(f"| {r['setting']} | " + " | ".join(f"{r['by_concurrency'][c]:.1f}" for c in args.concurrency) + " |")
    for spec, base in (("spec", "plain"), ("spec+lowlat", "plain+lowlat"), ("spec+lowlat", "spec"),
                       ("eagle", "plain"), ("eagle", "plain+lowlat"), ("eagle", "spec"),
                       ("draft", "plain"), ("draft+lowlat", "plain+lowlat")):
        if spec in by and base in by:
            print(f"{spec} / {base}: " + ", ".join(f"c={c} {by[spec][c] / by[base][c]:.2f}x" for c in args.concurrency))
    for r in results:
        print(r["setting"], r.get("server"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
