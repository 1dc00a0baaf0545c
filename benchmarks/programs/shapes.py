"""Prints each workload's shape in SmolLM2 tokens, at the default sizes and at the reference ones:
calls per program, prompt tokens per call (min-max, mean) and the output caps. Every program runs
on lmdsl's MockBackend (outputs fill their caps), so no server is needed.

    python benchmarks/programs/shapes.py
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import workloads as wl

from lmdsl.testing import MockBackend
from lmserver.config import ServerConfig
from lmserver.testing import load_test_tokenizer

_REGEX_SAMPLES = ('"Oslo",', "59.9,", "700000,", '["Old Castle", "Harbor", "Market Hall"]')


def _respond(prompt: Any, params: Any) -> str:
    if params.regex:
        return next(s for s in _REGEX_SAMPLES if re.fullmatch(params.regex, s))
    return " B" + " word" * 600  # NOTE: cut at max_new_tokens by the mock


def shape(w: wl.Workload, sizes: wl.Sizes, tok: Any) -> dict[str, Any]:
    backend = MockBackend(respond=_respond)
    kwargs = w.make(replace(sizes, **{f: 1 for f, _ in wl.size_fields() if f.endswith("_programs")}, agents=1))
    for kw in kwargs:
        w.program.run(backend=backend, temperature=0, **kw).sync()
    calls = [c for c in backend.calls if c.kind in ("generate", "select")]
    lens = [len(tok(c.prompt.text, add_special_tokens=False).input_ids) for c in calls]
    caps = sorted({c.params.max_new_tokens for c in calls if c.params is not None})
    return {"calls": len(calls) / len(kwargs), "mean": sum(lens) / len(lens), "min": min(lens), "max": max(lens),
            "caps": ",".join(map(str, caps)) or "select"}


def main() -> None:
    tok = load_test_tokenizer(ServerConfig())
    ref = replace(wl.Sizes(), **wl.REFERENCE)
    print("| workload | calls / program | prompt tokens per call, default: min-max (mean) | reference "
          "| output caps, default | reference |")
    print("|---|---|---|---|---|---|")
    for w in wl.WORKLOADS:
        d, r = shape(w, wl.Sizes(), tok), shape(w, ref, tok)
        print(f"| {w.name} | {d['calls']:.0f} | {d['min']}-{d['max']} ({d['mean']:.0f}) "
              f"| {r['min']}-{r['max']} ({r['mean']:.0f}) "
              f"| {d['caps']} | {r['caps']} |")


if __name__ == "__main__":
    main()
