"""Short extends in the engine: replayed as decode rows in the decode CUDA graphs against the eager forward (GPU).

One `EngineCore` per setting (dummy weights, decode graphs up to `--graph-max-bs` rows), then for each case the
median wall time of a request with one new token, with extends in graphs (`--enable-cuda-graph-extend`), eagerly
(the same core, `extend_max_reads` set to 0), with `--prefill-graphs N` also in the prefill CUDA graphs
(runner/prefill_graph.py, extends up to N tokens), then in graphs again: a fresh prompt of N tokens (a new seed each
time: no radix hit), and a radix hit's suffix (a prefix prefilled once, then N new tokens after it each time). Also checks that both ways
give the same greedy tokens (prompts run twice, 8 new tokens, the radix cache flushed before each) and, where
they part ways, whether it is a near-tie (the top-2 margin against the logprob drift before it). Each line is printed (and appended to `--out`) as
soon as it is measured.

    PYTHONPATH=... python benchmarks/engine/bench_short_extend.py --model-path MODEL_DIR --settings fp8-default
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lowlat"))
from bench_e2e import prompts_for, run  # noqa: E402
from bench_step_kernels import make_core  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {  # the server's defaults with --enable-cuda-graph-extend
    "bf16-default": dict(enable_cuda_graph_extend=True),
    "fp8-default": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", enable_cuda_graph_extend=True),
}


def wall_ms(core: Any, prompts: list[list[int]], new_tokens: int = 1) -> float:
    """Median wall ms of each prompt's request (one at a time)."""
    times = []
    for p in prompts:
        t0 = time.perf_counter()
        run(core, [p], new_tokens)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def first_token_top2(core: Any, prompt: list[int], new_tokens: int = 8) -> tuple[list[int], list[list[tuple[float, int]]]]:
    """Greedy tokens of `prompt` and, per position, its top-2 (logprob, id): where graphs and eager part ways, the
    margin between the top two says whether it is a near-tie (rounding) or a wrong forward."""
    from lmserver.io_struct import GenerateReq, SamplingParams

    rid = f"top2-{time.monotonic_ns()}"
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(GenerateReq(rid=rid, input_ids=prompt, sampling_params=params, return_logprob=True,
                                 top_logprobs_num=2))
    tokens: list[int] = []
    tops: list[list[tuple[float, int]]] = []
    while core.has_work():
        for o in core.step():
            tokens.extend(o.new_token_ids)
            tops.extend([[(float(lp or 0.0), tid) for lp, tid, _ in top or []] for top in o.output_top_logprobs])
    return tokens, tops


def divergence(a: tuple[list[int], list[list[tuple[float, int]]]],
               b: tuple[list[int], list[list[tuple[float, int]]]]) -> str:
    """Where two greedy runs part ways: the position, each run's top-2 margin there, and the largest logprob
    difference of the shared top-1 ids before it."""
    (ta, pa), (tb, pb) = a, b
    at = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
    before = [abs(x[0][0] - y[0][0]) for x, y in zip(pa[:at], pb[:at], strict=False) if x and y]
    drift = f"max |logprob diff| before it {max(before):.4f}" if before else "no position before it"
    if at is None:
        return f"same {len(ta)} tokens; {drift}"
    margins = [p[at][0][0] - p[at][1][0] if len(p[at]) > 1 else float("nan") for p in (pa, pb)]
    return f"part at position {at}: top-2 margins {margins[0]:.4f} / {margins[1]:.4f}; {drift}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--settings", nargs="+", default=["fp8-default"], choices=list(SETTINGS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--hit-prefix", type=int, default=256, help="the radix hit's prefix length (0: no hit case); new "
                    "tokens x (prefix + new tokens) above the graphs' read bound (32,768) run eagerly both ways")
    ap.add_argument("--graph-max-bs", type=int, default=64)
    ap.add_argument("--max-reads", type=int, default=0,
                    help="the graphs' bound on rows x context per layer for this run (0: the server's, "
                         "EXTEND_MAX_READS): how long an extend the decode graphs may take before eager wins")
    ap.add_argument("--prefill-graphs", type=int, default=0,
                    help="also prefill CUDA graphs up to this many tokens (--enable-cuda-graph-prefill), a third "
                         "way (0: not built)")
    ap.add_argument("--attention-backend", default=None,
                    help="the engines' attention backend (default: the server's; `triton` on a CPU under "
                         "TRITON_INTERPRET=1 with LMSERVER_TEST_EAGER_GRAPHS=1 checks the three ways' tokens there)")
    ap.add_argument("--context", type=int, default=4096, help="the engines' context length (above the longest length)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None, help="append each line here too")
    args = ap.parse_args()
    vocab = 32000

    def say(line: str) -> None:
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    seeds = iter(range(10_000, 1_000_000))
    for setting in args.settings:
        t0 = time.monotonic()
        # NOTE: graphs are captured up to max_running_requests rows: at least --graph-max-bs of them
        extra = {**SETTINGS[setting], "max_running_requests": max(args.graph_max_bs, 64)}
        if args.attention_backend:
            extra["attention_backend"] = args.attention_backend
        extra["enable_cuda_graph_prefill"] = bool(args.prefill_graphs)  # NOTE: on by default on a GPU since 2026-12-05
        if args.prefill_graphs:
            extra["cuda_graph_prefill_max_tokens"] = args.prefill_graphs
        core = make_core(args.model_path, extra, args.context, graph_max_bs=args.graph_max_bs)
        graphs, prefill_graphs = core.runner.cuda_graph, core.runner.prefill_graph
        reads = args.max_reads or graphs.extend_max_reads
        say(f"=== {setting}: built in {time.monotonic() - t0:.0f}s; graph sizes up to {graphs.max_bs}, "
            f"extend_max_reads {reads}" + (f"; prefill graphs {prefill_graphs.token_sizes} x "
                                           f"{prefill_graphs.request_sizes}" if prefill_graphs else ""))

        def use(way: str, core: Any = core, reads: int = reads, prefill_graphs: Any = prefill_graphs) -> None:
            """Extends as decode rows in the decode graphs ("graphs"), eagerly, or in the prefill graphs."""
            core.runner.cuda_graph.extend_max_reads = reads if way == "graphs" else 0
            core.runner.prefill_graph = prefill_graphs if way == "pgraph" else None

        ways = ["graphs", "eager", *(["pgraph"] if prefill_graphs else [])]
        check = [prompts_for(1, vocab, next(seeds), n)[0] for n in args.lengths]
        outs = {}
        for way in ways:
            use(way)
            outs[way] = []
            for p in check:
                core.flush_cache()  # each way prefills the whole prompt (no radix hit on another's KV)
                outs[way].append(run(core, [p], 8)[0][0])
        for way in ways[1:]:
            say(f"  greedy tokens equal, graphs and {way}: {outs['graphs'] == outs[way]} ({outs[way][0][:4]} ...)")
        for p in check:
            runs = {}
            for way in ways:
                use(way)
                core.flush_cache()
                runs[way] = first_token_top2(core, p)
            for way in ways[1:]:
                say(f"    {len(p)}-token prompt, graphs vs {way}: {divergence(runs['graphs'], runs[way])}")
        use("eager")
        prefix = prompts_for(1, vocab, next(seeds), args.hit_prefix)[0] if args.hit_prefix else []
        if prefix:
            run(core, [prefix], 1)  # cached from now on
        for n in args.lengths:
            cases = [("fresh", lambda n=n: [prompts_for(1, vocab, next(seeds), n)[0] for _ in range(args.reps)])]
            if prefix:
                cases.append((f"hit {len(prefix)}+", lambda n=n, prefix=prefix: [
                    prefix + prompts_for(1, vocab, next(seeds), n)[0] for _ in range(args.reps)]))
            for kind, make in cases:
                row: dict[str, list[float]] = {}
                start = (graphs.num_extend_replays, prefill_graphs.num_replays if prefill_graphs else 0)
                for way in [*ways, "graphs"]:
                    use(way)
                    row.setdefault(way, []).append(wall_ms(core, make()))
                took = {"graphs": graphs.num_extend_replays - start[0],
                        "pgraph": (prefill_graphs.num_replays if prefill_graphs else 0) - start[1]}
                note = "" if took["graphs"] else " (no extend took a decode graph: over the read bound or the sizes)"
                if prefill_graphs and not took["pgraph"]:
                    note += " (no extend took a prefill graph: over its token sizes)"
                eager = row["eager"][0]
                pg = f", prefill graphs {row['pgraph'][0]:.2f} ms ({eager / row['pgraph'][0]:.2f}x)" if "pgraph" in row else ""
                say(f"  {kind} {n:4d} tokens: graphs {' / '.join(f'{v:.2f}' for v in row['graphs'])} ms, eager "
                    f"{eager:.2f} ms ({eager / min(row['graphs']):.2f}x){pg}{note}")
        use("graphs")
        del core
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
