"""Per-kernel breakdown of replayed CUDA work with the torch profiler (CUPTI), for PDL-chained kernels too.

Under programmatic dependent launch a kernel starts before the one ahead of it has finished (its blocks wait in
``gdc_wait``), so kernel durations overlap and their sum exceeds the wall time. ``breakdown`` walks the kernels in
start order and gives each one its *marginal* time: how far it moves the end of the GPU's busy span beyond what the
kernels before it already covered (``end - max(start, covered)``), and counts the time no kernel ran as ``(idle)``.
The marginal times and the idle time add up to the profiled span exactly; a kernel whose work hides under the one
before it costs ~0 here. ``own`` is the plain sum of durations (overlaps counted twice).

    rows = breakdown(lambda: graph.replay(), reps=5)   # list of dicts, us per rep, largest marginal first
    print(table(rows, per=32, unit="us per layer"))
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

_TRITON_SUFFIX = re.compile(r"_\d+d\d+d\w*$|_0d1d\w*$")


def short_name(name: str, width: int = 48) -> str:
    """A kernel name without template arguments, argument lists and Triton's specialization suffixes."""
    name = name.split("(")[0].split("<")[0].strip()
    name = _TRITON_SUFFIX.sub("", name)
    for prefix in ("void ", "at::native::", "cutlass::", "triton_"):
        name = name.replace(prefix, "")
    return name[:width]


def kernel_spans(prof: Any) -> list[tuple[float, float, str]]:
    """(start us, end us, short name) of every device kernel and memory operation the profiler saw, by start."""
    spans = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        spans.append((float(e.time_range.start), float(e.time_range.end), short_name(e.name)))
    spans.sort()
    return spans


def marginal(spans: list[tuple[float, float, str]]) -> tuple[dict[str, list[float]], float, float]:
    """Per name: [marginal us, own us, count]; the idle us between the first start and the last end; that span. Pure."""
    out: dict[str, list[float]] = {}
    idle = 0.0
    covered = float("-inf")
    first = spans[0][0] if spans else 0.0
    for start, end, name in spans:
        row = out.setdefault(name, [0.0, 0.0, 0.0])
        if covered != float("-inf") and start > covered:
            idle += start - covered
        row[0] += max(0.0, end - max(start, covered))
        row[1] += end - start
        row[2] += 1
        covered = max(covered, end)
    span = (covered - first) if spans else 0.0
    return out, idle, span


def breakdown(fn: Callable[[], object], reps: int = 5, warmup: int = 3) -> list[dict[str, Any]]:
    """Profile ``reps`` calls of ``fn`` (each synchronized, so nothing of one overlaps the next): per kernel name its
    marginal and own us per call and launches per call, plus ``(idle)`` and ``(span)`` rows; largest marginal first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    idle = span = 0.0
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        rows, i, s = marginal(kernel_spans(prof))
        idle += i
        span += s
        for name, (m, own, n) in rows.items():
            acc = totals.setdefault(name, [0.0, 0.0, 0.0])
            acc[0] += m
            acc[1] += own
            acc[2] += n
    out = [dict(kernel=k, marginal_us=v[0] / reps, own_us=v[1] / reps, launches=v[2] / reps) for k, v in totals.items()]
    out.sort(key=lambda r: -r["marginal_us"])
    out.append(dict(kernel="(idle)", marginal_us=idle / reps, own_us=0.0, launches=0.0))
    out.append(dict(kernel="(span)", marginal_us=span / reps, own_us=0.0, launches=0.0))
    return out


def table(rows: list[dict[str, Any]], per: float = 1.0, unit: str = "us", top: int = 14) -> str:
    """The rows as text: marginal and own time divided by ``per`` (e.g. the layer count), launches likewise."""
    body = [r for r in rows if not r["kernel"].startswith("(")][:top]
    rest = [r for r in rows if not r["kernel"].startswith("(")][top:]
    lines = [f"  {'kernel':48s} {'marginal':>9s} {'own':>9s} {'launches':>8s}  ({unit})"]
    for r in body:
        lines.append(f"  {r['kernel']:48s} {r['marginal_us'] / per:9.2f} {r['own_us'] / per:9.2f} {r['launches'] / per:8.2f}")
    if rest:
        lines.append(f"  {'(other ' + str(len(rest)) + ' names)':48s} {sum(r['marginal_us'] for r in rest) / per:9.2f}")
    for r in rows:
        if r["kernel"].startswith("("):
            lines.append(f"  {r['kernel']:48s} {r['marginal_us'] / per:9.2f}")
    return "\n".join(lines)


def host_calls(fn: Callable[[], object], names: tuple[str, ...] = ("cuda", "aten::item", "aten::_local_scalar_dense",
                                                                    "aten::to", "aten::copy_")) -> list[dict[str, Any]]:
    """One profiled call of ``fn`` with host activity: per host event whose name starts with one of ``names`` (the
    CUDA runtime's calls, e.g. ``cudaStreamSynchronize`` / ``cudaMemcpyAsync``, and the torch ops that read a device
    value on the host) its count and host us; largest time first. Where a device timeline shows idle gaps, a
    synchronizing call here is the usual cause."""
    prof = _profiled_with_host(fn)
    return summarize_host_events(((e.name, e.device_type == torch.autograd.DeviceType.CPU,
                                   float(e.time_range.end - e.time_range.start)) for e in prof.events()), names)


def _profiled_with_host(fn: Callable[[], object]) -> Any:
    """The torch profiler (host and device activity) of one synchronized call of ``fn``, after one unprofiled call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def export_trace(fn: Callable[[], object], path: str) -> None:
    """One profiled call of ``fn`` (host and device activity, launch-to-kernel flows) written as a Chrome trace to
    ``path``: to tell an idle gap the host left (the next kernel launched after the one before it ended) from one the
    device took."""
    _profiled_with_host(fn).export_chrome_trace(path)


def summarize_host_events(events: Iterable[tuple[str, bool, float]], names: tuple[str, ...]) -> list[dict[str, Any]]:
    """(name, on the host, us) events -> per host name of the given prefixes: calls and us, largest us first. Pure."""
    out: dict[str, list[float]] = {}
    for name, on_host, us in events:
        if on_host and name.startswith(names):
            row = out.setdefault(name, [0.0, 0.0])
            row[0] += 1
            row[1] += us
    rows = [dict(call=k, calls=int(v[0]), host_us=v[1]) for k, v in out.items()]
    rows.sort(key=lambda r: -r["host_us"])
    return rows
