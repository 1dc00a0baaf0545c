"""Running streams next to a burst of long prompts: how long do the streams wait between two
tokens, and how much longer does the burst's prefill take than alone? (issue 32)

Per setting, one server; two phases on it, with fresh random prompts each (no radix hits):
- `alone`: `--burst` prompts of `--burst-len` random tokens arrive at once (streaming `/generate`,
  `--burst-new` tokens each); the burst's prefill time is from their arrival to the last one's
  first token.
- `with streams`: `--streams` streaming requests (`--stream-len`-token prompts, EOS ignored) run;
  once each has streamed `--warm-tokens` tokens the same-sized burst arrives. Reported: the
  burst's prefill time again, and the streams' largest and p99 gap between two chunks over the
  window from the burst's arrival to its last first token, and their tokens/s per user in that
  window against the 2 s before it.

Settings (server flags on top of `--server-args`):
- `serial`: `--no-enable-mixed-chunk` (prefill first: running requests wait for every chunk);
- `mixed`: `--prefill-step-target-ms 0` (mixed steps with full prefill chunks);
- `paced`: the defaults (mixed steps whose prefill part the pacer sizes for
  `--prefill-step-target-ms`, auto 60 ms on CUDA).

    python benchmarks/serving/bench_prefill_burst.py --model-path MODEL_DIR \\
        --server-args "--load-format dummy --dtype bfloat16 --context-length 8192" [--settings serial mixed paced]
        [--streams 8] [--burst 64] [--burst-len 4000] [--json out.json]

Targets on the H200 (8B shape): the streams never wait more than 100 ms between two tokens, and the
burst's prefill with streams takes at most 1.1x its time alone.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

SETTINGS = {
    "serial": ["--no-enable-mixed-chunk"],
    "mixed": ["--prefill-step-target-ms", "0"],
    "paced": [],
}


@dataclass
class Stream:
    times: list[float] = field(default_factory=list)  # arrival of each chunk that brought tokens
    tokens: list[int] = field(default_factory=list)  # completion tokens so far at that chunk
    error: str = ""


def stream_request(base_url: str, body: dict[str, Any], out: Stream, stop: threading.Event) -> None:
    """Streams one /generate request into `out` until it ends or `stop` is set."""
    seen = 0
    try:
        with httpx.Client(timeout=900) as client, client.stream("POST", base_url + "/generate", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if stop.is_set():
                    return
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                n = json.loads(line[5:])["meta_info"]["completion_tokens"]
                if n > seen:
                    seen = n
                    out.times.append(time.perf_counter())
                    out.tokens.append(n)
    except Exception as e:  # noqa: BLE001 - reported in the table, never hidden
        out.error = f"{type(e).__name__}: {e}"


def start(base_url: str, bodies: list[dict[str, Any]], stop: threading.Event) -> tuple[list[Stream], list[threading.Thread]]:
    outs = [Stream() for _ in bodies]
    threads = [threading.Thread(target=stream_request, args=(base_url, b, o, stop), daemon=True)
               for b, o in zip(bodies, outs, strict=True)]
    for t in threads:
        t.start()
    return outs, threads


def body(ids: list[int], max_new: int) -> dict[str, Any]:
    return {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}


def burst(base_url: str, rng: random.Random, args: argparse.Namespace) -> tuple[float, list[Stream]]:
    """Sends the burst; returns (seconds from arrival to the last first token, the streams)."""
    bodies = [body([rng.randrange(100, args.vocab) for _ in range(args.burst_len)], args.burst_new)
              for _ in range(args.burst)]
    stop = threading.Event()
    t0 = time.perf_counter()
    outs, threads = start(base_url, bodies, stop)
    for t in threads:
        t.join()
    errors = [o.error for o in outs if o.error or not o.times]
    if errors:
        raise RuntimeError(f"{len(errors)} burst requests failed: {errors[:3]}")
    return max(o.times[0] for o in outs) - t0, outs


def gaps_in(times: list[float], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive chunk times that overlap [lo, hi] (the one spanning lo counts)."""
    return [b - a for a, b in zip(times, times[1:], strict=False) if b >= lo and a <= hi]


def rate_in(s: Stream, lo: float, hi: float) -> float:
    """Tokens per second the stream received in [lo, hi] (a stall inside the window counts)."""
    def tokens_at(t: float) -> int:
        return max([n for at, n in zip(s.times, s.tokens, strict=True) if at <= t], default=0)

    return (tokens_at(hi) - tokens_at(lo)) / (hi - lo)


def run_setting(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from lmserver.testing import ServerProcess

    model = ["--model-path", args.model_path] if args.model_path else []  # none: the embedded default model
    cmd = [*model, *shlex.split(args.server_args), *SETTINGS[name]]
    srv = ServerProcess(cmd, core=None)
    srv.start(timeout_s=900)
    rng = random.Random(hash(name) & 0xFFFF)
    out: dict[str, Any] = {"setting": name}
    try:
        warm = [body([rng.randrange(100, args.vocab) for _ in range(64)], 8) for _ in range(4)]
        start(srv.base_url, warm, threading.Event())[1][0].join()  # warm-up (graphs, allocator)
        out["alone_s"], _ = burst(srv.base_url, rng, args)
        stop = threading.Event()
        streams, threads = start(srv.base_url, [body([rng.randrange(100, args.vocab) for _ in range(args.stream_len)],
                                                     args.stream_new) for _ in range(args.streams)], stop)
        deadline = time.perf_counter() + 600
        while any(len(s.tokens) < args.warm_tokens for s in streams):
            if time.perf_counter() > deadline or any(s.error for s in streams):
                raise RuntimeError(f"streams did not start: {[s.error for s in streams]}")
            time.sleep(0.01)
        time.sleep(2.0)  # NOTE: the calm window the streams' speed is compared with
        t0 = time.perf_counter()
        out["with_streams_s"], _ = burst(srv.base_url, rng, args)
        t1 = t0 + out["with_streams_s"]
        stop.set()
        gaps = sorted(g for s in streams for g in gaps_in(s.times, t0, t1))
        if any(s.error for s in streams):
            raise RuntimeError(f"a stream failed: {[s.error for s in streams if s.error]}")
        if any(s.times[-1] < t1 for s in streams):
            raise RuntimeError("a stream ended before the burst's prefill did: raise --stream-new")
        out["max_gap_ms"] = 1000 * gaps[-1]
        out["p99_gap_ms"] = 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
        out["calm_tok_s"] = statistics.mean(rate_in(s, t0 - 2.0, t0) for s in streams)
        out["burst_tok_s"] = statistics.mean(rate_in(s, t0, t1) for s in streams)
        out["ratio"] = out["with_streams_s"] / out["alone_s"]
        info = httpx.get(srv.base_url + "/get_server_info", timeout=60).json()
        out["prefill_step_target_ms"] = info.get("prefill_step_target_ms")
    finally:
        srv.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="")
    p.add_argument("--server-args", default="")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-len", type=int, default=256)
    p.add_argument("--stream-new", type=int, default=3000)
    p.add_argument("--warm-tokens", type=int, default=16)
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--burst-len", type=int, default=4000)
    p.add_argument("--burst-new", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    p.add_argument("--json", default="")
    args = p.parse_args()
    rows = []
    for name in args.settings:
        row = run_setting(name, args)
        rows.append(row)
        print(f"  {name:7s} alone {row['alone_s']:7.2f} s  with streams {row['with_streams_s']:7.2f} s "
              f"({row['ratio']:.2f}x)  max gap {row['max_gap_ms']:8.1f} ms  p99 {row['p99_gap_ms']:7.1f} ms  "
              f"stream tok/s {row['calm_tok_s']:6.1f} -> {row['burst_tok_s']:6.1f}", flush=True)
    print(f"\n| setting | burst prefill alone (s) | with {args.streams} streams (s) | ratio | streams' largest gap (ms) | p99 gap (ms) "
          "| stream tok/s calm -> during |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['alone_s']:.2f} | {r['with_streams_s']:.2f} | {r['ratio']:.2f} | "
              f"{r['max_gap_ms']:.0f} | {r['p99_gap_ms']:.0f} | {r['calm_tok_s']:.1f} -> {r['burst_tok_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
