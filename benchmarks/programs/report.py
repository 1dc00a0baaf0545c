"""Markdown of the program-suite results: one table per machine, README.md regenerated from
every `results/*.json` that `run_all.py` wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The page's text above the machine tables (what the workloads are, how to read the columns):
# edit header.md, not README.md, which is regenerated from it and results/*.json.
HEADER_FILE = Path(__file__).resolve().parent / "header.md"


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


def prefill_ceiling(no_radix: dict[str, Any] | None, full: dict[str, Any] | None) -> str:
    """The full / no_radix ratio a perfect cache could reach, estimated from the no_radix run: its prefill share
    p of the wall time (the server's extend forwards) shrinks by the optimal hit rate h of the trace, the rest
    stays, so at most 1 / (1 - p * h). Prefill cost is taken as proportional to the tokens computed; runs
    recorded before the server timed its prefills have no estimate."""
    if no_radix is None or full is None or "prefill_server_share" not in no_radix:
        return ""
    p, h = no_radix["prefill_server_share"], full["optimal_hit_rate"]
    return f"{100 * p:.0f}% / {1 / max(1e-9, 1 - p * h):.2f}x"


def machine_section(result: dict[str, Any]) -> str:
    rows = result["rows"]
    configs = list(result["configs"])
    by = {(r["workload"], r["config"]): r for r in rows}
    names = list(dict.fromkeys(r["workload"] for r in rows))
    lines = [f"## {result['machine']}: {result['model']}", "",
             f"{result['date']}, commit {result['commit']}, concurrency {result['concurrency']}, "
             f"server threads {result['server_threads']}, whole suite {result['suite_seconds'] / 60:.1f} min. "
             f"Command: `{result['command']}`", ""]
    head = ["workload", "n", *configs, "full / no_radix", "prefill % (no_radix) / ceiling", "hit / opt (full)",
            "hit / opt (no_hints)",
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
        cells = [name, str(n), *[_cell(by.get((name, c))) for c in configs], ratio, prefill_ceiling(nr, full), hit("full"),
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
    out.write_text(HEADER_FILE.read_text() + "\n" + "\n".join(sections))
    return out


if __name__ == "__main__":
    print(write_readme(Path(__file__).resolve().parent))
