"""Where one user's decode step goes (concurrency 1): the device's work against the engine's step.

For each model shape and plugin setting (engines built as in `bench_e2e.py`) it reports, in us:

- `replay`: the batch-1 decode CUDA graph replayed back to back (the device's time per step
  with the host never in the way: embedding, layers, final norm, lm_head);
- `device step`: the same plus what the engine adds on the device per step outside the graph
  (the logits copy and the greedy argmax);
- `replay host`: host time of one `graph.replay()` call (the launch of its kernel nodes);
- `engine step`: the median step of a real decode through `EngineCore.step()` (overlap schedule
  on), split into the host time inside the graph runner's `forward`, inside sampling, waiting
  for the previous step's tokens (`wait`: the host is ahead of the device), and the rest
  (scheduling, landing, detokenizing, the loop).

A `wait` near zero with an engine step above `device step` means the host bounds the step; a
large `wait` means the device does.

    PYTHONPATH=packages/server/src:packages/cfsm/src:packages/radixcache/src:packages/lowlat/src \
      python3 benchmarks/lowlat/bench_step.py --smol-folder MODEL_DIR --shapes smollm2 --plugins nvidia
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_e2e import make_core, prompts_for, run, shape_folder


def timed_device(fn: Callable[[], object], iters: int) -> float:
    """Microseconds per call of `fn` queued back to back (one sync at the end)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / iters


def host_call_us(fn: Callable[[], object], iters: int, before: Callable[[], object] | None = None) -> float:
    """Median host microseconds of one call of `fn` on an idle device, or right after `before`
    (device work still running when `fn` is called)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


class HostTimers:
    """Wraps methods with host timers: seconds spent inside each, summed per name."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, attr: str, name: str) -> None:
        orig = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t

        self._undo.append((owner, attr, orig))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)


def host_profile(core: Any, vocab: int, steps: int, top: int) -> None:
    """cProfile over one user's decode: the host functions with the most own time (a call that
    blocks on the device shows up here as a large own time in a C function)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run(core, prompts_for(1, vocab, 8), steps)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def anatomy(core: Any, vocab: int, steps: int) -> dict[str, float]:
    from lmserver.engine import core as core_mod
    from lmserver.engine.overlap import Launched
    from lmserver.runner.sampler import greedy_argmax

    row: dict[str, float] = {}
    graphs = core.runner.cuda_graph
    run(core, prompts_for(1, vocab, 5), 16)  # a live decode state for the graph's buffers
    graph, logits = graphs.graphs[1], graphs.outputs[1]
    row["replay"] = timed_device(graph.replay, steps)

    def device_step() -> None:
        graph.replay()
        greedy_argmax(logits[:1].clone())

    row["device step"] = timed_device(device_step, steps)
    row["replay host"] = host_call_us(graph.replay, 50)
    row["replay host, same graph in flight"] = host_call_us(graph.replay, 50, before=graph.replay)
    other = graphs.graphs[min(s for s in graphs.graphs if s > 1)]
    row["replay host, other graph in flight"] = host_call_us(graph.replay, 50, before=other.replay)
    timers = HostTimers()
    timers.wrap(graphs, "forward", "forward")
    timers.wrap(core_mod, "sample_tensor", "sample")
    timers.wrap(Launched, "tokens", "wait")
    try:
        _, _, step_s = run(core, prompts_for(1, vocab, 6), steps)
    finally:
        timers.restore()
    n = steps + 1  # every step of the run incl. prefill; the split below is a per-step mean
    row["engine step"] = 1e6 * statistics.median(step_s)
    for name, total in timers.total.items():
        row[f"  {name}"] = 1e6 * total / n
    row["  rest"] = 1e6 * sum(step_s) / len(step_s) - sum(1e6 * t / n for t in timers.total.values())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smol-folder", required=True)
    ap.add_argument("--shapes", default="smollm2")
    ap.add_argument("--plugins", default="nvidia", help="comma list of plugin names to require")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default=None)
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also print the N host functions with the most own time (cProfile) per setting")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step needs a CUDA device (it times CUDA graph replays)")
    results: dict[str, dict[str, float]] = {}
    for name in args.shapes.split(","):
        path = shape_folder(name, args.smol_folder)
        vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        for setting in ["off"] + [f"require:{p}" for p in args.plugins.split(",") if p]:
            core = make_core(path, args.smol_folder, setting)
            run(core, prompts_for(1, vocab, 99, 64), 8)  # warm-up
            results[f"{name} {setting}"] = anatomy(core, vocab, args.steps)
            if args.host_profile:
                host_profile(core, vocab, args.steps, args.host_profile)
            print(f"{name} {setting}: " + ", ".join(f"{k.strip()} {v:.1f}" for k, v in results[f'{name} {setting}'].items()),
                  flush=True)
            del core
            gc.collect()
            torch.cuda.empty_cache()
    cols = list(results)
    print("\n| us per step | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for key in next(iter(results.values())):
        print(f"| {key} | " + " | ".join(f"{results[c][key]:.1f}" for c in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
