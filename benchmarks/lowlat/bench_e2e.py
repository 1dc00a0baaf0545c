"""lowlat plugins end to end through lmserver's engine: per-user decode tokens/s, plugin vs generic.

For each model shape (dummy bf16 weights drawn on the GPU) one `EngineCore` is built per plugin
setting (`--lowlat-plugins off`, then `require:<name>` for each plugin asked for), CUDA graphs on
(captured sizes up to 8). Each setting runs random 512-token prompts at concurrency 1, 4 and 8,
greedy, EOS ignored, and reports per-user decode tokens/s: the median over the users of
(tokens - 1) / (time from their first to their last token), and the P90 of the per-step latency
(reported as tokens/s, so the "P90" column is the slow tail). A greedy check compares the
plugin's tokens with the generic path's at concurrency 1 over `--check-tokens` steps (index of
the first difference; bf16 random weights have near-ties, so a late difference is rounding).

    PYTHONPATH=packages/server/src:packages/cfsm/src:packages/radixcache/src:packages/lowlat/src \
      python3 benchmarks/lowlat/bench_e2e.py --smol-folder MODEL_DIR --plugins nvidia --json OUT/e2e.json

MODEL_DIR holds SmolLM2's config.json and tokenizer files (the tokenizer serves every shape).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001,
    ),
    "mixtral-8x7b-4l": dict(  # Mixtral-8x7B's layer shape, 4 layers (the MoE stack's per-layer cost)
        architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, num_local_experts=8,
        num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
    ),
}
COPY_BANDWIDTH = 4.23e12  # B/s, the H200's measured device copy (DESIGN.md)


def floor_ms(config: dict[str, Any], bytes_per_param: int = 2) -> float:
    """Per-step floor at batch 1: the weights a decode step reads (every layer's qkv, o_proj, norms and MLP, or its
    router and top-k experts; then the final norm and lm_head, tied or not) at the copy bandwidth, in ms. A larger
    batch reads more experts (up to all of them), so an MoE model's floor there is higher. Pure."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", hidden // heads)
    mlp = 3 * hidden * config["intermediate_size"]
    experts = config.get("num_local_experts", 0)
    if experts:
        mlp = mlp * config["num_experts_per_tok"] + experts * hidden
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + mlp + 2 * hidden
    params = layers * per_layer + hidden + config["vocab_size"] * hidden
    return params * bytes_per_param / COPY_BANDWIDTH * 1e3


T0 = time.monotonic()
RESULTS: dict[str, Any] = {"rows": [], "checks": [], "errors": []}


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def shape_folder(name: str, smol: str) -> str:
    if name == "smollm2":
        return smol
    folder = Path(tempfile.mkdtemp(prefix=f"lowlat-e2e-{name}-"))
    for f in Path(smol).iterdir():
        if f.name != "config.json" and f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps(SHAPES[name]))
    return str(folder)


def plugin_registry() -> Any:
    """The installed plugins (entry points), or lowlat's built-in ones when lowlat runs from a source
    tree without its package metadata (as on a device machine with PYTHONPATH only)."""
    from lowlat import Registry
    from lowlat.plugins import amd, nvidia

    reg = Registry.from_entry_points()
    if len(reg):
        return reg
    reg = Registry()
    for obj in (nvidia.spec, amd.spec):
        for spec in obj if isinstance(obj, (list, tuple)) else [obj]:
            reg.add(spec)
    return reg


def make_core(path: str, tokenizer: str, plugins: str, backend: str = "triton") -> Any:
    from lmserver.config import ServerConfig
    from lmserver.engine.core import EngineCore
    from lowlat import use_registry

    config = ServerConfig(
        model_path=path, tokenizer_path=tokenizer, load_format="dummy", dtype="bfloat16",
        attention_backend=backend, cuda_graph_max_bs=8, max_total_tokens=65536, random_seed=3,
        lowlat_plugins=plugins,
    )
    with use_registry(plugin_registry()):
        return EngineCore(config)


def run(core: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float], list[float]]:
    """Runs prompts concurrently; returns outputs, per-user tok/s, and every step's seconds."""
    from lmserver.io_struct import GenerateReq, SamplingParams

    tag = f"{time.monotonic_ns()}"
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts, strict=True):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        core.add_request(GenerateReq(rid=rid, input_ids=ids, sampling_params=params))
    out: dict[str, list[int]] = {r: [] for r in rids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    steps: list[float] = []
    prev = None
    while core.has_work():
        outs = core.step()
        now = time.monotonic()
        if prev is not None and len(first) == len(rids):  # decode steps once every user started
            steps.append(now - prev)
        prev = now
        for o in outs:
            out[o.rid].extend(o.new_token_ids)
            if o.new_token_ids and o.rid not in first:
                first[o.rid] = now
            last[o.rid] = now
    rates = [(len(out[r]) - 1) / max(last[r] - first[r], 1e-9) for r in rids]
    return [out[r] for r in rids], rates, steps


def prompts_for(n: int, vocab: int, seed: int, length: int = 512) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, min(vocab, 49152), (length,), generator=gen).tolist() for _ in range(n)]


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def gpu_state() -> str:
    """SM clock, its maximum, temperature and power now (nvidia-smi), to tell a throttled run from a slow one."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi"
    query = "clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active"
    done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-i", "0"],
                          capture_output=True, text=True, timeout=20, check=False)
    return done.stdout.strip() or done.stderr.strip()


def bench_shape(name: str, smol: str, plugins: list[str], args: argparse.Namespace) -> None:
    path = shape_folder(name, smol)
    config = json.loads((Path(path) / "config.json").read_text())
    vocab, floor = config["vocab_size"], floor_ms(config)
    reference: list[int] | None = None
    suffix = "+all-batches" if args.all_batches else ""
    for setting in ["off"] + [f"require:{p}{suffix}" for p in plugins]:
        try:
            t = time.monotonic()
            core = make_core(path, smol, setting, args.attention_backend)
            build_s = time.monotonic() - t
        except Exception as exc:  # noqa: BLE001  (a plugin that cannot start is a result, not a crash)
            RESULTS["errors"].append({"model": name, "plugins": setting, "error": repr(exc)[:400]})
            log(f"{name} {setting}: start-up failed: {exc!r}"[:500])
            continue
        log(f"{name} {setting}: built in {build_s:.1f}s; GPU (SM MHz, max, C, W, throttle): {gpu_state()}")
        run(core, prompts_for(1, vocab, 99, 64), 8)  # warm-up
        toks, _, _ = run(core, prompts_for(1, vocab, 1), args.check_tokens)
        if setting == "off":
            reference = toks[0]
        elif reference is not None:
            check = {"model": name, "plugins": setting, "first_diff_vs_generic": first_diff(reference, toks[0]),
                     "tokens": args.check_tokens}
            RESULTS["checks"].append(check)
            log(f"check {check}")
        for conc in (1, 4, 8):
            _, rates, steps = run(core, prompts_for(conc, vocab, conc), args.new_tokens)
            steps.sort()
            p90_step = steps[int(0.9 * (len(steps) - 1))] if steps else float("nan")
            row = {"model": name, "plugins": setting, "concurrency": conc,
                   "tok_s_median": round(statistics.median(rates), 1),
                   "tok_s_p90": round(1 / p90_step, 1), "ms_per_step_median": round(1000 / statistics.median(rates), 3)}
            row["x_floor"] = round(row["ms_per_step_median"] / floor, 2)
            stats = core.get_stats()
            row["plugin_steps"] = stats.get("lowlat_plugin_steps", 0)
            RESULTS["rows"].append(row)
            log(str(row))
        if args.profile_steps:
            profile_decode(core, name, setting, vocab, args.profile_steps, args.trace_dir)
        dump(args.json)
        del core
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def profile_decode(core: Any, name: str, setting: str, vocab: int, steps: int, out_dir: str | None) -> None:
    """One user's decode under torch.profiler: wall ms per step, GPU-busy ms per step (the union of
    kernel intervals), the share of the step the GPU is idle, and the top kernels and host ops. A GPU
    busy most of the step means kernel time bounds it; a mostly idle GPU means the host does."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t = time.monotonic()
        _, _, step_s = run(core, prompts_for(1, vocab, 7), steps)
        wall = time.monotonic() - t
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy_us, end = 0.0, float("-inf")
    for a, b in spans:  # union of kernel intervals (us)
        if b > end:
            busy_us += b - max(a, end)
            end = b
    n = max(len(step_s), 1)
    row = {"model": name, "plugins": setting, "steps": len(step_s),
           "wall_ms_per_step": round(1000 * statistics.median(step_s), 3) if step_s else None,
           "gpu_busy_ms_per_step": round(busy_us / 1000 / (n + 1), 3), "run_s": round(wall, 3),
           "kernels": len(spans)}
    RESULTS.setdefault("profiles", []).append(row)
    log(f"profile {row}")
    keys = prof.key_averages()
    for sort in ("self_device_time_total", "self_cpu_time_total"):
        try:
            text = keys.table(sort_by=sort, row_limit=18, max_name_column_width=70)
        except Exception as exc:  # noqa: BLE001  (column names differ across torch versions)
            text = f"(no {sort} table: {exc!r})"
        print(f"--- {name} {setting}: top by {sort}\n{text}", flush=True)
    if out_dir:
        prof.export_chrome_trace(str(Path(out_dir) / f"trace-{name}-{setting.replace(':', '-')}.json"))


def dump(path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=1))


def print_table() -> None:
    base = {(r["model"], r["concurrency"]): r["tok_s_median"] for r in RESULTS["rows"] if r["plugins"] == "off"}
    print("\n| model | plugins | concurrency | tok/s/user median | P90-step tok/s | ms/step | x floor | x generic | plugin steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in RESULTS["rows"]:
        g = base.get((r["model"], r["concurrency"]))
        ratio = f"{r['tok_s_median'] / g:.2f}" if g else "-"
        print(f"| {r['model']} | {r['plugins']} | {r['concurrency']} | {r['tok_s_median']} | {r['tok_s_p90']} | "
              f"{r['ms_per_step_median']} | {r.get('x_floor', '-')} | {ratio} | {r['plugin_steps']} |")
    for c in RESULTS["checks"]:
        print(f"greedy {c['model']} {c['plugins']}: first difference vs generic at {c['first_diff_vs_generic']} "
              f"of {c['tokens']}")
    for p in RESULTS.get("profiles", []):
        print(f"profile {p['model']} {p['plugins']}: {p['wall_ms_per_step']} ms/step wall, "
              f"{p['gpu_busy_ms_per_step']} ms/step GPU busy, {p['kernels']} kernels in {p['steps']} steps")
    for e in RESULTS["errors"]:
        print(f"error {e['model']} {e['plugins']}: {e['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smol-folder", required=True)
    ap.add_argument("--shapes", default="smollm2,llama3-8b", help=f"smollm2 and/or {', '.join(SHAPES)}")
    ap.add_argument("--plugins", default="nvidia", help="comma list of plugin names to require")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--check-tokens", type=int, default=64)
    ap.add_argument("--attention-backend", default="triton", help="torch_native for a CPU smoke run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile-steps", type=int, default=0, help="also profile one user's decode of N tokens")
    ap.add_argument("--all-batches", action="store_true",
                    help="run the plugin at every batch it covers (lmserver's '+all-batches'), also where "
                         "lowlat.kernels.tuning.WINS_UP_TO sends larger batches to the generic path")
    ap.add_argument("--trace-dir", default=None, help="write each profile's chrome trace here")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    plugins = [p for p in args.plugins.split(",") if p]
    for name in args.shapes.split(","):
        bench_shape(name, args.smol_folder, plugins, args)
    dump(args.json)
    print_table()


if __name__ == "__main__":
    main()
