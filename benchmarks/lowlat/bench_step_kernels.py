"""Where a decode or verify step's device time goes, kernel by kernel, inside lmserver's engine (CUDA GPU only).

For each setting one `EngineCore` is built in this process (dummy weights, CUDA graphs up to 8 rows), one user's
request runs (random prompt, greedy, EOS ignored) so that every captured graph holds a live step's inputs, then
for each graph size of `--sizes` the decode graph of that many rows is replayed: back to back (`replay us`, CUDA
events, the device's time per step with the host never in the way) and under the torch profiler (`kprof.py`: each
kernel's marginal time, PDL overlaps counted once, and the idle time between kernels). With speculative settings
the graph of 8 rows is what a batch-1 verify step of 6 rows (5 drafts + 1) replays: the last request left its
verify rows in it. The engine's own per-step time of that request (median) is printed too.

`--concurrency 8`: the measured run is 8 concurrent requests, so the graph of 8 rows holds 8 live decode rows.

Settings: `fp8` / `fp8+plugin` (`--quantization fp8 --kv-cache-dtype fp8_e4m3`, lowlat off / auto; `fp8+plugin-all`:
`auto+all-batches`, the plugin also above its measured coverage), `bf16` /
`bf16+plugin`, `spec` / `spec+plugin` (bf16, n-gram drafts: 5 per step, acceptance simulated at 3.5), `spec-fp8` /
`spec-fp8+plugin-all` (the same on FP8 weights and KV; the plugin also on verify steps its tables decline).

`--attn-f16 both` (issues 33 / 34): each setting with an FP8 KV cache and the plugin is built twice, the plugin's
attention dots on the cache widened to bf16 (as built by default) and in fp16 (`LaunchConfig.attn_f16`, labelled
`... attn-f16`), one after the other in this process; `on`: the fp16 one only. `--attn-block N`: the plugin's decode
attention KV block at every batch (`LaunchConfig.attn_tuned`; 0: its tuned blocks); `--attn-warps N`: its attention
launches' warps (`LaunchConfig.attn_warps`; 0: as built).

    PYTHONPATH=... python benchmarks/lowlat/bench_step_kernels.py --model-path MODEL_DIR \\
        --settings fp8+plugin spec spec+plugin --sizes 1 8 [--attn-f16 both] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kprof  # noqa: E402
from bench_e2e import plugin_registry, prompts_for, run  # noqa: E402
from bench_layer import replay_us  # noqa: E402

FP8 = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3")
SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=5, speculative_simulate_accept_length=3.5)
SETTINGS: dict[str, dict[str, Any]] = {
    "bf16": dict(lowlat_plugins="off"),
    "bf16+plugin": dict(lowlat_plugins="auto"),
    "fp8": dict(FP8, lowlat_plugins="off"),
    "fp8+plugin": dict(FP8, lowlat_plugins="auto"),
    "fp8+plugin-all": dict(FP8, lowlat_plugins="auto+all-batches"),
    "spec": dict(SPEC, lowlat_plugins="off"),
    "spec+plugin": dict(SPEC, lowlat_plugins="auto"),
    "spec-fp8": dict(SPEC, **FP8, lowlat_plugins="off"),
    "spec-fp8+plugin-all": dict(SPEC, **FP8, lowlat_plugins="auto+all-batches"),
}


@contextmanager
def launch_change(change: Callable[[Any], Any] | None) -> Iterator[None]:
    """Inside: ``lowlat``'s ``LaunchConfig.for_device`` returns ``change(lc)`` on a GPU (the plugins build their stacks
    with it), so that one engine setting runs a launch-config variant; None: unchanged."""
    from lowlat.kernels import ops

    original = ops.LaunchConfig.for_device.__func__  # type: ignore[attr-defined]

    def for_device(cls: Any, *a: Any, **k: Any) -> Any:
        lc = original(cls, *a, **k)
        return change(lc) if change is not None and lc.num_sms > 1 else lc
    ops.LaunchConfig.for_device = classmethod(for_device)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ops.LaunchConfig.for_device = classmethod(original)  # type: ignore[method-assign]


def attn_variants(setting: str, attn_f16: str, attn_block: int,
                  attn_warps: int = 0) -> list[tuple[str, Callable[[Any], Any] | None]]:
    """(label, LaunchConfig change) of each build of ``setting``: with an FP8 cache and the plugin, the attention's dots
    widened to bf16 and / or in fp16 (``attn_f16`` off / on / both), each at KV block ``attn_block`` (0: tuned) and
    ``attn_warps`` warps (0: as built)."""
    fp8_plugin = SETTINGS[setting].get("kv_cache_dtype") == "fp8_e4m3" and SETTINGS[setting]["lowlat_plugins"] != "off"
    modes = {"off": [False], "on": [True], "both": [False, True]}[attn_f16] if fp8_plugin else [False]
    out: list[tuple[str, Callable[[Any], Any] | None]] = []
    for f16 in modes:
        label = setting + (" attn-f16" if f16 else "") + (f" attn{attn_block}" if attn_block and fp8_plugin else "")
        label += f" attn-w{attn_warps}" if attn_warps and fp8_plugin else ""
        if not f16 and not ((attn_block or attn_warps) and fp8_plugin):
            out.append((label, None))
            continue

        def change(lc: Any, f16: bool = f16) -> Any:
            return replace(lc, attn_f16=f16, attn_tuned=((1 << 30, attn_block),) if attn_block else lc.attn_tuned,
                           attn_warps=attn_warps or lc.attn_warps)
        out.append((label, change))
    return out


def make_core(path: str, extra: dict[str, Any], context: int, graph_max_bs: int = 8) -> Any:
    from lmserver.config import ServerConfig
    from lmserver.engine.core import EngineCore
    from lowlat import use_registry

    config = ServerConfig(model_path=path, tokenizer_path=path, load_format="dummy", dtype="bfloat16",
                          cuda_graph_max_bs=graph_max_bs, context_length=context, max_total_tokens=65536, random_seed=3,
                          **extra)
    with use_registry(plugin_registry()):
        return EngineCore(config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="a folder with the model's config.json and tokenizer")
    ap.add_argument("--settings", nargs="+", default=["fp8+plugin"], choices=list(SETTINGS))
    ap.add_argument("--sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=1,
                    help="concurrent requests of the measured run (8: the graph of 8 rows keeps 8 live rows)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--attn-f16", default="off", choices=["off", "on", "both"],
                    help="FP8-cache settings with the plugin: its attention dots in fp16 (LaunchConfig.attn_f16)")
    ap.add_argument("--attn-block", type=int, default=0, help="the plugin's decode attention KV block (0: tuned)")
    ap.add_argument("--attn-warps", type=int, default=0, help="the plugin's attention launches' warps (0: as built)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    results: list[dict[str, Any]] = []
    runs = [(setting, label, change) for setting in args.settings
            for label, change in attn_variants(setting, args.attn_f16, args.attn_block, args.attn_warps)]
    for setting, label, change in runs:
        t0 = time.monotonic()
        with launch_change(change):
            core = make_core(args.model_path, SETTINGS[setting], args.context)
        build_s = time.monotonic() - t0
        run(core, prompts_for(1, vocab, 99, 64), 8)  # warm-up
        _, rates, steps = run(core, prompts_for(args.concurrency, vocab, 1), args.new_tokens)
        stats = {k: v for k, v in core.get_stats().items() if "lowlat" in k or k.startswith("spec")}
        print(f"\n=== {label}: built in {build_s:.0f}s; engine c={args.concurrency} {statistics.median(rates):.1f} "
              f"tok/s per user, step median {1e6 * statistics.median(steps):.0f} us; {stats}", flush=True)
        graphs = core.runner.cuda_graph
        for bs in args.sizes:
            graph = graphs.graphs.get(bs)
            if graph is None:
                print(f"  no graph of {bs} rows")
                continue
            us = replay_us(graph, 50)
            rows = kprof.breakdown(graph.replay, reps=3)
            print(f"  graph of {bs} rows: replay {us:.1f} us\n" + kprof.table(rows, top=args.top, unit="us per replay"),
                  flush=True)
            results.append(dict(setting=label, rows=bs, replay_us=us, engine_tok_s=statistics.median(rates), concurrency=args.concurrency, kernels=rows))
        del core, graphs
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
