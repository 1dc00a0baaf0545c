"""The paper's LM-program workloads, end to end, with every optimization switchable.

For each configuration this starts `lmserver serve` (configurations with the same server flags
share one server; the cache is flushed before every workload), runs every workload's programs
with lmdsl at a fixed concurrency, and records programs/s, mean program latency, the achieved
cache hit rate (sum cached_tokens / sum prompt_tokens as the server reports them) next to the
optimal hit rate of the recorded trace (see program_trace.py), the sanity count, and the host time
of the trace's radix-tree operations replayed through `radixcache` as a share of the run time.
Then it writes `results/<machine>.json` and regenerates README.md from every results file.

    python benchmarks/programs/run_all.py                      # CPU sizes, ~10-15 min on 2 cores
    python benchmarks/programs/run_all.py --configs full,no_radix --workloads mmlu_5shot
    python benchmarks/programs/run_all.py --scale 8 --concurrency 64 --machine "H200" \
        --server-args "--model-path /models/llama3-8b --load-format dummy"
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import program_trace as pt
import report
import workloads as wl

import lmdsl as sgl
from lmserver.testing import ServerProcess

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Config:
    """One column of the suite: server flags and the client the programs run through."""

    name: str
    server_args: tuple[str, ...] = ("--schedule-policy", "lpm")
    client: str = "native"  # "native" (lmdsl RuntimeEndpoint) or "openai" (lmdsl OpenAI, /v1/completions)
    hints: str = "auto"  # frontend prefix hints (fork prefixes, the program's constant prefix): LmdslConfig.prefix_hints
    workloads: tuple[str, ...] | None = None  # None: all
    note: str = ""


# NOTE: by default the schedule-policy, hint and baseline columns run the workloads where the
# switch changes what the server sees (forks, shared prefixes, selects); `--all-workloads` runs all.
SHARING = ("mmlu_5shot", "generative_agents", "tree_of_thought", "llm_judge")
FORKS = ("mmlu_5shot", "hellaswag_20shot", "tree_of_thought", "skeleton_of_thought", "llm_judge")
BASELINE = ("mmlu_5shot", "hellaswag_20shot", "tree_of_thought", "llm_judge", "json_decode",
            "chat_short")
CONFIGS = [
    Config("full", note="radix cache, lpm, jump-forward, frontend defaults (prefix hints where the server wants them)"),
    Config("no_radix", ("--schedule-policy", "lpm", "--disable-radix-cache"), note="radix cache off"),
    Config("fcfs", ("--schedule-policy", "fcfs"), workloads=SHARING, note="first come first served"),
    Config("dfs_weight", ("--schedule-policy", "dfs-weight"), workloads=SHARING, note="DFS-weight order"),
    Config("no_hints", hints="never", workloads=FORKS, note="no fork/constant-prefix hints"),
    Config("forced_hints", hints="always", workloads=FORKS, note="fork/constant-prefix hints always sent"),
    Config("no_jump_forward", ("--schedule-policy", "lpm", "--disable-jump-forward"),
           workloads=("json_decode",), note="jump-forward off"),
    Config("openai_baseline", client="openai", hints="never", workloads=BASELINE,
           note="one independent OpenAI completion request per call"),
]


def make_backend(cfg: Config, base_url: str, transport: pt.RecordingTransport) -> Any:
    if cfg.client == "openai":
        model = httpx.get(base_url + "/v1/models", timeout=60).json()["data"][0]["id"]
        return sgl.OpenAI(model, base_url=base_url + "/v1", is_chat_model=False, chat_template="chatml",
                          constrained_decoding=True, select_method="logprobs",
                          http_client=httpx.Client(transport=transport, timeout=600))
    return sgl.RuntimeEndpoint(base_url, transport=transport)  # NOTE: hints per cfg.hints (the program's config)


def supports_regex(client: httpx.Client) -> bool:
    r = client.post("/generate", json={"text": "Yes or no?", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "regex": "(yes|no)"}})
    return r.status_code == 200


def run_workload(cfg: Config, w: wl.Workload, sizes: wl.Sizes, base_url: str, client: httpx.Client,
                 concurrency: int) -> dict[str, Any]:
    r = client.post("/flush_cache")
    r.raise_for_status()
    stats0 = client.get("/get_server_info").json()["scheduler"]
    # NOTE: a client's `limits` do not apply to a transport passed in: this one sets its own, as many
    # connections as tree-of-thought's leaves in flight (httpx's default of 100 with 20 kept alive made
    # 512 concurrent calls churn connections; the client then hung with the server idle on the H200)
    transport = pt.RecordingTransport(httpx.HTTPTransport(limits=httpx.Limits(max_connections=None,
                                                                              max_keepalive_connections=1024)))
    backend = make_backend(cfg, base_url, transport)
    kwargs = w.make(sizes)
    program = copy.copy(w.program.bound if isinstance(w.program, wl.Bindable) else w.program)
    program.config = program.config.with_(prefix_hints=cfg.hints)  # NOTE: on a copy; the workload's stays
    latencies: list[float] = []
    errors: list[str] = []

    def one(kw: dict[str, Any]) -> tuple[Any, float]:
        t = time.perf_counter()
        state = program.run(backend=backend, temperature=0, **kw)
        state.sync()
        return state, time.perf_counter() - t

    start = time.perf_counter()
    if len(kwargs) > 1 and program.config.batch_prefix_hint:
        program.cache(backend)  # NOTE: what run_batch does first
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, kwargs))
    wall = time.perf_counter() - start
    ok = 0
    for (state, lat), kw in zip(results, kwargs, strict=True):
        latencies.append(lat)
        err = state.error()
        if err is not None:
            errors.append(f"{type(err).__name__}: {err}"[:300])
            continue
        try:
            ok += bool(w.check(state, kw))
        except Exception as e:  # noqa: BLE001 - a failed check is a sanity miss, recorded
            errors.append(f"check: {type(e).__name__}: {e}"[:300])
    stats1 = client.get("/get_server_info").json()["scheduler"]
    calls = transport.calls
    mismatched = pt.tokenize_trace(client, calls)
    total, misses = pt.optimal_misses(calls)
    replay = pt.radix_replay_seconds(calls)

    def server_seconds(name: str, stat: str) -> dict[str, float]:
        """``<name>_s``: how much the server's ``stat`` (seconds) grew during the run; ``<name>_share``: of the wall."""
        grew = stats1.get(stat, 0.0) - stats0.get(stat, 0.0)
        return {f"{name}_s": grew, f"{name}_share": grew / wall}

    return {
        "workload": w.name, "config": cfg.name, "programs": len(kwargs), "seconds": wall,
        "programs_per_s": len(kwargs) / wall, "mean_latency_s": sum(latencies) / len(latencies),
        "requests": len(calls), "prompt_tokens": sum(c.prompt_tokens for c in calls),
        "cached_tokens": sum(c.cached_tokens for c in calls),
        "completion_tokens": sum(len(c.output_ids or []) for c in calls),
        "hit_rate": pt.achieved_hit_rate(calls), "optimal_hit_rate": 1 - misses / total if total else 0.0,
        "trace_prompt_tokens": total, "token_count_mismatches": mismatched,
        "radix_replay_s": replay, "radix_share": replay / wall,
        # the server's KV-manager host time: radix-tree work, and slot bookkeeping (also without cache)
        **server_seconds("radix_server", "radix_time_s"), **server_seconds("slot_server", "slot_time_s"),
        # the server's prefill forwards (extend batches, launch to sampled tokens): the time a cache can shorten
        **server_seconds("prefill_server", "extend_time_s"),
        "jump_forward_tokens": stats1.get("jump_forward_tokens", 0) - stats0.get("jump_forward_tokens", 0),
        "sanity_ok": ok, "sanity_label": w.check_label, "errors": errors[:3], "num_errors": len(errors),
    }


MAX_RUNS = 9


def run_repeated(run: Callable[[], dict[str, Any]], min_seconds: float) -> dict[str, Any]:
    """Calls `run` (one `run_workload`) until the runs add up to `min_seconds` (at most MAX_RUNS):
    a workload that lasts under a second or two varies by tens of percent from run to run. Returns
    the median run by programs/s (the upper one of an even count), with every run's programs/s in
    `runs_programs_per_s`."""
    rows = [run()]
    while sum(r["seconds"] for r in rows) < min_seconds and len(rows) < MAX_RUNS:
        rows.append(run())
    ranked = sorted(rows, key=lambda r: r["programs_per_s"])
    return {**ranked[len(ranked) // 2], "runs_programs_per_s": [r["programs_per_s"] for r in rows]}


_SERVERS: list[ServerProcess] = []


def _stop_on_signal(signum: int, frame: Any) -> None:
    """SIGTERM: stop the running server and exit at once (programs in flight are abandoned)."""
    for srv in list(_SERVERS):
        srv.stop()
    os._exit(128 + signum)


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], capture_output=True, text=True,
                               cwd=HERE, check=True).stdout.strip()
        return head + (" + uncommitted changes to benchmarks/programs" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS))
    p.add_argument("--workloads", default=",".join(w.name for w in wl.WORKLOADS))
    p.add_argument("--all-workloads", action="store_true",
                   help="run every chosen workload under every configuration (default: each "
                        "configuration's own subset, see CONFIGS)")
    p.add_argument("--concurrency", type=int, default=8, help="programs in flight at once")
    p.add_argument("--scale", type=int, default=1, help="multiply every *_programs size by this")
    for name, default in wl.size_fields():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the server (more than the free cores is much slower)")
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--server-args", default="", help="extra `lmserver serve` flags for every server")
    p.add_argument("--machine", default="CPU, 2 cores (dev container)")
    p.add_argument("--model-label", default="SmolLM2-135M-Instruct (embedded)")
    p.add_argument("--note", default="", help="a remark printed under the machine's table")
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help=f"repeat a workload until its runs add up to this long (at most {MAX_RUNS} runs) "
                        "and report the median run")
    p.add_argument("--json", default=None, help="results file (default: results/<machine>.json)")
    p.add_argument("--no-readme", action="store_true", help="do not regenerate README.md")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, _stop_on_signal)
    pt.selftest(rounds=100)
    sizes = wl.Sizes(**{n: getattr(args, n) for n, _ in wl.size_fields()})
    sizes = replace(sizes, **{f: getattr(sizes, f) * args.scale for f, _ in wl.size_fields()
                              if f.endswith("_programs") or f == "agents"})
    chosen = {c.strip() for c in args.configs.split(",") if c.strip()}
    unknown = chosen - {c.name for c in CONFIGS}
    if unknown:
        p.error(f"unknown config(s) {sorted(unknown)}; known: {[c.name for c in CONFIGS]}")
    wanted = [w for w in wl.WORKLOADS if w.name in set(args.workloads.split(","))]
    extra = tuple(shlex.split(args.server_args))
    groups: dict[tuple[str, ...], list[Config]] = {}
    for cfg in CONFIGS:
        if cfg.name in chosen:
            groups.setdefault(cfg.server_args, []).append(cfg)
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    t_suite = time.perf_counter()
    for server_args, cfgs in groups.items():
        full_args = ["--context-length", str(args.context_length), *server_args, *extra]
        print(f"== server: {' '.join(full_args)}", flush=True)
        srv = ServerProcess(full_args, core=None, env={"OMP_NUM_THREADS": str(args.threads)})
        _SERVERS.append(srv)
        srv.start(timeout_s=900)
        try:
            with httpx.Client(base_url=srv.base_url, timeout=600) as client:
                regex_ok = supports_regex(client)
                for cfg in cfgs:
                    for w in wanted:
                        if cfg.workloads is not None and w.name not in cfg.workloads and not args.all_workloads:
                            continue
                        if w.constrained and not regex_ok:
                            skipped[f"{w.name}/{cfg.name}"] = "skipped: server lacks constrained decoding"
                            print(f"   {cfg.name:16} {w.name:20} skipped: server lacks constrained decoding")
                            continue
                        row = run_repeated(partial(run_workload, cfg, w, sizes, srv.base_url, client,
                                                   args.concurrency), args.min_seconds)
                        rows.append(row)
                        print(f"   {cfg.name:16} {w.name:20} {row['programs_per_s']:7.3f} prog/s "
                              f"lat {row['mean_latency_s']:6.2f}s hit {row['hit_rate']:.3f} "
                              f"(opt {row['optimal_hit_rate']:.3f}) ok {row['sanity_ok']}/{row['programs']} "
                              f"err {row['num_errors']} {row['seconds']:.1f}s"
                              + (f" (median of {len(row['runs_programs_per_s'])}: "
                                 f"{min(row['runs_programs_per_s']):.3f}-{max(row['runs_programs_per_s']):.3f})"
                                 if len(row["runs_programs_per_s"]) > 1 else ""), flush=True)
        finally:
            srv.stop()
            _SERVERS.remove(srv)
    suite_s = time.perf_counter() - t_suite
    command = "python benchmarks/programs/run_all.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = {
        "machine": args.machine, "model": args.model_label,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": git_commit(), "command": command.strip(), "suite_seconds": suite_s,
        "concurrency": args.concurrency, "server_threads": args.threads, "sizes": asdict(sizes),
        "configs": {c.name: c.note for c in CONFIGS if c.name in chosen},
        "rows": rows, "skipped": skipped, "note": args.note,
    }
    out = Path(args.json) if args.json else HERE / "results" / (re.sub(r"[^a-z0-9]+", "-", args.machine.lower())
                                                                 .strip("-") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {os.path.relpath(out)} ({suite_s:.0f} s)")
    print(report.machine_section(result))
    if not args.no_readme:
        report.write_readme(HERE)


if __name__ == "__main__":
    main()
