"""lmdsl frontend benchmark: interpreter overhead, fork parallelism, API speculative execution.

No model and no GPU: backends are lmdsl.testing fakes, so the numbers measure the frontend itself
(per-primitive cost, overlap of backend latency) and API call/token counts, not a model.

    python benchmarks/lmdsl/bench_frontend.py [--json result.json]
    python benchmarks/lmdsl/bench_frontend.py --base-url http://127.0.0.1:30000   # + a real server

With `--base-url`, the few-shot program below also runs plain and speculative against that server's
OpenAI-compatible `/v1/completions` (greedy), and the two runs' variables must agree.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import lmdsl as sgl
from lmdsl.backend.openai_backend import OpenAI
from lmdsl.testing import MockBackend
from lmdsl.testing.fake_lm import TranscriptLM
from lmdsl.testing.fake_openai import FakeOpenAIServer


def bench_overhead(num_gens: int, repeats: int) -> dict[str, Any]:
    backend = MockBackend(default=" ok")

    @sgl.function
    def chain(s):
        for i in range(num_gens):
            s += f"Q{i}:" + sgl.gen(f"a{i}", max_tokens=2) + "\n"

    chain.run(backend=backend)  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        state = chain.run(backend=backend)
        assert state.error() is None
    seconds = time.perf_counter() - start
    primitives = repeats * num_gens * 3  # constant, gen, constant
    return {"case": f"sequential chain, {num_gens} gens x {repeats} runs", "primitives": primitives,
            "us_per_primitive": 1e6 * seconds / primitives, "programs_per_s": repeats / seconds}


def bench_batch(batch: int) -> dict[str, Any]:
    backend = MockBackend(default=" ok")

    @sgl.function
    def one(s, x):
        s += "Item " + x + ":" + sgl.gen("a", max_tokens=2) + sgl.select("b", ["yes", "no"])

    start = time.perf_counter()
    states = one.run_batch([{"x": str(i)} for i in range(batch)], backend=backend)
    seconds = time.perf_counter() - start
    assert all(s.error() is None for s in states)
    return {"case": f"run_batch of {batch} programs (gen + select)", "programs_per_s": batch / seconds,
            "us_per_program": 1e6 * seconds / batch}


def bench_fork(branches: int, latency_s: float) -> dict[str, Any]:
    backend = MockBackend(default=" ok", delay_s=latency_s)

    @sgl.function
    def fan(s):
        forks = s.fork(branches)
        forks += lambda i: f"Branch {i}:" + sgl.gen("x", max_tokens=2)
        forks.join()

    start = time.perf_counter()
    state = fan.run(backend=backend)
    seconds = time.perf_counter() - start
    assert len(state["x"]) == branches
    sequential = branches * latency_s
    return {"case": f"fork({branches}), backend latency {latency_s * 1000:.0f} ms", "wall_ms": 1000 * seconds,
            "sequential_ms": 1000 * sequential, "overlap": sequential / seconds}


def bench_speculation(num_fields: int) -> list[dict[str, Any]]:
    labels = [f"Field{i}" for i in range(num_fields)]
    transcript = "Card.\n" + "".join(f"{label}: value {i}\n" for i, label in enumerate(labels))

    def body(s):
        s += "Card.\n"
        for label in labels:
            s += label + ":" + sgl.gen(label, max_tokens=8, stop="\n") + "\n"

    rows = []
    with FakeOpenAIServer(TranscriptLM(transcript)) as server:
        backend = OpenAI("gpt-3.5-turbo-instruct", base_url=server.url + "/v1", api_key="k", max_retries=0)
        results = {}
        for name, fn in (("plain", sgl.function(body)),
                         ("speculative", sgl.function(num_api_spec_tokens=4 * num_fields + 8)(body))):
            start = time.perf_counter()
            state = fn.run(backend=backend, temperature=0)
            seconds = time.perf_counter() - start
            assert state.error() is None
            results[name] = {label: state[label] for label in labels}
            usage = state.usage()
            rows.append({"case": f"{num_fields}-field card, {name}", "api_calls": usage.num_api_calls,
                         "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                         "wall_ms": 1000 * seconds})
        assert results["plain"] == results["speculative"]
    return rows


def bench_server(base_url: str) -> list[dict[str, Any]]:
    backend = OpenAI("default", base_url=base_url.rstrip("/") + "/v1", api_key="unused", is_chat_model=False,
                     max_retries=0, timeout=300)
    countries = ["Germany", "Spain", "Portugal", "Greece"]

    def body(s):
        s += "France: Paris\nJapan: Tokyo\nItaly: Rome\n"
        for country in countries:
            s += country + ":" + sgl.gen(country, max_tokens=8, stop="\n") + "\n"

    rows, values = [], []
    for name, fn in (("plain", sgl.function(body)), ("speculative", sgl.function(num_api_spec_tokens=48)(body))):
        start = time.perf_counter()
        state = fn.run(backend=backend, temperature=0)
        seconds = time.perf_counter() - start
        assert state.error() is None, state.error()
        values.append([state[c] for c in countries])
        usage = state.usage()
        rows.append({"case": f"server, {len(countries)}-gen few-shot, {name}", "api_calls": usage.num_api_calls,
                     "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                     "wall_ms": 1000 * seconds})
    assert values[0] == values[1], values
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--base-url", help="also measure speculation against this server (OpenAI-compatible API)")
    args = parser.parse_args()
    rows = [bench_overhead(20, 50), bench_batch(256)]
    rows += [bench_fork(n, 0.05) for n in (1, 4, 16)]
    rows += bench_speculation(4) + bench_speculation(8)
    if args.base_url:
        rows += bench_server(args.base_url)
    keys = ["case", "us_per_primitive", "programs_per_s", "us_per_program", "wall_ms", "sequential_ms", "overlap",
            "api_calls", "prompt_tokens", "completion_tokens"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        cells = []
        for k in keys:
            v = row.get(k, "")
            cells.append(f"{v:.1f}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
