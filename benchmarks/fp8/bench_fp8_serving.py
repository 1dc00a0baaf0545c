"""FP8 against bf16 through the HTTP server, side by side in one run (issue 33's end-to-end targets).

One `lmserver serve` per setting (same model folder and `--server-args`, e.g. the Llama-3-8B config
with `--load-format dummy`), each measured the same way:

- decode: streaming greedy `/generate` requests of random `--input-len`-token prompts (EOS ignored)
  at each concurrency of `--concurrency`; per-user tokens/s = median over requests of
  (tokens - 1) / (first to last token) (bench_spec_serving's measure);
- prefill: `--prefill-requests` requests of `--prefill-len` random tokens, one at a time, one new
  token each; prefill tokens/s = prompt tokens / request time (median); with `--prefill-vary N` the measured
  prompts have distinct lengths in [len - N, len] (a kernel planned per shape pays its planning there);
- `--interleave` (prefill only): every setting's server up at once, sharing the GPU's memory, the same prompt sent to
  each in turn per round, so that a drift of the machine's speed lands on every setting alike;
- `--probe-overhead N`: the per-request time outside a prefill's layers (a repeated prompt: a radix hit; a one-id
  prompt);
- KV capacity: the resolved `max_total_tokens` of `/get_server_info` (tokens the KV pool holds).

Settings: `bf16` (the model dtype everywhere), `fp8` (`--quantization fp8 --kv-cache-dtype
fp8_e4m3`: online per-channel FP8 weights and an FP8 KV cache), `fp8-weights` (FP8 weights only);
`bf16+plugin` / `fp8+plugin`: the same with `--lowlat-plugins auto` (the nvidia plugin's decode steps,
counted from `/get_server_info`); `fp8+plugin-all`: `auto+all-batches` (the plugin at every batch it covers, also
above its measured coverage). A `+lmhead` suffix on an FP8 setting adds `--quantize-lm-head` (the LM head FP8 too,
per row: opt-in, it changes the logits), e.g. `fp8-default+lmhead`. `bf16-default+eager-extend` / `fp8-default+eager-extend`:
the defaults with short extends run eagerly (`--no-enable-cuda-graph-extend`). `bf16-default+eager-prefill` /
`fp8-default+eager-prefill`: the defaults without prefill CUDA graphs (`--no-enable-cuda-graph-prefill`; on by
default on one GPU); `+pgraph`: with them asked for; `+pgraph4k`: captured up to 4,096 tokens (default 2,048).

    python benchmarks/fp8/bench_fp8_serving.py --model-path MODEL_DIR \\
        --server-args "--load-format dummy --dtype bfloat16 --device cuda --context-length 8192" --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speculative"))
from bench_spec_serving import drive  # noqa: E402

SETTINGS = {
    "bf16": ["--lowlat-plugins", "off"],
    "fp8": ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--lowlat-plugins", "off"],
    "fp8-weights": ["--quantization", "fp8", "--lowlat-plugins", "off"],
    "bf16-default": [],  # the server's defaults (lowlat auto on a GPU)
    "fp8-default": ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"],
    "bf16+plugin": ["--lowlat-plugins", "auto"],
    "fp8+plugin": ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--lowlat-plugins", "auto"],
    "fp8+plugin-all": ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--lowlat-plugins", "auto+all-batches"],
}
SETTINGS.update({name + "+lmhead": [*args, "--quantize-lm-head"] for name, args in list(SETTINGS.items())
                 if "--quantization" in args})
# the defaults with one option changed, as a suffix of their names
DEFAULT_VARIANTS = {
    "+eager-extend": ["--no-enable-cuda-graph-extend"],  # short extends eagerly (graph extends: default since 2026-12-04)
    "+pgraph": ["--enable-cuda-graph-prefill"],  # prefill graphs asked for (the default on one GPU since 2026-12-05)
    "+eager-prefill": ["--no-enable-cuda-graph-prefill"],  # without them
    "+pgraph4k": ["--cuda-graph-prefill-max-tokens", "4096"],  # prefill graphs up to 4,096 tokens (default 2,048)
}
SETTINGS.update({name + suffix: [*SETTINGS[name], *extra] for suffix, extra in DEFAULT_VARIANTS.items()
                 for name in ("bf16-default", "fp8-default")})


def find_stats(obj: Any, prefix: str) -> dict[str, Any]:
    """Every `prefix*` key anywhere in a JSON object (the core's stats inside `/get_server_info`)."""
    found: dict[str, Any] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, str) and key.startswith(prefix):
                found[key] = value
            else:
                found.update(find_stats(value, prefix))
    elif isinstance(obj, list):
        for value in obj:
            found.update(find_stats(value, prefix))
    return found


def prompt_lengths(rng: random.Random, length: int, vary: int, n: int) -> list[int]:
    """`n` prompt lengths: all `length`, or with `vary` distinct ones drawn from [length - vary, length]."""
    return rng.sample(range(length - vary, length + 1), n) if vary else [length] * n


def timed_one_token(client: httpx.Client, url: str, ids: list[int], server_s: list[float] | None = None) -> float:
    """Seconds of one greedy `/generate` request of prompt `ids` for one new token; with `server_s`, the server's own
    measure of it (`meta_info.e2e_latency`: from the request's arrival in the tokenizer manager to its end) is
    appended there."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    resp = client.post(url + "/generate", json=body)
    took = time.perf_counter() - t0
    resp.raise_for_status()
    if server_s is not None:
        server_s.append(float(resp.json()["meta_info"]["e2e_latency"]))
    return took


def prefill_rate(url: str, n: int, length: int, vocab: int, seed: int, vary: int = 0) -> float:
    """Median prompt tokens/s of `n` one-at-a-time requests of `length` random tokens (with `vary`, each of a length
    drawn from [length - vary, length], none repeated: a kernel planned per shape pays its planning in the measure),
    1 new token each."""
    rng = random.Random(seed)
    rates = []
    with httpx.Client(timeout=600) as client:
        for size in prompt_lengths(rng, length, vary, n):
            ids = [rng.randrange(100, vocab) for _ in range(size)]
            rates.append(size / timed_one_token(client, url, ids))
    return statistics.median(rates)


def overhead_ms(url: str, n: int, length: int, vocab: int, seed: int) -> dict[str, float]:
    """The server's per-request time outside a prefill's layers, by two probes (median ms of ``n`` one-at-a-time
    requests, 1 new token each): one prompt of ``length`` random ids sent again and again (a radix hit: the forward
    is one token's, the rest is every per-request and per-id cost of the path), and a prompt of one id. Each probe
    also as the server measures it (``..._server``: `e2e_latency`, without the HTTP exchange and the client)."""
    rng = random.Random(seed)
    ids = [rng.randrange(100, vocab) for _ in range(length)]
    out = {}
    with httpx.Client(timeout=600) as client:
        for label, prompt in ((f"hit_{length}", ids), ("one_id", ids[:1])):
            timed_one_token(client, url, prompt)  # the first one caches the prompt
            server_s: list[float] = []
            times = [timed_one_token(client, url, prompt, server_s) for _ in range(n)]
            out[label] = round(1e3 * statistics.median(times), 3)
            out[label + "_server"] = round(1e3 * statistics.median(server_s), 3)
    return out


def start_servers_at_once(model_path: str, server_args: str, settings: list[str], servers: dict[str, Any]) -> float:
    """Starts every setting's server, all up at once sharing 0.85 of the GPU's memory evenly, into `servers` (filled
    as each comes up, so that a caller's cleanup stops those started when a later one fails); returns the share."""
    from lmserver.testing import ServerProcess

    share = 0.85 / len(settings)
    for i, name in enumerate(settings):
        # NOTE: a server's budget is the fraction of the whole GPU less the memory in use when it starts (the
        # servers up before it): server i asks for (i + 1) shares to get one
        cmd = ["--model-path", model_path, *shlex.split(server_args), *SETTINGS[name],
               "--mem-fraction-static", f"{share * (i + 1):.3f}"]
        servers[name] = ServerProcess(cmd, core=None).start(timeout_s=600)
        print(f"  {name}: up", flush=True)
    return share


def interleaved_rounds(client: httpx.Client, servers: dict[str, Any], sizes: list[int], vocab: int,
                       rng: random.Random) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """One round per prompt size of `sizes`: a fresh prompt of that many random ids sent to every server in turn, one
    request at a time, one new token. Returns each server's request seconds and its own `e2e_latency`s, per round."""
    walls: dict[str, list[float]] = {name: [] for name in servers}
    server_s: dict[str, list[float]] = {name: [] for name in servers}
    for size in sizes:
        ids = [rng.randrange(100, vocab) for _ in range(size)]
        for name, srv in servers.items():
            walls[name].append(timed_one_token(client, srv.base_url, ids, server_s[name]))
    return walls, server_s


def interleaved_prefill(args: argparse.Namespace) -> dict[str, Any]:
    """`--interleave`: every setting's server up at once (0.85 of the GPU's memory shared evenly), then
    `--prefill-requests` rounds, each sending the same fresh prompt to every server in turn, one request at a time:
    a drift of the machine's speed over the run (host speed varies 2-3x between calls of the device machine) lands on
    every setting alike. Returns each setting's median prefill tok/s and the median over rounds of each setting's
    ratio to the first's."""
    servers: dict[str, Any] = {}
    try:
        share = start_servers_at_once(args.model_path, args.server_args, args.settings, servers)
        for srv in servers.values():
            prefill_rate(srv.base_url, 2, args.prefill_len, args.vocab, 7)  # warm-up
        rng = random.Random(11)
        sizes = prompt_lengths(rng, args.prefill_len, args.prefill_vary, args.prefill_requests)
        with httpx.Client(timeout=600) as client:
            walls, server_s = interleaved_rounds(client, servers, sizes, args.vocab, rng)
        rates = {name: [size / w for size, w in zip(sizes, walls[name], strict=True)] for name in servers}
        overheads = {name: overhead_ms(srv.base_url, args.probe_overhead, args.prefill_len, args.vocab, 13)
                     for name, srv in servers.items()} if args.probe_overhead else {}
        for name, probe in overheads.items():
            print(f"  {name:14s} per-request overhead (ms, median): {probe}", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    base = args.settings[0]
    out = {"memory_share": round(share, 3), "rates": rates, "overhead_ms": overheads,
           "wall_ms": {name: round(1e3 * statistics.median(w), 3) for name, w in walls.items()},
           "server_ms": {name: round(1e3 * statistics.median(w), 3) for name, w in server_s.items()},
           "prefill_tok_s": {name: round(statistics.median(r), 0) for name, r in rates.items()},
           "ratio_median_of_rounds": {name: round(statistics.median(a / b for a, b in zip(r, rates[base],
                                                                                       strict=True)), 3)
                                      for name, r in rates.items()}}
    for name, r in rates.items():
        print(f"  {name:14s} prefill {args.prefill_len}: median {out['prefill_tok_s'][name]:.0f} tok/s (min {min(r):.0f}, "
              f"max {max(r):.0f}); vs {base}, median of the rounds' ratios {out['ratio_median_of_rounds'][name]:.3f}x; "
              f"request {out['wall_ms'][name]:.2f} ms, of which the server's e2e_latency {out['server_ms'][name]:.2f}",
              flush=True)
    return out


def run_setting(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from lmserver.testing import ServerProcess

    cmd = ["--model-path", args.model_path, *shlex.split(args.server_args), *SETTINGS[name]]
    srv = ServerProcess(cmd, core=None)
    t0 = time.perf_counter()
    srv.start(timeout_s=600)
    out: dict[str, Any] = {"setting": name, "start_s": round(time.perf_counter() - t0, 1), "decode": {}}
    try:
        info = httpx.get(srv.base_url + "/get_server_info", timeout=60).json()
        out["kv_tokens"] = info.get("max_total_tokens")
        asyncio.run(drive(srv.base_url, 1, 1, args.input_len, 32, args.vocab, 0))  # warm-up
        if args.prefill_requests:
            prefill_rate(srv.base_url, 1, args.prefill_len, args.vocab, 7)  # warm-up
        for c in args.concurrency:
            speeds = asyncio.run(drive(srv.base_url, c, args.rounds, args.input_len, args.output_len, args.vocab,
                                       1000 + c))
            out["decode"][c] = round(statistics.median(speeds), 1)
            print(f"  {name:12s} c={c:<3d} {out['decode'][c]:8.1f} tok/s per user", flush=True)
        out["prefill_tok_s"] = (round(prefill_rate(srv.base_url, args.prefill_requests, args.prefill_len, args.vocab,
                                                   11, args.prefill_vary), 0) if args.prefill_requests else float("nan"))
        if args.probe_overhead:
            out["overhead_ms"] = overhead_ms(srv.base_url, args.probe_overhead, args.prefill_len, args.vocab, 13)
            print(f"  {name:12s} per-request overhead (ms, median): {out['overhead_ms']}", flush=True)
        out["lowlat"] = find_stats(httpx.get(srv.base_url + "/get_server_info", timeout=60).json(), "lowlat_")
        print(f"  {name:12s} prefill {args.prefill_len} tokens: {out['prefill_tok_s']:.0f} tok/s; KV capacity "
              f"{out['kv_tokens']} tokens; start {out['start_s']} s; {out['lowlat'] or 'no plugin'}", flush=True)
    finally:
        srv.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--server-args", default="--load-format dummy --dtype bfloat16 --device cuda --context-length 8192")
    p.add_argument("--settings", nargs="+", default=["bf16", "fp8"], choices=list(SETTINGS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2, help="requests per user, one after the other")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--prefill-requests", type=int, default=5, help="0: no prefill measure (decode only)")
    p.add_argument("--prefill-vary", type=int, default=0,
                   help="measured prompts of distinct lengths in [prefill-len - N, prefill-len] (the warm-up keeps "
                        "prefill-len): what a per-shape plan (cuDNN) costs real traffic; 0: all of prefill-len")
    p.add_argument("--probe-overhead", type=int, default=0,
                   help="also time N requests of a repeated prefill-len prompt (a radix hit) and N of one id: the "
                        "per-request cost outside the layers")
    p.add_argument("--interleave", action="store_true",
                   help="prefill only: every setting's server up at once, the same prompt to each in turn per round "
                        "(a drift of the machine lands on every setting alike), then --probe-overhead on each; no "
                        "decode measure")
    p.add_argument("--vocab", type=int, default=None,
                   help="prompt token ids are drawn below this (default: the model's vocab_size, at most 32,000)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.vocab is None:
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        args.vocab = min(32000, int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 32000)))
    if args.interleave:
        result = interleaved_prefill(args)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "interleaved": result}, indent=1))
        return
    results = [run_setting(name, args) for name in args.settings]
    cols = [f"c={c} tok/s per user" for c in args.concurrency]
    print("\n| setting | " + " | ".join(cols) + f" | prefill tok/s ({args.prefill_len}) | KV tokens |")
    print("|---|" + "---|" * (len(cols) + 2))
    for r in results:
        print(f"| {r['setting']} | " + " | ".join(f"{r['decode'][c]:.1f}" for c in args.concurrency)
              + f" | {r['prefill_tok_s']:.0f} | {r['kv_tokens']} |")
    base = results[0]
    for r in results[1:]:
        print(f"{r['setting']} / {base['setting']}: " + ", ".join(
            f"c={c} {r['decode'][c] / base['decode'][c]:.2f}x" for c in args.concurrency)
            + f", prefill {r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x, KV {r['kv_tokens'] / base['kv_tokens']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
