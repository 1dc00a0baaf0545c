"""lowlat's `nvidia` plugin under tensor parallelism (issue 35): per-user decode at batch 1 (and more) of the plugin
at TP N against lmserver's generic TP N CUDA-graph path and against the plugin at TP 1.

Each setting `TP:PLUGIN` (`off`: lmserver's own forward; a plugin name: `--lowlat-plugins require:<name>`) is one
offline `lmserver.Engine` (dummy weights of a `bench_tp.SHAPES` shape, decode CUDA graphs on every rank), one after
the other in this process. Per setting: a greedy check against the first setting's tokens (bf16 random weights have
near-ties: a late first difference is rounding), then for each concurrency the per-user decode tokens/s ((decode
time of `--decode-tokens` steps, the prefill-only run's time taken off) per step), and the plugin's own account
(decode steps it ran, fallback reasons): a setting whose plugin ran no decode step measures nothing of the plugin.

Targets (issue 35, 8B shape at TP 2, batch 1): the plugin >= 1.2x the generic TP 2 path and >= 1.5x the plugin at
TP 1. `--dry-run` prints the settings, each rank's weight bytes per decode step and their floor at the copy
bandwidth, and runs nothing (any machine). On a 2-GPU machine (after `benchmarks/gpu/device_setup.sh install`):

    python benchmarks/tp/bench_lowlat_tp.py --settings 1:nvidia,2:off,2:nvidia --shape llama3-8b --json OUT/tp.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tp import SHAPES, decode_step_s, model_folder  # noqa: E402  (the TP benchmark's shapes and model folders)

COPY_BANDWIDTH = 4.23e12  # B/s, the H200's measured device copy (DESIGN.md)
TP_SIZES = (1, 2, 4, 8)
TARGETS = (("plugin TP{tp} / generic TP{tp}", 1.2), ("plugin TP{tp} / plugin TP1", 1.5))


@dataclass(frozen=True)
class Setting:
    tp: int
    plugin: str  # "off" or a plugin name

    @property
    def lowlat_plugins(self) -> str:
        """The engine's `--lowlat-plugins` value."""
        return "off" if self.plugin == "off" else f"require:{self.plugin}"

    @property
    def label(self) -> str:
        return f"{'generic' if self.plugin == 'off' else self.plugin} TP{self.tp}"


def parse_settings(text: str) -> list[Setting]:
    """`1:nvidia,2:off,2:nvidia` -> settings; raises ValueError naming a bad item. Pure."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        tp, sep, plugin = item.partition(":")
        if not sep or not tp.isdigit() or int(tp) not in TP_SIZES or not plugin.removeprefix("require:"):
            raise ValueError(f"setting {item!r}: expected TP:PLUGIN with TP in {TP_SIZES} and PLUGIN 'off' or a name")
        out.append(Setting(int(tp), plugin.removeprefix("require:")))
    if not out:
        raise ValueError("no settings")
    return out


def rank_step_bytes(config: dict[str, Any], tp: int, bytes_per_param: int = 2) -> int:
    """Weight bytes one rank reads per decode step at batch 1: its query heads' and KV heads' (split, or one
    replicated head when the ranks outnumber them) qkv rows and o_proj columns, its share of the MLP, the norms, and
    its vocabulary shard of the LM head. Pure."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim", hidden // heads)
    q, kv = heads // tp, max(kv_heads // tp, 1)
    per_layer = hidden * (q + 2 * kv) * head_dim + q * head_dim * hidden + 3 * hidden * config["intermediate_size"] // tp
    per_layer += 2 * hidden
    vocab = -(-config["vocab_size"] // tp)
    return bytes_per_param * (config["num_hidden_layers"] * per_layer + hidden + vocab * hidden)


def floor_ms(config: dict[str, Any], tp: int) -> float:
    """A decode step's floor at batch 1: one rank's weight bytes at the copy bandwidth (no reduction counted). Pure."""
    return rank_step_bytes(config, tp) / COPY_BANDWIDTH * 1e3


def ratios(rows: list[dict[str, Any]], batch: int = 1) -> list[tuple[str, float, float]]:
    """(name, measured ratio, target) of each issue-35 target the rows can answer (per-user tokens/s at `batch`). Pure."""
    speed = {(r["tp"], r["plugin"]): r.get(f"c{batch}_tok_s_per_user") for r in rows}
    out = []
    for tp in sorted({r["tp"] for r in rows if r["tp"] > 1}):
        for plugin in sorted({r["plugin"] for r in rows if r["plugin"] != "off"}):
            mine = speed.get((tp, plugin))
            for (name, target), other in zip(TARGETS, [(tp, "off"), (1, plugin)], strict=True):
                if mine and speed.get(other):
                    out.append((name.format(tp=tp).replace("plugin", plugin), mine / speed[other], target))
    return out


def table(rows: list[dict[str, Any]], batches: list[int]) -> str:
    """The rows and the target ratios as text. Pure."""
    head = f"{'setting':>14} {'floor ms':>9} {'same as first':>14} {'plugin steps':>13}" + "".join(
        f" {f'c{b} ms/step':>12} {f'c{b} tok/s/user':>15}" for b in batches)
    lines = [head]
    for r in rows:
        line = f"{r['label']:>14} {r['floor_ms']:>9.2f} {r.get('greedy_match', '-'):>14} {r.get('plugin_steps', 0):>13}"
        for b in batches:
            ms, tok = r.get(f"c{b}_step_ms"), r.get(f"c{b}_tok_s_per_user")
            line += f" {ms:>12.2f} {tok:>15.1f}" if ms else f" {'-':>12} {'-':>15}"
        lines.append(line)
    for name, value, target in ratios(rows):
        lines.append(f"{name}: {value:.2f}x (target {target}x{', met' if value >= target else ''})")
    return "\n".join(lines)


def measure(setting: Setting, path: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine of `setting`: greedy tokens, then per-user decode per concurrency. Runs the engine."""
    from lmserver import Engine

    t0 = time.perf_counter()
    graphs = args.cuda_graph and args.device != "cpu"
    engine = Engine(model_path=path, load_format="dummy", dtype=args.dtype, context_length=2048, device=args.device,
                    max_total_tokens=args.kv_tokens, tp_size=setting.tp, log_level="warning",
                    disable_cuda_graph=not graphs, enable_tp_cuda_graph=graphs and setting.tp > 1, cuda_graph_max_bs=8,
                    lowlat_plugins=setting.lowlat_plugins)
    row: dict[str, Any] = {"tp": setting.tp, "plugin": setting.plugin, "label": setting.label,
                           "build_s": time.perf_counter() - t0, "floor_ms": floor_ms(SHAPES[args.shape], setting.tp)}
    print(f"[{setting.label}] built in {row['build_s']:.1f} s", flush=True)
    rng = random.Random(0)
    vocab = min(SHAPES[args.shape]["vocab_size"], 49000)
    greedy = {"temperature": 0, "ignore_eos": True}
    try:
        check = [[rng.randrange(100, vocab) for _ in range(n)] for n in (16, 64)]
        outs = engine.generate(input_ids=check, sampling_params={**greedy, "max_new_tokens": args.check_tokens})
        row["tokens"] = [o["output_ids"] for o in outs]
        for c in args.concurrency:
            prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(c)]
            step_s = decode_step_s(engine, prompts, args.decode_tokens)
            row[f"c{c}_step_ms"], row[f"c{c}_tok_s_per_user"] = step_s * 1e3, 1 / step_s
            print(f"[{setting.label}] c={c}: {step_s * 1e3:.2f} ms/step", flush=True)
        if engine.core.lowlat is not None:
            report = engine.core.lowlat.report()
            row["plugin_steps"], row["fallbacks"] = report["plugin_steps"], report["fallbacks"]
            row["lowlat_ranks"] = report["ranks"]
        return row
    finally:
        if engine.core.tp is not None:
            engine.core.tp.shutdown()
        engine.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="1:nvidia,2:off,2:nvidia", help="TP:PLUGIN,... (PLUGIN off: generic path)")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json and tokenizer_config.json")
    p.add_argument("--concurrency", default="1", help="per-user decode at these concurrencies (1: the target)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="decode CUDA graphs on every rank (off on a CPU)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--kv-tokens", type=int, default=32768)
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="print the plan and each rank's floor; run nothing")
    p.add_argument("--hang-s", type=float, default=1200, help="dump stacks and exit after this many seconds")
    args = p.parse_args(argv)
    try:
        args.settings = parse_settings(args.settings)
    except ValueError as exc:
        p.error(str(exc))
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    return args


def plan(args: argparse.Namespace) -> str:
    """The dry run's text: each setting with its engine options and floor. Pure."""
    cfg = SHAPES[args.shape]
    lines = [f"{args.shape} ({args.dtype}, dummy weights) on {args.device}, concurrency {args.concurrency}, "
             f"prompt {args.prompt_len}, {args.decode_tokens} decode steps"]
    for s in args.settings:
        lines.append(f"  {s.label:>14}: --tp-size {s.tp} --lowlat-plugins {s.lowlat_plugins}; a rank reads "
                     f"{rank_step_bytes(cfg, s.tp) / 1e9:.2f} GB per step, floor {floor_ms(cfg, s.tp):.2f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(plan(args), flush=True)
    if args.dry_run:
        return
    if args.tokenizer is None:
        from lmserver.models.default_model import default_model_path

        args.tokenizer = str(default_model_path())
    path = model_folder(args.shape, Path(args.tokenizer))
    faulthandler.dump_traceback_later(args.hang_s, exit=True, file=sys.__stderr__)  # a hang prints every stack
    rows = [measure(s, path, args) for s in args.settings]
    faulthandler.cancel_dump_traceback_later()
    first = rows[0]["tokens"]
    for r in rows:
        same = sum(len(os.path.commonprefix([x, y])) for x, y in zip(first, r["tokens"], strict=True))
        r["greedy_match"] = f"{same}/{sum(len(x) for x in first)}"
    print(table(rows, args.concurrency))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {**vars(args), "settings": [s.label for s in args.settings]},
                                               "rows": rows, "ratios": ratios(rows)}, indent=2, default=str))
    sys.stdout.flush()
    # NOTE: after NCCL collectives were captured in CUDA graphs, tearing the communicator down can hang
    # (pytorch/pytorch#115388): leave without the interpreter's exit hooks (bench_tp does the same)
    if any(s.tp > 1 for s in args.settings) and args.device != "cpu":
        os._exit(0)


if __name__ == "__main__":
    main()
