"""Offline throughput of lmserver's Engine next to HF transformers `generate`, same model, same
prompts, same run.

Datasets:
- `random`: random token ids, input lengths uniform in [input_len * range_ratio, input_len];
- `shared-prefix`: `num_groups` groups of prompts that share a long system prompt (random ids),
  each followed by a short distinct question.

Every request decodes exactly `output_len` tokens (ignore_eos), greedy, so both backends do the
same work. HF runs `generate` in batches of `--hf-batch-size` prompts (left padding). Both run
in this process with the same torch thread count (`--threads`). With `--repeats N` the two
alternate N times per dataset and each row reports the fastest run (the one least disturbed by
other load on a shared machine); `runs_s` lists every duration. The load average is printed
before and after each dataset. `--overlap on` runs lmserver with the overlap schedule
(`--enable-overlap-schedule`), `--overlap both` runs it off and on side by side (alternating, with a
row each and a check that both give the same tokens).

    .venv/bin/python benchmarks/engine/bench_engine.py --dataset both --num-prompts 32

GPU runs of the issue's benchmarks 4 and 5 (weights of the 8B shape cannot travel: a folder with its
`config.json` and a tokenizer, `--load-format dummy`; HF then gets its own random init):
    # 4: offline throughput vs HF's continuous batching
    python benchmarks/engine/bench_engine.py --model-path DIR --load-format dummy --dtype bfloat16 \
        --dataset random --num-prompts 1000 --input-len 1024 --range-ratio 1 --output-len 256 \
        --max-running-requests 256 --hf-mode generate_batch --hf-num-prompts 128
    # 5: shared prefix, radix cache on, then the same with --disable-radix-cache --no-hf
    python benchmarks/engine/bench_engine.py --model-path DIR --load-format dummy --dtype bfloat16 \
        --dataset shared-prefix --num-prompts 1024 --group-size 16 --shared-prefix-len 2048 \
        --question-len 128 --output-len 256 --no-hf
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any


def make_dataset(name: str, args: argparse.Namespace, vocab: int, special: set[int]) -> list[list[int]]:
    rng = random.Random(args.seed)
    normal = [t for t in range(min(vocab, 40000)) if t not in special]

    def ids(n: int) -> list[int]:
        return [rng.choice(normal) for _ in range(n)]

    if name == "random":
        low = max(1, int(args.input_len * args.range_ratio))
        return [ids(rng.randint(low, args.input_len)) for _ in range(args.num_prompts)]
    groups = max(1, args.num_prompts // args.group_size)
    prompts = []
    for _ in range(groups):
        system = ids(args.shared_prefix_len)
        prompts += [system + ids(args.question_len) for _ in range(args.group_size)]
    rng.shuffle(prompts)
    return prompts


class StepProfile:
    """Wall time of each engine step by what it ran (no added synchronization): `decode` (one
    decode forward; with the overlap schedule the wait for the previous one is in it), `extend`
    (a forward with prompt tokens), `none` (no forward). Wraps `core.step` and `runner.forward`."""

    def __init__(self, core: Any) -> None:
        self.core, self.rows = core, {"decode": [0, 0.0, 0], "extend": [0, 0.0, 0], "none": [0, 0.0, 0]}
        self._kind, self._rows = "none", 0
        self._forward, self._step = core.runner.forward, core.step
        core.runner.forward, core.step = self._wrapped_forward, self._wrapped_step

    def _wrapped_forward(self, decision: Any, *args: Any, **kwargs: Any) -> Any:
        self._kind = "decode" if decision.mode == "decode" and self._kind != "extend" else "extend"
        self._rows += len(decision.items)
        return self._forward(decision, *args, **kwargs)

    def _wrapped_step(self) -> Any:
        self._kind, self._rows = "none", 0
        start = time.perf_counter()
        out = self._step()
        row = self.rows[self._kind]
        row[0], row[1], row[2] = row[0] + 1, row[1] + time.perf_counter() - start, row[2] + self._rows
        return out

    def table(self) -> str:
        lines = ["| step kind | steps | seconds | ms per step | rows per step |", "|---|---|---|---|---|"]
        for kind, (n, sec, rows) in self.rows.items():
            lines.append(f"| {kind} | {n} | {sec:.2f} | {1e3 * sec / max(n, 1):.2f} | {rows / max(n, 1):.1f} |")
        return "\n".join(lines)


def run_lmserver(engine: Any, prompts: list[list[int]], output_len: int, overlap: bool = False) -> dict[str, Any]:
    engine.flush_cache()
    engine.core.overlap = overlap
    steps0 = engine.core.get_stats()["overlap_steps"]
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    duration = time.perf_counter() - start
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    return {
        "duration_s": duration,
        "overlap_steps": engine.core.get_stats()["overlap_steps"] - steps0,
        "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
        "cache_hit_rate": cached / sum(len(p) for p in prompts),
        "outputs": [o["output_ids"] for o in outs],
    }


def run_hf(model: Any, tokenizer: Any, prompts: list[list[int]], output_len: int, batch_size: int) -> dict[str, Any]:
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                do_sample=False, pad_token_id=pad,
            )
        outputs += out[:, width:].tolist()
    duration = time.perf_counter() - start
    return {"duration_s": duration, "output_tokens": sum(len(o) for o in outputs), "cache_hit_rate": 0.0,
            "outputs": outputs}


def run_hf_continuous(model: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """HF transformers' own continuous batching (`generate_batch`), greedy, no EOS stop."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    duration = time.perf_counter() - start
    outputs = [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))]
    return {"duration_s": duration, "output_tokens": sum(len(o) for o in outputs), "cache_hit_rate": 0.0,
            "outputs": outputs}


def row(backend: str, dataset: str, prompts: list[list[int]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    inp = sum(len(p) for p in prompts)
    r = min(runs, key=lambda x: x["duration_s"])
    d = r["duration_s"]
    return {
        "backend": backend, "dataset": dataset, "requests": len(prompts), "input_tokens": inp,
        "output_tokens": r["output_tokens"], "duration_s": round(d, 2), "req_per_s": round(len(prompts) / d, 3),
        "input_tok_per_s": round(inp / d, 1), "output_tok_per_s": round(r["output_tokens"] / d, 1),
        "total_tok_per_s": round((inp + r["output_tokens"]) / d, 1), "cache_hit_rate": round(r["cache_hit_rate"], 3),
        "runs_s": "/".join(f"{x['duration_s']:.2f}" for x in runs),
    }


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_table(rows: list[dict[str, Any]]) -> None:
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="HF folder; default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dataset", choices=["random", "shared-prefix", "both"], default="both")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--shared-prefix-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-running-requests", type=int, default=32)
    ap.add_argument("--hf-batch-size", type=int, default=32, help="HF generate batch (the same concurrency)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    ap.add_argument("--hf-num-prompts", type=int, default=0,
                    help="HF runs only the first N prompts (0: all); its tok/s is then compared as a rate")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both backends (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=1, help="alternate ours/HF this many times; report the fastest")
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    ap.add_argument("--load-format", default="auto", help="'dummy': random weights for the folder's config "
                    "(HF then gets its own random init: token agreement is not compared)")
    ap.add_argument("--disable-radix-cache", action="store_true", help="lmserver without prefix reuse")
    ap.add_argument("--disable-cascade-attention", action="store_true",
                    help="lmserver's decode attention reads shared prefixes once per request (cascade off)")
    ap.add_argument("--step-profile", action="store_true",
                    help="print the wall time of lmserver's engine steps by kind (decode / extend / none)")
    ap.add_argument("--overlap", choices=["off", "on", "both"], default="off",
                    help="lmserver's overlap schedule; both: off and on side by side")
    ap.add_argument("--enable-overlap-schedule", dest="overlap", action="store_const", const="on",
                    help="the same as --overlap on")
    ap.add_argument("--hf-mode", choices=["generate", "generate_batch"], default="generate",
                    help="HF baseline: padded `generate` batches, or its continuous batching `generate_batch`")
    args = ap.parse_args()

    import torch

    from lmserver import Engine

    if args.threads:
        torch.set_num_threads(args.threads)

    engine = Engine(
        args.model_path, dtype=args.dtype, device=args.device, max_running_requests=args.max_running_requests,
        attention_backend=args.attention_backend, load_format=args.load_format,
        disable_radix_cache=args.disable_radix_cache, disable_cascade_attention=args.disable_cascade_attention,
    )
    rc = engine.core.resolved_config
    tokenizer = engine.tokenizer
    special = set(tokenizer.all_special_ids)
    engine.generate(input_ids=[[100, 200, 300]], sampling_params={"max_new_tokens": 2})  # warm-up
    hf_model = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[rc.dtype]
        if args.load_format == "dummy":
            from transformers import AutoConfig

            with torch.device(rc.device):  # random init where it runs (an 8B model on a CPU takes minutes)
                hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(engine.model_path),
                                                            dtype=hf_dtype)
            hf_model = hf_model.eval()
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=hf_dtype).to(rc.device).eval()
        hf_model.generate(torch.tensor([[100, 200, 300]], device=rc.device), max_new_tokens=2, do_sample=False)
        if args.hf_mode == "generate_batch":
            run_hf_continuous(hf_model, [[100, 200, 300]], 2)  # warm-up of its own path
    profile = StepProfile(engine.core) if args.step_profile else None
    datasets = ["random", "shared-prefix"] if args.dataset == "both" else [args.dataset]
    rows = []
    for name in datasets:
        prompts = make_dataset(name, args, engine.core.vocab_size, special)
        print(f"{name}: load average before {load_avg()}", flush=True)
        modes = {"off": [False], "on": [True], "both": [False, True]}[args.overlap]
        ours_by_mode: dict[bool, list[dict[str, Any]]] = {m: [] for m in modes}
        hf_runs: list[dict[str, Any]] = []
        hf_prompts = prompts[: args.hf_num_prompts] if args.hf_num_prompts else prompts
        for rep in range(args.repeats):
            for mode in modes:
                ours_by_mode[mode].append(run_lmserver(engine, prompts, args.output_len, overlap=mode))
                r = ours_by_mode[mode][-1]
                print(f"partial: lmserver{'+overlap' if mode else ''} {name} run {rep}: {r['duration_s']:.2f} s "
                      f"({r['overlap_steps']} overlapped steps)", flush=True)
            if hf_model is not None:
                if args.hf_mode == "generate_batch":
                    hf_runs.append(run_hf_continuous(hf_model, hf_prompts, args.output_len))
                else:
                    hf_runs.append(run_hf(hf_model, tokenizer, hf_prompts, args.output_len, args.hf_batch_size))
                print(f"partial: hf {name} run {rep}: {hf_runs[-1]['duration_s']:.2f} s", flush=True)
        print(f"{name}: load average after {load_avg()}", flush=True)
        if profile is not None:
            print(f"engine steps of every lmserver run of {name} (warm-up excluded):\n{profile.table()}", flush=True)
            profile.rows = {k: [0, 0.0, 0] for k in profile.rows}
        for mode in modes:
            rows.append(row("lmserver" + ("+overlap" if mode else ""), name, prompts, ours_by_mode[mode]))
            rows[-1]["same_tokens_as_lmserver"] = "-"
        if len(modes) == 2:  # the same greedy tokens expected
            serial, overlapped = ours_by_mode[False][0], ours_by_mode[True][0]
            same = sum(a == b for a, b in zip(serial["outputs"], overlapped["outputs"], strict=True))
            rows[-1]["same_tokens_as_lmserver"] = f"{same}/{len(prompts)}"
            rows.append({**rows[-1], "backend": "overlap speedup (output tok/s)", "same_tokens_as_lmserver": "-",
                         "output_tok_per_s": round(rows[-1]["output_tok_per_s"] / rows[-2]["output_tok_per_s"], 3)})
        ours_row = next(r for r in reversed(rows) if r["backend"].startswith("lmserver"))
        ours = ours_by_mode[modes[-1]][0]
        if hf_model is not None:
            hf = hf_runs[0]
            rows.append(row("hf-transformers", name, hf_prompts, hf_runs))
            same = sum(a == b for a, b in zip(ours["outputs"], hf["outputs"], strict=False))
            rows[-1]["same_tokens_as_lmserver"] = f"{same}/{len(hf_prompts)}" if args.load_format != "dummy" else "n/a"
            rows.append({**ours_row, "backend": "speedup (output tok/s)",
                         "output_tok_per_s": round(ours_row["output_tok_per_s"] / rows[-1]["output_tok_per_s"], 2)})
    graphs = getattr(engine.core.runner, "cuda_graph", None)
    cascade = "on" if getattr(engine.core.runner, "prefix_planner", None) is not None else "off"
    if graphs is not None:
        cascade += f" ({graphs.num_cascade_replays} of {graphs.num_replays} graph replays)"
    print(f"model={engine.model_path} device={rc.device} dtype={rc.dtype} attention={rc.attention_backend} "
          f"max_running_requests={rc.max_running_requests} torch_threads={torch.get_num_threads()} "
          f"cascade_attention={cascade}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "rows": rows}, handle, indent=2)
    engine.shutdown()


if __name__ == "__main__":
    main()
