"""Where a long prompt's prefill time goes, kernel by kernel, bf16 against FP8 (issue 33; CUDA GPU only).

For each setting one `EngineCore` is built in this process (dummy weights), then fresh prompts of `--length` random
tokens (no radix hits: a new seed per call) are prefilled with one new token each, under the torch profiler
(`benchmarks/lowlat/kprof.py`: each kernel's marginal time, overlaps counted once, and the idle time, i.e. host
work between kernels). Times are per layer (divided by the model's layer count) and the whole prefill. `--host`
also lists the host's CUDA runtime calls and device reads of one prefill (`kprof.host_calls`): a synchronizing
call there is what leaves the device idle.

    PYTHONPATH=... python benchmarks/fp8/bench_prefill_kernels.py --model-path MODEL_DIR --settings bf16 fp8 fp8w
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "lowlat"))
import kprof  # noqa: E402
from bench_e2e import prompts_for, run  # noqa: E402
from bench_step_kernels import make_core  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "bf16": dict(lowlat_plugins="off"),
    "fp8": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", lowlat_plugins="off"),
    "fp8w": dict(quantization="fp8", lowlat_plugins="off"),
    # the server's defaults on a GPU (lowlat auto: where the plugin serves decode, K is stored unrotated)
    "bf16-default": {},
    "fp8-default": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3"),
    # the same with the activation quantizers' launches of `--quant-launch` (lmserver.kernels.fp8_quant.quant_launch
    # replaced in this process while the setting runs)
    "fp8-default+q": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3"),
    # the defaults with prefill CUDA graphs asked for (`--enable-cuda-graph-prefill`, up to 2,048 tokens; the default on
    # one GPU since 2026-12-05) and without them
    "bf16-default+pgraph": dict(enable_cuda_graph_prefill=True),
    "fp8-default+pgraph": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", enable_cuda_graph_prefill=True),
    "bf16-default+eager-prefill": dict(enable_cuda_graph_prefill=False),
    "fp8-default+eager-prefill": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", enable_cuda_graph_prefill=False),
}


def quant_launches(text: str) -> dict[int, Any]:
    """`--quant-launch`: ``K=BLOCK_K:WARPS[:HINTS],...`` (HINTS 0 / 1, default 1) -> {row width: QuantLaunch}."""
    from lmserver.kernels.fp8_quant import QuantLaunch

    out = {}
    for item in filter(None, text.split(",")):
        k, _, spec = item.partition("=")
        nums = [int(v) for v in spec.split(":")]
        out[int(k)] = QuantLaunch(nums[0], nums[1], bool(nums[2]) if len(nums) > 2 else True)
    return out


def launch_override(setting: str, launches: dict[int, Any]) -> contextlib.AbstractContextManager[Any]:
    """For a ``+q`` setting: `fp8_quant.quant_launch` answering `launches` first (the default for other widths)."""
    if not setting.endswith("+q") or not launches:
        return contextlib.nullcontext()
    from lmserver.kernels import fp8_quant

    default = fp8_quant.quant_launch
    return mock.patch.object(fp8_quant, "quant_launch", lambda k, gated=False: launches.get(k) or default(k, gated))


def prefill_call(core: Any, vocab: int, length: int, first_seed: int = 1000) -> Callable[[], None]:
    """A call that prefills one fresh prompt of ``length`` random tokens (a new seed each time: no radix hits; calls
    made for one engine need seed ranges of their own, ``first_seed``)."""
    seeds = iter(range(first_seed, first_seed + 100_000))

    def prefill() -> None:
        run(core, prompts_for(1, vocab, next(seeds), length), 1)
        torch.cuda.synchronize()

    return prefill


def profile_prefill(core: Any, vocab: int, length: int, reps: int) -> tuple[float, list[dict[str, Any]]]:
    """The median wall ms of a fresh prompt's prefill (one new token) and its kernel breakdown over ``reps`` more."""
    prefill = prefill_call(core, vocab, length)
    prefill()
    walls = []
    for _ in range(reps):
        t = time.perf_counter()
        prefill()
        walls.append(time.perf_counter() - t)
    return 1e3 * sorted(walls)[len(walls) // 2], kprof.breakdown(prefill, reps=reps, warmup=1)


def host_profile(call: Callable[[], None], n: int, top: int) -> str:
    """cProfile of ``n`` calls (after one unprofiled): the functions by own time, then lmserver's by cumulative time,
    per call. The device's time shows in the call that waits for it (a sync or a device read)."""
    call()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats("lmserver", top)
    return f"  cProfile of {n} prefills (seconds are totals over them):\n" + out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="a folder with the model's config.json and tokenizer")
    ap.add_argument("--settings", nargs="+", default=["bf16", "fp8"], choices=list(SETTINGS))
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--host", action="store_true", help="also list the host's CUDA runtime calls of one prefill")
    ap.add_argument("--trace", default=None, help="a folder: one prefill's Chrome trace per setting (host + device)")
    ap.add_argument("--quant-launch", default="", help="for the +q settings: K=BLOCK_K:WARPS[:HINTS],... "
                    "(e.g. 14336=16384:32,4096=4096:8)")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="also cProfile this many prefills: the host's functions by own time, and lmserver's by "
                         "cumulative time (where the engine's time outside the layers goes)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    launches = quant_launches(args.quant_launch)
    config = json.loads((Path(args.model_path) / "config.json").read_text())
    vocab, layers = config["vocab_size"], config["num_hidden_layers"]
    results: list[dict[str, Any]] = []
    for setting in args.settings:
        t0 = time.monotonic()
        with launch_override(setting, launches):
            core = make_core(args.model_path, SETTINGS[setting], args.length + 64)
            build_s = time.monotonic() - t0
            wall_ms, rows = profile_prefill(core, vocab, args.length, args.reps)
        print(f"\n=== {setting}: built in {build_s:.0f}s; prefill of {args.length} tokens {wall_ms:.2f} ms wall "
              f"({args.length / wall_ms * 1e3:,.0f} tok/s)\n"
              + kprof.table(rows, per=layers, top=args.top, unit="us per layer"), flush=True)
        result = dict(setting=setting, length=args.length, wall_ms=wall_ms, layers=layers, kernels=rows)
        if args.host:  # the host's CUDA runtime calls and device reads of one prefill: where idle gaps come from
            result["host"] = kprof.host_calls(prefill_call(core, vocab, args.length, 200_000))
            print("  host calls of one prefill (calls, host us):\n" + "\n".join(
                f"  {r['call'][:48]:48s} {r['calls']:6d} {r['host_us']:10.1f}" for r in result["host"][:args.top]))
        if args.cprofile:
            print(host_profile(prefill_call(core, vocab, args.length, 400_000), args.cprofile, args.top), flush=True)
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            kprof.export_trace(prefill_call(core, vocab, args.length, 300_000), str(Path(args.trace) / f"{setting}.json"))
        results.append(result)
        del core
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
