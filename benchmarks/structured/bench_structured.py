"""Structured output in lmserver: jump-forward policies side by side, and unconstrained.

Workloads:
- `json_long_keys` (SGLang paper section 6, JSON decoding): extract fields of a short synthetic
  biography into a JSON Schema with long constant keys (most of the output is forced text);
- `regex_form`: a regex form ("Name: ...\\nAge: ...\\n...") with literal field labels (short
  forced strings, 1-4 tokens).

Modes (`--variants`, comma-separated, default `off,1,auto`):
- `off`: no jump-forward (token-by-token masked decoding), the baseline of the speed-ups;
- `N` (an integer): jump-forward with `--jump-forward-min-tokens N` (1: every jump is made);
- `auto`: the engine's default policy (1 on CPU, 8 on CUDA; the resolved value is printed);
- `unconstrained` (unless `--no-unconstrained`): no grammar, `ignore_eos`, as many new tokens
  as the `off` run produced on average: the cost of the same amount of text without a grammar,
  on the serial schedule that grammar requests take (`unconstrained_overlap`: the same with the
  engine's overlap schedule, when it is on).

Phases: latency per request at concurrency 1, then a batch of `--concurrency` requests at once
(output tokens/s, forwards, extend forwards, jumps made and declined, decode step time).

Decode step time: the wall time of each engine `step()` that ran one decode forward (schedule,
forward, masks, sampling and its read-back, token bookkeeping, grammar advance), with no extra
device synchronization: the probe does not serialize what the engine overlaps (the mask fill
and copy run on the host while the device runs the forward). `decode_step_ms_full` is the mean
over the steps that decoded `--concurrency` rows (a full batch), the like-for-like number:
constrained decoding adds `off / unconstrained - 1` to a decode step (the issue's mask-overhead
target), with both on the serial schedule (grammar requests do not chain on the overlap
schedule; `unconstrained_overlap` runs the same text with the engine's overlap schedule, when it
is on, for reference). `--sync-probe` instead times the forward alone between two
`torch.cuda.synchronize()` calls (the old probe: the device time of the forward, with the host
work around it serialized).

Mask host times per decode step (lmserver.engine.constrained.BatchMasker): `mask_prepare_ms` (the fill
and the copy launch, issued right after the forward's launch, so they overlap it),
`mask_apply_ms` (the apply launch at sampling, before the read-back), `mask_fill_ms` (the cfsm
fills alone); `stale_rows` counts rows refilled at sampling (0: every mask was prepared ahead).

    python benchmarks/structured/bench_structured.py [--threads 2] [--num-latency 6] [--concurrency 32]
        [--variants off,1,auto] [--warmup auto|on|off] [--sync-probe]
        [--model-path DIR --load-format dummy --dtype bfloat16 --device cuda]

With `--load-format dummy` the weights are random: the forced (jump-forward) text and the step
counts are the same kind of work, but the free text is noise; only timings are meaningful then.
The compact table at the end has one line per workload, phase and mode, with the latency
speed-up over `off`; `--json` writes every row with all its fields.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import jsonschema
import regex
import torch

from lmserver import Engine

LONG_KEY_SCHEMA = {
    "type": "object",
    "properties": {
        "full_name_of_the_person_described": {"type": "string", "maxLength": 24},
        "year_of_birth_as_a_four_digit_number": {"type": "integer", "minimum": 1900, "maximum": 2024},
        "city_of_birth_without_the_country": {"type": "string", "maxLength": 16},
        "main_occupation_or_profession_of_the_person": {"type": "string", "maxLength": 20},
        "is_the_person_still_alive_today": {"type": "boolean"},
    },
    "required": ["full_name_of_the_person_described", "year_of_birth_as_a_four_digit_number",
                 "city_of_birth_without_the_country", "main_occupation_or_profession_of_the_person",
                 "is_the_person_still_alive_today"],
}
FORM_REGEX = (r"Name: [A-Z][a-z]{1,10} [A-Z][a-z]{1,12}\nBorn in: [A-Z][a-z]{2,12}\n"
              r"Year of birth: (19|20)[0-9]{2}\nOccupation: [a-z]{3,14}\nStill alive: (yes|no)\n")

FIRST = ["Alice", "Bruno", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivan", "Julia", "Kofi", "Lena"]
LAST = ["Martin", "Okafor", "Tanaka", "Silva", "Novak", "Haddad", "Berg", "Rossi", "Kim", "Dubois"]
CITIES = ["Lyon", "Osaka", "Lagos", "Porto", "Krakow", "Cairo", "Bergen", "Turin", "Busan", "Quebec"]
JOBS = ["chemist", "painter", "engineer", "teacher", "architect", "pilot", "baker", "lawyer"]


def bios(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        year = rng.randint(1920, 2000)
        alive = rng.choice(["lives", "lived"])
        out.append(f"{name} was born in {rng.choice(CITIES)} in {year}. {name.split()[0]} worked as a "
                   f"{rng.choice(JOBS)} and {alive} by the sea.")
    return out


def prompts(engine: Engine, workload: str, n: int) -> list[str]:
    tpl = engine.tokenizer.chat_template is not None
    ask = ("Extract the information about the person as JSON." if workload == "json_long_keys"
           else "Fill in the form about the person.")
    out = []
    for bio in bios(n):
        content = f"{bio}\n\n{ask}"
        if tpl:
            out.append(str(engine.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                                tokenize=False, add_generation_prompt=True)))
        else:
            out.append(content + "\n")
    return out


FREE_MODES = ("unconstrained", "unconstrained_overlap")  # no grammar


def params(workload: str, mode: str, max_new: int) -> dict[str, Any]:
    p: dict[str, Any] = {"max_new_tokens": max_new, "temperature": 0.0}
    if mode in FREE_MODES:
        p["ignore_eos"] = True
    elif workload == "json_long_keys":
        p["json_schema"] = json.dumps(LONG_KEY_SCHEMA)
    else:
        p["regex"] = FORM_REGEX
    return p


def check(workload: str, text: str) -> bool:
    if workload == "json_long_keys":
        try:
            jsonschema.validate(json.loads(text), LONG_KEY_SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return regex.fullmatch(FORM_REGEX, text) is not None


class StepProbe:
    """Counts forwards and times engine steps: wraps the model runner's forward (the decode's
    row count) and `EngineCore.step` (its wall time). Adds no device synchronization unless
    `sync` (then the forward alone is timed between two synchronizations, as a device time)."""

    def __init__(self, engine: Engine, sync: bool = False) -> None:
        self.core = engine.core
        self.sync = sync and self.core.device.type == "cuda"
        self.decode_s: list[float] = []
        self.decode_rows: list[int] = []
        self.num_forwards = 0
        self.num_extends = 0
        self._step_forwards = 0  # forwards of the running step
        self._step_rows = 0  # rows of its decode forward (0: none)
        runner = self.core.runner
        self._orig = runner.forward
        runner.forward = self._forward  # type: ignore[method-assign]
        self._orig_step = self.core.step
        self.core.step = self._step  # type: ignore[method-assign]

    def _forward(self, decision: Any, *args: Any, **kwargs: Any) -> Any:
        self.num_forwards += 1
        self._step_forwards += 1
        if decision.mode != "decode":
            self.num_extends += 1
            return self._orig(decision, *args, **kwargs)
        if not self.sync:
            self._step_rows = len(decision.items)
            return self._orig(decision, *args, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = self._orig(decision, *args, **kwargs)
        torch.cuda.synchronize()
        self.decode_s.append(time.perf_counter() - start)
        self.decode_rows.append(len(decision.items))
        return out

    def _step(self) -> Any:
        self._step_forwards, self._step_rows = 0, 0
        start = time.perf_counter()
        out = self._orig_step()
        elapsed = time.perf_counter() - start
        if not self.sync and self._step_forwards == 1 and self._step_rows:  # a decode step
            self.decode_s.append(elapsed)
            self.decode_rows.append(self._step_rows)
        return out

    def reset(self) -> None:
        self.decode_s, self.decode_rows, self.num_forwards, self.num_extends = [], [], 0, 0


def _ms_per(seconds: float, steps: int) -> float:
    return 1e3 * seconds / max(steps, 1)


def run_mode(engine: Engine, probe: StepProbe, workload: str, mode: str, ps: list[str], max_new: int,
             concurrency: int, overlap: bool) -> dict[str, Any]:
    """One run of `ps` in chunks of `concurrency`; `mode` is "off", "unconstrained",
    "unconstrained_overlap", "auto" or a min-tokens integer; `overlap`: the engine's overlap
    schedule setting (`unconstrained` runs without it). Returns the row (mutates the engine's
    jump-forward and overlap settings)."""
    cd = engine.core.constrained
    cd.jump_forward = mode not in ("off", *FREE_MODES)
    cd.jump_forward_min_tokens = mode if cd.jump_forward else 1
    engine.core.overlap = overlap and mode != "unconstrained"  # grammar requests never chain today
    engine.flush_cache()
    probe.reset()
    m = cd.masker
    m0 = {k: getattr(m, k) for k in ("prepare_time_s", "apply_time_s", "fill_time_s", "num_masked_rows",
                                      "num_stale_rows", "num_prepared_used")}
    stats0 = dict(cd.stats)
    latencies: list[float] = []
    outs: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i in range(0, len(ps), concurrency):
        chunk = ps[i : i + concurrency]
        res = engine.generate(chunk, [params(workload, mode, max_new)] * len(chunk))
        assert isinstance(res, list)
        outs.extend(res)
        latencies.extend(o["meta_info"]["e2e_latency"] for o in res)
    wall = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    decode_steps = len(probe.decode_s)
    d = {k: getattr(m, k) - v for k, v in m0.items()}
    mean_decode = statistics.mean(probe.decode_s) if probe.decode_s else 0.0
    full = [t for t, n in zip(probe.decode_s, probe.decode_rows, strict=True) if n == concurrency]
    constrained = mode not in FREE_MODES
    label = mode if mode in ("off", *FREE_MODES) else f"jf_min{cd.policy.min_tokens}"
    if mode == "auto":
        label = f"jf_auto({cd.policy.min_tokens})"
    jf_tokens = cd.stats["jump_forward_tokens"] - stats0["jump_forward_tokens"]
    meta_jf = sum(o["meta_info"].get("jump_forward_tokens", 0) for o in outs)
    if meta_jf != jf_tokens:  # per-request metadata should add up to the engine's count
        print(f"WARNING {workload} {label}: meta_info jump_forward_tokens sum {meta_jf} != engine count {jf_tokens}",
              flush=True)
    return {
        "workload": workload, "mode": label, "concurrency": concurrency, "requests": len(ps),
        "valid": sum(check(workload, o["text"]) for o in outs) if constrained else None,
        "latency_s": statistics.mean(latencies), "out_tok_per_s": tokens / wall,
        "out_tokens_per_req": tokens / len(outs), "forwards": probe.num_forwards, "extend_forwards": probe.num_extends,
        "decode_steps": decode_steps,
        "jumps": cd.stats["jump_forward_steps"] - stats0["jump_forward_steps"],
        "declined": cd.stats["jump_forward_declined"] - stats0["jump_forward_declined"],
        "jump_forward_tokens": jf_tokens, "meta_jump_forward_tokens": meta_jf,
        "mask_ms_per_step": (_ms_per(d["prepare_time_s"] + d["apply_time_s"], decode_steps)
                             if constrained else None),
        "mask_prepare_ms": _ms_per(d["prepare_time_s"], decode_steps) if constrained else None,
        "mask_apply_ms": _ms_per(d["apply_time_s"], decode_steps) if constrained else None,
        "mask_fill_ms": _ms_per(d["fill_time_s"], decode_steps) if constrained else None,
        "decode_step_ms": 1e3 * mean_decode,
        "decode_step_ms_full": 1e3 * statistics.mean(full) if full else None,
        "full_steps": len(full),
        "masked_rows": d["num_masked_rows"], "stale_rows": d["num_stale_rows"] if constrained else None,
        "prepared_batches": d["num_prepared_used"],
        "sample_text": outs[0]["text"][:90],
    }


def _table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


def overhead_lines(rows: list[dict[str, Any]], synced: bool) -> list[str]:
    """Per workload: the decode step of `off` vs `unconstrained` in the batch phase (full
    batches), with the mask host times next to it."""
    what = "forward device time" if synced else "engine step"
    out = []
    for r in rows:
        if r["mode"] != "off" or r["phase"] != "batch":
            continue
        free = {x["mode"]: x for x in rows if x["workload"] == r["workload"] and x["phase"] == "batch"
                and x["mode"] in FREE_MODES}
        base = free.get("unconstrained")
        host = (f"mask host ms/step: prepare {r['mask_prepare_ms']:.3f} (overlaps the forward on CUDA), apply "
                f"{r['mask_apply_ms']:.3f}, of which fill {r['mask_fill_ms']:.3f}; stale rows {r['stale_rows']}")
        key = "decode_step_ms_full" if r["decode_step_ms_full"] and base and base["decode_step_ms_full"] else "decode_step_ms"
        if base is None or not base[key]:
            out.append(f"{r['workload']}: no unconstrained run; {host}")
            continue
        line = (f"{r['workload']}: {what} at {r['concurrency']} rows ({key}): off {r[key]:.3f} ms vs unconstrained "
                f"{base[key]:.3f} ms = {100 * (r[key] / base[key] - 1):+.1f}% (target <= +5%)")
        ov = free.get("unconstrained_overlap")
        if ov is not None and ov[key]:
            line += f"; unconstrained with the overlap schedule {ov[key]:.3f} ms"
        out.append(line)
        out.append(f"  {host}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--num-latency", type=int, default=6, help="requests run one at a time per mode")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in the batch phase")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--workloads", default="json_long_keys,regex_form")
    ap.add_argument("--variants", default="off,1,auto",
                    help="jump-forward modes: off, auto, or a --jump-forward-min-tokens integer")
    ap.add_argument("--no-unconstrained", action="store_true", help="skip the unconstrained rows")
    ap.add_argument("--warmup", choices=("auto", "on", "off"), default="auto",
                    help="an untimed pass of every mode and phase first (auto: on CUDA, where the first extends "
                         "of new shapes compile Triton kernel variants)")
    ap.add_argument("--sync-probe", action="store_true",
                    help="time the decode forward alone between two torch.cuda.synchronize() calls (its device "
                         "time; serializes the host work the engine overlaps) instead of whole engine steps")
    ap.add_argument("--json", "--json-out", dest="json_out", default=None, help="write all rows to this JSON file")
    ap.add_argument("--model-path", default=None, help="a Hugging Face folder (default: the embedded SmolLM2)")
    ap.add_argument("--load-format", default="auto", help="'dummy' = random weights for the folder's config")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in ("off", "auto") and not (v.isdigit() and int(v) >= 1):
            ap.error(f"--variants: {v!r} is not off, auto or an integer >= 1")
    if "off" not in variants:
        variants.insert(0, "off")  # the baseline of the speed-ups and of the unconstrained length
    torch.set_num_threads(args.threads)
    engine = Engine(model_path=args.model_path, load_format=args.load_format, dtype=args.dtype, device=args.device,
                    max_total_tokens=32768, max_running_requests=max(args.concurrency, 1))
    overlap = bool(engine.core.overlap)  # the resolved overlap schedule (on with CUDA)
    print(f"model {engine.model_path} ({args.load_format}, {args.dtype}) on {engine.core.device}, "
          f"overlap schedule {'on' if overlap else 'off'}, probe {'synchronized forwards' if args.sync_probe else 'engine steps'}",
          flush=True)
    probe = StepProbe(engine, sync=args.sync_probe)
    free_modes = ["unconstrained", "unconstrained_overlap"] if overlap else ["unconstrained"]
    rows = []
    for workload in args.workloads.split(","):
        lat_prompts = prompts(engine, workload, args.num_latency)
        batch_prompts = prompts(engine, workload, args.concurrency)
        engine.generate(lat_prompts[0], params(workload, "1", 8))  # compile + warm up
        phases = (("latency", lat_prompts, 1), ("batch", batch_prompts, args.concurrency))
        if args.warmup == "on" or (args.warmup == "auto" and engine.core.device.type == "cuda"):
            for _, ps, conc in phases:
                for mode in [*variants, *free_modes]:
                    run_mode(engine, probe, workload, mode, ps, args.max_new_tokens, conc, overlap)
        for phase, ps, conc in phases:
            done: list[dict[str, Any]] = []
            for mode in variants:
                done.append(run_mode(engine, probe, workload, mode, ps, args.max_new_tokens, conc, overlap))
            off = done[0]
            if not args.no_unconstrained:
                free_new = max(int(round(off["out_tokens_per_req"])), 1)
                for mode in free_modes:
                    done.append(run_mode(engine, probe, workload, mode, ps, free_new, conc, overlap))
            for r in done:
                r["phase"] = phase
                r["speedup_vs_off"] = off["latency_s"] / r["latency_s"]
                r["decode_steps_saved"] = off["forwards"] - r["forwards"] if r["mode"].startswith("jf_") else None
                rows.append(r)
                print("row", json.dumps({k: v for k, v in r.items() if k != "sample_text"}), flush=True)
    print("\nfull table")
    _table(rows, ["workload", "phase", "mode", "concurrency", "valid", "latency_s", "out_tok_per_s",
                  "out_tokens_per_req", "forwards", "extend_forwards", "decode_steps_saved", "jumps", "declined",
                  "jump_forward_tokens", "decode_step_ms", "decode_step_ms_full", "full_steps", "mask_prepare_ms",
                  "mask_apply_ms", "mask_fill_ms", "stale_rows"])
    print("\ncompact table (speed-up = latency of off / latency of the mode)")
    _table(rows, ["workload", "phase", "mode", "valid", "latency_s", "speedup_vs_off", "forwards", "extend_forwards",
                  "jumps", "declined"])
    print()
    for line in overhead_lines(rows, args.sync_probe):
        print(line)
    for r in rows:
        print(f"sample {r['workload']} {r['phase']} {r['mode']}: {r['sample_text']!r}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
