"""GPU decode benchmark and checks of the CUDA-graph path, in one run (one H200 call).

1. Checks (SmolLM2-135M shape, dummy weights, float32 then bfloat16): greedy tokens of the
   engine with CUDA graphs on vs off, and `triton` vs `torch_native`, on 3 concurrent requests
   (padded to the captured size 4).
   With CUDA graphs, also the overlap schedule on vs off (same tokens expected).
2. Timing through `EngineCore` (scheduler, sampler, detokenizer included): decode tokens/s per
   user at batch 1 and at concurrency 8 (512-token random prompts, greedy, EOS ignored), with and
   without CUDA graphs, for the SmolLM2-135M shape and the Llama-3-8B shape (bf16 dummy
   weights drawn on the GPU; the 8B KV cache sized by mem_fraction_static). With CUDA graphs,
   `--overlap both` (the default) times the overlap schedule off and on side by side
   (`--enable-overlap-schedule`: the host handles step N's tokens while the GPU runs step N+1).
3. If time remains: HF transformers eager `generate` on the same SmolLM2 shape (bf16 random).

    PYTHONPATH=packages/server/src:packages/cfsm/src:packages/radixcache/src:packages/lowlat/src \
      python3 benchmarks/gpu/bench_decode.py --smol-folder MODEL_DIR --json OUT/gpu.json

    # only the overlap comparison, CUDA graphs on:
    python3 benchmarks/gpu/bench_decode.py --smol-folder MODEL_DIR --skip-checks --no-eager --overlap both

MODEL_DIR holds SmolLM2's config.json and tokenizer files (no weights needed: dummy weights).
Prints one table; writes JSON after every section (partial results survive a time-out).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
)
HBM_FLOOR_MS = {"llama3-8b": 3.55}  # 15.0 GB read per step / 4.23 TB/s measured copy bandwidth

T0 = time.monotonic()
RESULTS: dict[str, Any] = {"checks": {}, "timing": [], "hf": None, "env": {}}


def elapsed() -> float:
    return time.monotonic() - T0


def dump(path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=1))


def make_core(model_path: str, tokenizer_path: str, **cfg: Any) -> Any:
    from lmserver.config import ServerConfig
    from lmserver.engine.core import EngineCore

    return EngineCore(ServerConfig(model_path=model_path, tokenizer_path=tokenizer_path, load_format="dummy", **cfg))


def run_requests(core: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
    """Runs prompts concurrently (greedy, EOS ignored); returns output ids and each request's
    decode tokens/s (tokens after the first over the time since the first)."""
    from lmserver.io_struct import GenerateReq, SamplingParams

    tag = f"{time.monotonic_ns()}"
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts, strict=True):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        core.add_request(GenerateReq(rid=rid, input_ids=ids, sampling_params=params))
    out: dict[str, list[int]] = {r: [] for r in rids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while core.has_work():
        for o in core.step():
            now = time.monotonic()
            out[o.rid].extend(o.new_token_ids)
            if o.new_token_ids and o.rid not in first:
                first[o.rid] = now
            last[o.rid] = now
    rates = [(len(out[r]) - 1) / max(last[r] - first[r], 1e-9) for r in rids]
    return [out[r] for r in rids], rates


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def first_diff(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Index of the first differing token over the requests (None when identical)."""
    pos = [next((i for i, (x, y) in enumerate(zip(ra, rb, strict=False)) if x != y), None) for ra, rb in zip(a, b, strict=True)]
    found = [p for p in pos if p is not None]
    return min(found) if found else None


def flushed_run(core: Any, prompts: list[list[int]], new_tokens: int, overlap: bool) -> tuple[list[list[int]], list[float]]:
    """`run_requests` from an empty radix cache with the overlap schedule on or off."""
    assert core.flush_cache()
    core.overlap = overlap
    try:
        return run_requests(core, prompts, new_tokens)
    finally:
        core.overlap = False


def release() -> None:
    """Returns the memory of deleted engines to the GPU (the next KV sizing reads free memory)."""
    gc.collect()
    torch.cuda.empty_cache()


def checks(smol: str) -> None:
    prompts = random_prompts(3, 40, 49152, seed=7)  # batch 3: padded to the captured 4
    prompts[1] = prompts[1][:9]
    for dtype in ("float32", "bfloat16"):
        toks: dict[str, list[list[int]]] = {}
        for backend in ("triton", "torch_native"):
            core = make_core(smol, smol, dtype=dtype, attention_backend=backend, cuda_graph_max_bs=4,
                             max_total_tokens=16384, random_seed=3)
            graphs = core.runner.cuda_graph
            assert graphs is not None, "CUDA graphs were not captured"
            toks[f"{backend}+graph"], _ = run_requests(core, prompts, 48)
            toks[f"{backend}+graph+serial"], _ = flushed_run(core, prompts, 48, overlap=False)
            toks[f"{backend}+graph+overlap"], _ = flushed_run(core, prompts, 48, overlap=True)
            assert core.get_stats()["overlap_steps"] > 0, "the overlap schedule never chained a step"
            core.runner.cuda_graph = None
            toks[f"{backend}"], _ = run_requests(core, prompts, 48)
            del core, graphs
            release()
        RESULTS["checks"][dtype] = {
            "graph_vs_eager_triton": first_diff(toks["triton+graph"], toks["triton"]),
            "graph_vs_eager_torch_native": first_diff(toks["torch_native+graph"], toks["torch_native"]),
            "triton_vs_torch_native_eager": first_diff(toks["triton"], toks["torch_native"]),
            "overlap_vs_serial_triton_graph": first_diff(toks["triton+graph+overlap"], toks["triton+graph+serial"]),
            "overlap_vs_serial_torch_native_graph": first_diff(toks["torch_native+graph+overlap"],
                                                               toks["torch_native+graph+serial"]),
            "tokens_per_request": 48,
        }
        print(f"[{elapsed():6.1f}s] checks {dtype}: {RESULTS['checks'][dtype]}", flush=True)


def timing(name: str, model_path: str, tokenizer: str, vocab: int, new_tokens: int, eager_tokens: int,
           budget_s: float, overlap_modes: tuple[bool, ...] = (False,), eager: bool = True, **cfg: Any) -> None:
    t = time.monotonic()
    core = make_core(model_path, tokenizer, dtype="bfloat16", attention_backend="triton", cuda_graph_max_bs=8, **cfg)
    build_s = time.monotonic() - t
    rc = core.resolved_config
    print(f"[{elapsed():6.1f}s] {name}: built in {build_s:.1f}s, KV tokens {rc.max_total_tokens}, "
          f"mem_fraction_static {rc.mem_fraction_static}", flush=True)
    graphs = core.runner.cuda_graph
    run_requests(core, random_prompts(1, 64, vocab, seed=1), 8)  # warm-up: prefill kernels
    for conc in (1, 8):
        prompts = random_prompts(conc, 512, vocab, seed=conc)
        variants = [(True, o) for o in overlap_modes] + ([(False, False)] if eager else [])
        for use_graph, overlap in variants:
            if elapsed() > budget_s:
                print(f"skipped {name} conc {conc} graph {use_graph} overlap {overlap}: time budget", flush=True)
                continue
            core.runner.cuda_graph = graphs if use_graph else None
            core.overlap = overlap
            n = new_tokens if use_graph else eager_tokens
            _, rates = run_requests(core, prompts, n)
            per_user = sum(rates) / len(rates)
            fused = not cfg.get("disable_fused_kernels", False)
            row = {"model": name, "concurrency": conc, "cuda_graph": use_graph, "overlap": overlap, "fused": fused,
                   "new_tokens": n,
                   "tok_s_per_user": round(per_user, 1), "ms_per_step": round(1000 / per_user, 2),
                   "build_s": round(build_s, 1), "kv_tokens": rc.max_total_tokens}
            if name in HBM_FLOOR_MS:
                row["x_hbm_floor"] = round(1000 / per_user / HBM_FLOOR_MS[name], 2)
            RESULTS["timing"].append(row)
            print(f"[{elapsed():6.1f}s] {row}", flush=True)
    del core, graphs
    release()


def hf_eager(smol: str, steps: int) -> None:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(smol)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    ids = torch.tensor(random_prompts(1, 512, cfg.vocab_size, seed=1), device="cuda")

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t = time.monotonic()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.monotonic() - t

    gen(4)
    t1, tn = gen(1), gen(steps)
    rate = (steps - 1) / (tn - t1)
    RESULTS["hf"] = {"model": "smollm2-135m", "transformers": transformers.__version__, "tok_s": round(rate, 1),
                     "ms_per_step": round(1000 / rate, 2), "new_tokens": steps}
    print(f"[{elapsed():6.1f}s] hf eager: {RESULTS['hf']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smol-folder", required=True, help="SmolLM2 config.json + tokenizer files")
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget-s", type=float, default=250.0, help="skip remaining sections after this")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--overlap", choices=["off", "on", "both"], default="both",
                    help="overlap schedule in the CUDA-graph timings (--enable-overlap-schedule); both: side by side")
    ap.add_argument("--enable-overlap-schedule", dest="overlap", action="store_const", const="on",
                    help="the same as --overlap on")
    ap.add_argument("--no-eager", action="store_true", help="skip the timings without CUDA graphs")
    ap.add_argument("--fused", choices=["on", "off", "both"], default="on",
                    help="fused Triton layer kernels (off = --disable-fused-kernels); both: one engine each")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lmserver.runner.resolve").setLevel(logging.INFO)
    logging.getLogger("lmserver.runner.cuda_graph").setLevel(logging.INFO)
    import triton

    RESULTS["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    print(RESULTS["env"], flush=True)
    smol = args.smol_folder
    if not args.skip_checks:
        checks(smol)
        dump(args.json)
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.overlap]
    opts: dict[str, Any] = {"overlap_modes": modes, "eager": not args.no_eager}
    for disable_fused in {"on": (False,), "off": (True,), "both": (True, False)}[args.fused]:
        opts["disable_fused_kernels"] = disable_fused
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(LLAMA3_8B))
            timing("llama3-8b", tmp, smol, LLAMA3_8B["vocab_size"], 256, 64, args.budget_s - 40, **opts)  # KV by mem fraction
        dump(args.json)
        timing("smollm2-135m", smol, smol, 49152, 256, 128, args.budget_s - 20, max_total_tokens=65536, **opts)
        dump(args.json)
    if elapsed() < args.budget_s - 12:
        hf_eager(smol, 32)
        dump(args.json)
    print("\n| model | concurrency | CUDA graph | overlap | fused kernels | tok/s per user | ms/step | x HBM floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in RESULTS["timing"]:
        print(f"| {r['model']} | {r['concurrency']} | {'on' if r['cuda_graph'] else 'off'} | "
              f"{'on' if r['overlap'] else 'off'} | {'on' if r['fused'] else 'off'} | {r['tok_s_per_user']} | "
              f"{r['ms_per_step']} | "
              f"{r.get('x_hbm_floor', '')} |")
    if RESULTS["hf"]:
        print(f"| smollm2-135m HF eager | 1 | off | off | - | {RESULTS['hf']['tok_s']} | {RESULTS['hf']['ms_per_step']} | |")
    print("checks (first differing token index, None = identical):", json.dumps(RESULTS["checks"]))
    print(f"total {elapsed():.1f}s")


if __name__ == "__main__":
    main()
