"""Where a served prefill's time goes outside the engine's forward: py-spy samples of each server's processes.

Every setting's server up at once (as `bench_fp8_serving.py --interleave`: 0.85 of the GPU's memory in even shares),
then py-spy (`pip install py-spy`; it needs ptrace rights over the servers, its own children here) records each
server's front end (HTTP, tokenizer manager) and core (engine) process while `--rounds` rounds send the same fresh
prompt of `--prefill-len` random ids to each server in turn, one request at a time, one new token each. Per setting and
process: ms per request in each function (own samples, and lmserver's functions by inclusive samples), a device wait
showing in the call that waits. With both dtypes' servers side by side, the setting-dependent part of the server's time
outside the forward shows as the difference of the two tables.

    python benchmarks/fp8/profile_server_prefill.py --model-path MODEL_DIR --settings bf16-default fp8-default \\
        --out DIR     (raw py-spy samples, DIR/<setting>.<front|core>.txt, and DIR/summary.json)
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8_serving import SETTINGS, interleaved_rounds, start_servers_at_once  # noqa: E402


def children(pid: int) -> list[int]:
    """The direct child processes of ``pid`` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def core_pid(front: int) -> int:
    """The engine process of the server whose front end is ``front``: its child started by multiprocessing's spawn."""
    for pid in children(front):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        if "spawn_main" in cmd:
            return pid
    raise RuntimeError(f"no engine process under {front}: {children(front)}")


def summarize(raw: Path, requests: int, rate: int, top: int) -> dict[str, Any]:
    """ms per request by function (own samples) and lmserver's functions by inclusive samples, from py-spy's raw
    (collapsed-stack) output."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    per = 1e3 / rate / requests  # ms per request of one sample
    return {"samples": total, "ms_per_request": round(total * per, 3),
            "own": [(f, round(n * per, 3)) for f, n in own.most_common(top)],
            "lmserver_inclusive": [(f, round(n * per, 3)) for f, n in inclusive.most_common()
                                   if "lmserver" in f][:top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--server-args", default="--load-format dummy --dtype bfloat16 --device cuda --context-length 8192")
    ap.add_argument("--settings", nargs="+", default=["bf16-default", "fp8-default"], choices=list(SETTINGS))
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    servers: dict[str, Any] = {}
    spies: list[subprocess.Popen[bytes]] = []
    try:
        start_servers_at_once(args.model_path, args.server_args, args.settings, servers)
        rng = random.Random(5)
        with httpx.Client(timeout=600) as client:
            interleaved_rounds(client, servers, [args.prefill_len] * 3, args.vocab, rng)  # warm-up
            for name, srv in servers.items():
                for role, pid in (("front", srv.proc.pid), ("core", core_pid(srv.proc.pid))):
                    spies.append(subprocess.Popen([args.py_spy, "record", "-p", str(pid), "-r", str(args.rate), "-f",
                                                   "raw", "-o", str(out / f"{name}.{role}.txt"), "--nonblocking"],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            time.sleep(2)  # py-spy attached
            t0 = time.perf_counter()
            walls, server_s = interleaved_rounds(client, servers, [args.prefill_len] * args.rounds, args.vocab, rng)
            span = time.perf_counter() - t0
    finally:
        for spy in spies:
            spy.send_signal(2)  # SIGINT: py-spy writes what it has
        for spy in spies:
            try:
                _, err = spy.communicate(timeout=60)
                if spy.returncode:
                    print(f"  py-spy exited {spy.returncode}: {err.decode(errors='replace')[-300:]}", flush=True)
            except subprocess.TimeoutExpired:
                spy.kill()
        for srv in servers.values():
            srv.stop()
    summary: dict[str, Any] = {"span_s": round(span, 2), "rounds": args.rounds}
    for name in servers:
        summary[name] = {"request_ms": round(1e3 * statistics.median(walls[name]), 3),
                         "server_e2e_ms": round(1e3 * statistics.median(server_s[name]), 3)}
        for role in ("front", "core"):
            raw = out / f"{name}.{role}.txt"
            if raw.exists():
                summary[name][role] = summarize(raw, args.rounds, args.rate, args.top)
        print(f"\n=== {name}: request {summary[name]['request_ms']} ms, the server's e2e_latency "
              f"{summary[name]['server_e2e_ms']} ms (medians)", flush=True)
        for role in ("front", "core"):
            part = summary[name].get(role)
            if part is None:
                print(f"  {role}: no samples", flush=True)
                continue
            print(f"  {role}: {part['ms_per_request']} ms of samples per request (the whole run, idle included)")
            for label, key in (("own", "own"), ("lmserver, inclusive", "lmserver_inclusive")):
                print(f"    {label}:")
                for frame, ms in part[key]:
                    print(f"      {ms:9.3f}  {frame[:110]}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
