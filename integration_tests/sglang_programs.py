"""Runs SGLang's own frontend programs (`sglang.test.test_programs`, the set SGLang's
`TestSRTBackend` runs against its server) and an unconditional-likelihood `select` through
SGLang's frontend (`sgl.RuntimeEndpoint`) against a server at URL; prints one JSON line per
program: {"name", "ok", "error", "result"}.

Run by test_sglang_frontend.py with an interpreter that can import `sglang` (SGLang's wheel
installed with --no-deps next to our environment: `make sglang-frontend`). Not a test module
itself: it imports SGLang, which our environment does not depend on.

    python integration_tests/sglang_programs.py URL [NAME ...]
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import sglang as sgl
from sglang.test import test_programs as programs

CHOICES = ["True", "False", "Unknown"]


@sgl.function
def _statement(s: Any, statement: str) -> None:
    s += "Determine whether the statement below is True, False, or Unknown.\n"
    s += "Statement: " + statement + "\n"
    s += "Answer:" + sgl.select("answer", CHOICES, choices_method=sgl.unconditional_likelihood_normalized)


@sgl.function
def _long_answer(s: Any) -> None:
    s += sgl.user("What is the capital of the United States?")
    s += sgl.assistant(sgl.gen("answer", min_tokens=64, max_tokens=128))


def min_tokens() -> dict[str, Any]:
    """SGLang's test_gen_min_new_tokens program; its own check loads a tokenizer by the served
    model's name through modules that need torchvision, so the counts come from the meta info."""
    ret = _long_answer.run()
    return {"completion_tokens": ret.get_meta_info("answer")["completion_tokens"]}


def unconditional_select() -> dict[str, Any]:
    ret = _statement.run(statement="The capital of Germany is Berlin.")
    meta = ret.get_meta_info("answer")
    return {"answer": ret["answer"], "choices": CHOICES, "meta": meta}


PROGRAMS: dict[str, Callable[[], Any]] = {
    # NOTE: few_shot_qa and decode_int assert world knowledge (Washington, 24 hours) a 135M model
    # lacks, with no switch to skip it: runnable by name, not in the test's set
    "few_shot_qa": programs.test_few_shot_qa,
    "decode_int": programs.test_decode_int,
    "mt_bench": programs.test_mt_bench,
    "select": lambda: programs.test_select(check_answer=False),
    "expert_answer": lambda: programs.test_expert_answer(check_answer=False),
    "tool_use": programs.test_tool_use,
    "parallel_decoding": programs.test_parallel_decoding,
    "stream": programs.test_stream,
    "stream_logprobs": programs.test_stream_logprobs,
    "regex": programs.test_regex,
    "dtype_gen": programs.test_dtype_gen,
    "min_tokens": min_tokens,
    "unconditional_select": unconditional_select,
}


def main() -> None:
    url, names = sys.argv[1], sys.argv[2:] or list(PROGRAMS)
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    for name in names:
        try:
            result = PROGRAMS[name]()
            print(json.dumps({"name": name, "ok": True, "error": "", "result": result}, default=str), flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported to the test, with its trace
            print(json.dumps({"name": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                              "trace": traceback.format_exc()[-3000:]}), flush=True)


if __name__ == "__main__":
    main()
