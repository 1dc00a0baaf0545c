"""N-gram speculative decoding vs plain decoding on copy-heavy work (issue 34's CPU target).

    python benchmarks/speculative/bench_ngram.py [--model-path FOLDER] [--device cpu] [--batch 1 4] [--tasks ...]

The embedded SmolLM2-135M-Instruct by default. Tasks: repeat a passage, rewrite it with one word
replaced, fix the typos of a code snippet, and two constrained ones: copy a record as JSON under its JSON
Schema (jump-forward on), repeat a list under a regex. Greedy; the outputs with and without speculation are
checked token for token; answers end at EOS (or --max-new-tokens). Each (task, batch) is timed alternately (plain, speculative) over
`--rounds` rounds; reported: median decode tokens/s of each, their ratio, acceptance length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

PASSAGE = ("The committee met on Tuesday to review the budget for the coming year. It approved the road "
           "repairs on Main Street, delayed the library renovation until spring, and asked the treasurer "
           "for a new estimate of the park maintenance costs before the next meeting in March.")
CODE = ("def mean(values):\n    total = 0\n    for value in values:\n        total += valeu\n"
        "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
        "    return sum((v - m) ** 2 for v in values) / len(valuse)\n")
RECORD = {"id": 4182, "name": "Alice Smith", "email": "alice.smith@example.com", "city": "Paris",
          "tags": ["admin", "billing", "support"], "active": True}
RECORD_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string"}, "city": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}, "active": {"type": "boolean"}},
    "required": ["id", "name", "email", "city", "tags", "active"], "additionalProperties": False}
# name -> (prompt, extra sampling params: the constrained tasks' grammar)
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "repeat": (f"Repeat this text word for word.\nText: {PASSAGE}\nRepeated:", {}),
    "replace": (f"Rewrite the text, replacing Tuesday with Friday.\nText: {PASSAGE}\nRewritten:", {}),
    "fix_code": (f"Fix the typos in this Python code and output the whole corrected code.\n{CODE}\nCorrected:\n", {}),
    # constrained (JSON Schema with jump-forward; a regex): drafts cut to the grammar, verify rows masked
    "json_copy": (f"Copy this record as JSON.\nRecord: {json.dumps(RECORD)}\nJSON:",
                  {"json_schema": json.dumps(RECORD_SCHEMA)}),
    "regex_list": ("Repeat the list: apples, pears, plums, cherries, apples, pears, plums, cherries.\nList:",
                   {"regex": r"( ?[a-z]+,){3,12} ?[a-z]+\."}),
}


def run(engine: Any, prompts: list[str], max_new: int, ignore_eos: bool = False,
        extra: dict[str, Any] | None = None) -> tuple[float, list[list[int]]]:
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": ignore_eos, **(extra or {})}
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, [o["output_ids"] for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate max_new_tokens even past the answer (the model then writes new, "
                             "non-copy text)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from lmserver import Engine

    common = {"dtype": args.dtype, "device": args.device, "max_total_tokens": 8192, "max_running_requests": 16}
    plain = Engine(args.model_path, **common)
    spec = Engine(args.model_path, speculative_algorithm="ngram", speculative_num_draft_tokens=args.num_draft_tokens,
                  **common)
    rows: list[dict[str, Any]] = []
    try:
        for name in args.tasks:
            prompt, extra = TASKS[name]
            for batch in args.batch:
                prompts = [prompt] * batch
                run(plain, prompts, 4, extra=extra)  # warm-up (and a radix hit for both from here on)
                run(spec, prompts, 4, extra=extra)
                t_plain, t_spec = [], []
                before = spec.get_stats()
                for _ in range(args.rounds):
                    dt, want = run(plain, prompts, args.max_new_tokens, args.ignore_eos, extra)
                    t_plain.append(dt)
                    dt, got = run(spec, prompts, args.max_new_tokens, args.ignore_eos, extra)
                    t_spec.append(dt)
                    if got != want:
                        raise AssertionError(f"{name} batch {batch}: speculative output differs from plain decoding")
                after = spec.get_stats()
                steps = after["spec_verify_requests"] - before["spec_verify_requests"]
                accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
                tokens = sum(len(ids) for ids in want)  # the answer as the model ends it (EOS) or max_new_tokens
                row = {"task": name, "batch": batch, "tokens": tokens, "plain_tok_s": tokens / statistics.median(t_plain),
                       "spec_tok_s": tokens / statistics.median(t_spec),
                       "accept_length": (accepted + steps) / steps if steps else 0.0}
                row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
                rows.append(row)
                print(f"{name:9s} batch {batch} ({tokens // batch} tokens each): plain {row['plain_tok_s']:7.1f} tok/s, ngram "
                      f"{row['spec_tok_s']:7.1f} tok/s, {row['speedup']:.2f}x, acceptance length "
                      f"{row['accept_length']:.2f}; outputs identical", flush=True)
    finally:
        plain.shutdown()
        spec.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
