"""Where a profiled call left the GPU idle: the gaps between device operations of a Chrome trace (torch.profiler's
`export_chrome_trace`, e.g. `bench_prefill_kernels.py --trace DIR`), each with the host operations running during it.

For every gap longer than `--min-us`: its offset from the first device operation, its length, the device operations
before and after it, and the innermost host operations (`cpu_op` / `python_function` / `cuda_runtime`) overlapping
it with their overlap. Then the host operations summed over all the gaps (what the host did while the GPU waited).

    python benchmarks/gpu/trace_gaps.py TRACE.json [--min-us 20] [--top 25]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "python_function", "cuda_runtime", "user_annotation")


def gaps(events: list[dict[str, Any]], min_us: float) -> list[dict[str, Any]]:
    """Idle stretches between consecutive device operations (by start time, merged over overlaps). Pure."""
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e), key=lambda e: e["ts"])
    out: list[dict[str, Any]] = []
    if not dev:
        return out
    t0, end, prev = dev[0]["ts"], dev[0]["ts"] + dev[0]["dur"], dev[0]
    for e in dev[1:]:
        if e["ts"] - end >= min_us:
            out.append({"at_us": end - t0, "us": e["ts"] - end, "start": end, "stop": e["ts"],
                        "before": prev["name"], "after": e["name"]})
        if e["ts"] + e["dur"] >= end:
            end, prev = e["ts"] + e["dur"], e
    return out


def host_during(events: list[dict[str, Any]], start: float, stop: float) -> list[tuple[str, float, float]]:
    """Host operations overlapping [start, stop): (name, overlap us, own duration us), innermost (shortest) kept
    where one contains another. Pure."""
    over = [e for e in events if e.get("cat") in HOST_CATS and "dur" in e
            and e["ts"] < stop and e["ts"] + e["dur"] > start]
    rows = []
    for e in over:
        inner = any(o is not e and o["ts"] >= e["ts"] and o["ts"] + o["dur"] <= e["ts"] + e["dur"]
                    and o["dur"] < e["dur"] for o in over)
        if not inner:
            rows.append((e["name"], min(stop, e["ts"] + e["dur"]) - max(start, e["ts"]), e["dur"]))
    return sorted(rows, key=lambda r: -r[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.trace) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    found = gaps(events, args.min_us)
    total = sum(g["us"] for g in found)
    print(f"{len(found)} gaps >= {args.min_us:.0f} us, {total:.0f} us in all")
    by_host: dict[str, float] = defaultdict(float)
    for g in found:
        for name, overlap, _ in host_during(events, g["start"], g["stop"]):
            by_host[name] += overlap
    for g in sorted(found, key=lambda g: -g["us"])[: args.top]:
        host = host_during(events, g["start"], g["stop"])[:4]
        said = "; ".join(f"{n[:60]} {o:.0f}/{d:.0f}" for n, o, d in host)
        print(f"  at {g['at_us']:9.0f} us  gap {g['us']:7.1f} us  {g['before'][:30]} -> {g['after'][:30]}  | {said}")
    print("host operations over the gaps (innermost, overlap us):")
    for name, us in sorted(by_host.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {us:9.0f}  {name[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
