"""Markdown of the program-suite results: one table per machine, README.md regenerated from
every `results/*.json` that `run_all.py` wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HEADER = """# LM-program workloads (paper section 6, Figures 5-6 and 13)

The paper's multi-call workloads written with lmdsl, run end to end against `lmserver serve`
with each optimization switched on and off. Regenerate this page (and `results/<machine>.json`)
with one command:

    python benchmarks/programs/run_all.py [--scale N] [--concurrency C] [--machine NAME] [--server-args "..."]

Data are synthetic with a fixed seed (no data set can be downloaded) but structurally faithful:
MMLU-style 5-shot `gen`, HellaSwag-style 20-shot `select` over 4 endings, ReAct agent loops
(thought `gen`, tool `select`, argument `gen`, tool observation appended), generative-agents
recorded calls (persona + growing memory stream, interleaved across agents), tree-of-thought
(fork 3 x depth 3), skeleton-of-thought (outline, then parallel expansion), LLM judge (fork per
dimension, merge, `select` grade), JSON decoding with a schema as a regex, multi-turn chat with
short and long replies, a DSPy-style retrieve-then-answer pipeline, and a no-sharing control.

Columns: programs/s with the mean program latency in seconds in parentheses, per configuration.
`full` = radix cache, `lpm` schedule, frontend prefix hints, jump-forward; each other column
switches one thing: `no_radix` (`--disable-radix-cache`), `fcfs` / `dfs_weight` (schedule
policy), `no_hints` (no fork-prefix or constant-prefix hints), `no_jump_forward` (JSON only),
`openai_baseline` (the same programs through lmdsl's OpenAI backend on `/v1/completions`: one
independent request per call, `select` by echoed prompt logprobs, no hints). *hit / opt* is the
achieved cache hit rate (sum `cached_tokens` / sum `prompt_tokens` as the server reports them) and
the optimal hit rate of the same recorded trace (every distinct prompt prefix computed once,
prefixes the server generated itself free, the tokens a request must compute -- its last token,
or from `logprob_start_len - 1` when it asks for prompt logprobs -- always counted; see
`program_trace.py`, which checks this bound against brute-force oracles at every run). *radix %*
is the server's own radix management time (`radix_time_s` of `/get_server_info`: host time in
radix-tree work -- prefix matching, locking, insertion, eviction, and the `lpm` peeks that order
the waiting queue) as a share of the `full` run's wall time, and *slot %* its slot bookkeeping
(`slot_time_s`: KV slot allocation and the requests' slot arrays, work that runs with the cache
off too); together they are the KV manager's whole host time. Runs recorded before the split show
that sum under *radix %* (marked `t`); runs recorded before the server reported it show the host
time of the trace's radix-tree operations replayed through `radixcache` instead (marked `r`).
*sanity* counts programs that passed the workload's check (see the legend under each table).

By default `fcfs` and `dfs_weight` run the workloads with shared prefixes and parallel calls,
`no_hints` the ones with forks or a constant prefix, `openai_baseline` six workloads (`CONFIGS` in
`run_all.py`); `--all-workloads` runs every workload under every configuration. Sizes are flags
(`--hellaswag-programs 64`, `--tot-depth 4`, `--max-tokens 32`, or `--scale 8` for every program
count). For a GPU table: `--machine "H200" --concurrency 64 --scale 16 --server-args "--model-path
<Llama-3-8B-shaped folder> --load-format dummy"`; with random weights the sanity counts say nothing
about accuracy, only that the programs ran. Each run writes `results/<machine>.json` (every row,
with request and token counts) and this page is rebuilt from all of them (`python report.py`).
"""


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    err = f", {row['num_errors']} err" if row["num_errors"] else ""
    return f"{row['programs_per_s']:.2f} ({row['mean_latency_s']:.1f}){err}"


def _radix_cell(row: dict[str, Any]) -> str:
    if "slot_server_share" in row:
        return f"{100 * row['radix_server_share']:.4f}"
    if "radix_server_share" in row:  # recorded before the split: tree work plus slot bookkeeping
        return f"{100 * row['radix_server_share']:.4f} t"
    return f"{100 * row['radix_share']:.4f} r"


def _slot_cell(row: dict[str, Any]) -> str:
    return f"{100 * row['slot_server_share']:.4f}" if "slot_server_share" in row else ""


def machine_section(result: dict[str, Any]) -> str:
    rows = result["rows"]
    configs = list(result["configs"])
    by = {(r["workload"], r["config"]): r for r in rows}
    names = list(dict.fromkeys(r["workload"] for r in rows))
    lines = [f"## {result['machine']}: {result['model']}", "",
             f"{result['date']}, commit {result['commit']}, concurrency {result['concurrency']}, "
             f"server threads {result['server_threads']}, whole suite {result['suite_seconds'] / 60:.1f} min. "
             f"Command: `{result['command']}`", ""]
    head = ["workload", "n", *configs, "full / no_radix", "hit / opt (full)", "hit / opt (no_hints)",
            "hit / opt (baseline)", "radix %", "slot %", "sanity (full)"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    legend = []
    for name in names:
        full = by.get((name, "full"))
        nr = by.get((name, "no_radix"))
        ratio = f"{full['programs_per_s'] / nr['programs_per_s']:.2f}x" if full and nr else ""

        def hit(cfg: str, name: str = name) -> str:
            r = by.get((name, cfg))
            return f"{r['hit_rate']:.3f} / {r['optimal_hit_rate']:.3f}" if r else ""

        n = next(r["programs"] for r in rows if r["workload"] == name)
        cells = [name, str(n), *[_cell(by.get((name, c))) for c in configs], ratio, hit("full"),
                 hit("no_hints"), hit("openai_baseline"),
                 _radix_cell(full) if full else "", _slot_cell(full) if full else "",
                 f"{full['sanity_ok']}/{full['programs']}" if full else ""]
        lines.append("| " + " | ".join(cells) + " |")
        if full:
            legend.append(f"{name}: {full['sanity_label']}")
    for key, why in result.get("skipped", {}).items():
        lines.append(f"\n`{key}`: {why}")
    lines += ["", "Sanity checks: " + "; ".join(legend) + "."]
    jf = [(by.get(("json_decode", "full")), by.get(("json_decode", "no_jump_forward")))]
    for on, off in jf:
        if on and off:
            lines.append(f"JSON decoding: {on['jump_forward_tokens']} tokens jump-forwarded with jump-forward "
                         f"on, {off['jump_forward_tokens']} with it off; valid JSON {on['sanity_ok']}/{on['programs']} "
                         f"and {off['sanity_ok']}/{off['programs']}.")
    errs = sorted({e for r in rows for e in r["errors"]})
    if errs:
        lines.append("Errors seen: " + "; ".join(f"`{e}`" for e in errs[:5]))
    mism = sum(r["token_count_mismatches"] for r in rows)
    lines.append(f"Trace tokenization vs the server's prompt_tokens: {mism} mismatching requests.")
    if result.get("note"):
        lines += ["", result["note"]]
    return "\n".join(lines) + "\n"


def write_readme(folder: Path) -> Path:
    """Rewrites folder/README.md from folder/results/*.json (one section per machine)."""
    sections = []
    for path in sorted((folder / "results").glob("*.json")):
        sections.append(machine_section(json.loads(path.read_text())))
    out = folder / "README.md"
    out.write_text(HEADER + "\n" + "\n".join(sections))
    return out


if __name__ == "__main__":
    print(write_readme(Path(__file__).resolve().parent))
