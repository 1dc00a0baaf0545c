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

    PYTHONPATH=... python benchmarks/lowlat/bench_step_kernels.py --model-path MODEL_DIR \\
        --settings fp8+plugin spec spec+plugin --sizes 1 8 [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
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


def make_core(path: str, extra: dict[str, Any], context: int) -> Any:
    from lmserver.config import ServerConfig
    from lmserver.engine.core import EngineCore
    from lowlat import use_registry

    config = ServerConfig(model_path=path, tokenizer_path=path, load_format="dummy", dtype="bfloat16",
                          cuda_graph_max_bs=8, context_length=context, max_total_tokens=65536, random_seed=3,
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
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    results: list[dict[str, Any]] = []
    for setting in args.settings:
        t0 = time.monotonic()
        core = make_core(args.model_path, SETTINGS[setting], args.context)
        build_s = time.monotonic() - t0
        run(core, prompts_for(1, vocab, 99, 64), 8)  # warm-up
        _, rates, steps = run(core, prompts_for(args.concurrency, vocab, 1), args.new_tokens)
        stats = {k: v for k, v in core.get_stats().items() if "lowlat" in k or k.startswith("spec")}
        print(f"\n=== {setting}: built in {build_s:.0f}s; engine c={args.concurrency} {statistics.median(rates):.1f} "
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
            results.append(dict(setting=setting, rows=bs, replay_us=us, engine_tok_s=statistics.median(rates), concurrency=args.concurrency, kernels=rows))
        del core, graphs
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
