"""Compile every JSON Schema of a folder with cfsm, one at a time, each in a forked process
under a CPU-time limit: which compile, to what (`Index` / `GrammarIndex`), in how much CPU time,
and which time out or fail.

    python benchmarks/cfsm/bench_schema_dir.py --schema-dir DIR [--limit-s 30] [--json OUT]

The SmolLM2 vocabulary (as `bench_cfsm.py` loads it) is prepared once before the forks. cfsm is
whatever `import cfsm` finds (set PYTHONPATH to a `git archive` of a commit to measure it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cfsm import load_smollm2  # noqa: E402

import cfsm  # noqa: E402


def _compile(schema: Any, vocab: cfsm.Vocabulary, limit_s: int, conn: Any) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (limit_s, limit_s + 1))
    start = time.process_time()
    try:
        index = cfsm.compile_json_schema(schema, vocab, cfsm.CfsmConfig())
        out = {"result": type(index).__name__}
    except Exception as exc:  # noqa: BLE001 - reported per schema (cfsm's own errors and escapes alike)
        out = {"result": type(exc).__name__, "detail": str(exc)[:200]}
    out["cpu_s"] = time.process_time() - start
    conn.send(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schema-dir", required=True, type=Path)
    ap.add_argument("--limit-s", type=int, default=30, help="CPU seconds per compile")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    vocab = load_smollm2().vocab.prepare()
    ctx = mp.get_context("fork")
    rows = []
    print(f"cfsm from {os.path.dirname(cfsm.__file__)}; load average {os.getloadavg()[0]:.1f}", flush=True)
    for path in sorted(args.schema_dir.glob("*.json")):
        schema = json.loads(path.read_text())
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_compile, args=(schema, vocab, args.limit_s, send))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc.start()
        send.close()
        proc.join(args.limit_s * 20)  # NOTE: a wall cap far above the CPU limit (a loaded machine)
        if proc.is_alive():
            proc.kill()
            proc.join()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        row: dict[str, Any] = {"schema": path.stem}
        try:
            row.update(recv.recv())
        except EOFError:  # NOTE: killed at the CPU limit (SIGXCPU) or the wall cap
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            row.update({"result": "timeout", "cpu_s": cpu, "exitcode": proc.exitcode})
        rows.append(row)
        print(f"{row['schema']:>8} {row['result']:<24} {row['cpu_s']:7.2f} s", flush=True)
    compiled = [r for r in rows if r["result"] in ("Index", "GrammarIndex")]
    summary = {
        "schemas": len(rows), "compiled": len(compiled),
        "pushdown": sum(r["result"] == "GrammarIndex" for r in rows),
        "timeouts": sum(r["result"] == "timeout" for r in rows),
        "errors": sum(r["result"] not in ("Index", "GrammarIndex", "timeout") for r in rows),
        "cpu_s_total_compiled": round(sum(r["cpu_s"] for r in compiled), 2),
        "cpu_s_median_compiled": round(statistics.median(r["cpu_s"] for r in compiled), 3) if compiled else None,
        "over_10_s": sum(r["cpu_s"] > 10 for r in compiled),
        "load_average_end": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
