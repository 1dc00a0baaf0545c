"""Tests of the program workloads: their call structure against the reference scripts' (every
program run on lmdsl's MockBackend, every call recorded) and their lengths in SmolLM2 tokens.

Run with `python -m pytest benchmarks/programs/test_workloads.py` (benchmarks/ is not collected
by default).
"""

from __future__ import annotations

import random
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmdsl.testing import MockBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))  # NOTE: the suite's modules are scripts, not a package
import data  # noqa: E402
import report  # noqa: E402
import workloads as wl  # noqa: E402

SMALL = wl.Sizes(mmlu_programs=3, hellaswag_programs=2, react_programs=2, agents=2, agent_calls_per_agent=5,
                 tot_programs=1, sot_programs=2, judge_programs=2, json_programs=2, chat_programs=2,
                 chat_long_programs=1, rag_programs=2, independent_programs=2)


def _respond(prompt: Any, params: Any) -> str:
    """Outputs that satisfy each gen's regex (the mock does not constrain) and some text otherwise."""
    regex = getattr(params, "regex", None)
    if regex:
        for sample in ('"Oslo",', "59.9,", "700000,", '["Old Castle", "Harbor", "Market Hall"]'):
            if re.fullmatch(regex, sample):
                return sample
        raise AssertionError(f"no sample for regex {regex}")
    return " B and some more words here"


def _run(name: str, sizes: wl.Sizes) -> tuple[list[tuple[Any, dict[str, Any]]], MockBackend]:
    w = next(w for w in wl.WORKLOADS if w.name == name)
    backend = MockBackend(respond=_respond)
    out = []
    for kw in w.make(sizes):
        state = w.program.run(backend=backend, temperature=0, **kw)
        state.sync()
        assert state.error() is None, state.error()
        assert w.check(state, kw), f"{name}: sanity check failed"
        out.append((state, kw))
    return out, backend


def _gens(backend: MockBackend) -> list[Any]:
    return [c for c in backend.calls if c.kind == "generate"]


def test_every_workload_runs_and_passes_its_check() -> None:
    for w in wl.WORKLOADS:
        _run(w.name, SMALL)


def test_mmlu_one_answer_token_per_question() -> None:
    states, backend = _run("mmlu_5shot", SMALL)
    gens = _gens(backend)
    assert len(gens) == SMALL.mmlu_programs
    assert all(g.params.max_new_tokens == 1 for g in gens)
    # NOTE: k solved questions, each ending in its answer letter, then the question
    assert all(len(re.findall(r"\nAnswer: [ABCD]\n", g.prompt.text)) == SMALL.mmlu_shots for g in gens)


def test_hellaswag_twenty_shots_and_four_endings() -> None:
    _, backend = _run("hellaswag_20shot", SMALL)
    selects = [c for c in backend.calls if c.kind == "select"]
    assert len(selects) == SMALL.hellaswag_programs
    assert all(len(s.choices) == 4 for s in selects)
    assert all(s.prompt.text.count("\n\n") == SMALL.hellaswag_shots for s in selects)


@settings(max_examples=12, deadline=None)
@given(width=st.integers(1, 3), depth=st.integers(1, 4))
def test_tree_of_thought_calls_per_level(width: int, depth: int) -> None:
    """One gen per node: width + width^2 + ... + width^depth (30 for the reference's 2 x 4)."""
    sizes = replace(SMALL, tot_width=width, tot_depth=depth)
    _, backend = _run("tree_of_thought", sizes)
    assert len(_gens(backend)) == sum(width ** level for level in range(1, depth + 1))


def test_skeleton_of_thought_tips_and_expansions() -> None:
    states, backend = _run("skeleton_of_thought", SMALL)
    gens = _gens(backend)
    expansions = [g for g in gens if g.prompt.text.startswith(wl.SOT_EXPAND_HEAD)]
    assert len(expansions) == len(gens) // 2 == SMALL.sot_programs * SMALL.sot_points
    assert all(g.params.max_new_tokens == SMALL.long_tokens for g in expansions)


def test_judge_six_dimensions_then_a_two_token_score() -> None:
    _, backend = _run("llm_judge", SMALL)
    gens = _gens(backend)
    assert len(gens) == SMALL.judge_programs * (len(wl.JUDGE_DIMENSIONS) + 1)
    assert sum(g.params.max_new_tokens == 2 for g in gens) == SMALL.judge_programs


def test_json_five_constrained_fields() -> None:
    _, backend = _run("json_decode", SMALL)
    gens = _gens(backend)
    assert len(gens) == SMALL.json_programs * 5
    assert [g.params.max_new_tokens for g in gens[:5]] == [8, 8, 8, 8, 24]


@pytest.mark.parametrize("name", ["chat_short", "chat_long"])
def test_chat_turns_and_fixed_answer_lengths(name: str) -> None:
    states, backend = _run(name, SMALL)
    gens = _gens(backend)
    lo, hi = ((SMALL.chat_answer_min_tokens, SMALL.chat_answer_max_tokens) if name == "chat_short"
              else (SMALL.chat_long_min_tokens, SMALL.chat_long_max_tokens))
    assert len(gens) == len(states) * SMALL.chat_turns
    assert all(g.params.ignore_eos and lo <= g.params.max_new_tokens <= hi for g in gens)


def test_agents_use_the_five_templates_with_their_caps() -> None:
    _, backend = _run("generative_agents", SMALL)
    caps = sorted(g.params.max_new_tokens for g in _gens(backend))
    assert caps == sorted(list(data.AGENT_MAX_TOKENS.values()) * SMALL.agents)


def test_react_three_calls_per_step() -> None:
    _, backend = _run("react_agent", SMALL)
    calls = [c for c in backend.calls if c.kind in ("generate", "select")]
    assert len(calls) == SMALL.react_programs * SMALL.react_steps * 3


# ---------------------------------------------------------------- lengths in SmolLM2 tokens
@pytest.fixture(scope="module")
def tok() -> Any:
    transformers = pytest.importorskip("transformers")
    assert transformers
    from lmserver.config import ServerConfig
    from lmserver.testing import load_test_tokenizer

    try:
        return load_test_tokenizer(ServerConfig())
    except RuntimeError as e:  # the embedded model's package is missing
        pytest.skip(str(e))


def _n(tok: Any, text: str) -> int:
    return len(tok(text, add_special_tokens=False).input_ids)


def _close(got: int, want: int, tol: float = 0.12) -> bool:
    return abs(got - want) <= max(3, tol * want)


@pytest.mark.parametrize("sizes", [wl.Sizes(), replace(wl.Sizes(), **wl.REFERENCE)], ids=["default", "reference"])
def test_lengths_in_tokens(tok: Any, sizes: wl.Sizes) -> None:
    rng = random.Random(0)
    q = data.mmlu_question(rng, sizes.mmlu_question_tokens, sizes.mmlu_option_tokens)
    assert _close(_n(tok, q), sizes.mmlu_question_tokens + 4 * sizes.mmlu_option_tokens + 3)
    ctx, endings = data.hellaswag_item(rng, sizes.hellaswag_ctx_tokens, sizes.hellaswag_ending_tokens)
    assert _close(_n(tok, ctx), sizes.hellaswag_ctx_tokens)
    assert all(_close(_n(tok, e), sizes.hellaswag_ending_tokens) for e in endings)
    assert _close(_n(tok, data.react_observation(0, 1, sizes.react_observation_tokens)), sizes.react_observation_tokens)
    assert _close(_n(tok, data.prose(rng, sizes.judge_article_tokens)), sizes.judge_article_tokens)
    assert _close(_n(tok, data.city_document(rng, sizes.json_doc_tokens)[0]), sizes.json_doc_tokens)
    assert all(_close(_n(tok, p), sizes.rag_passage_tokens) for p in data.corpus(5, sizes.rag_passage_tokens))
    for kw in wl._chat_args(sizes, long=False):
        assert all(sizes.chat_user_min_tokens - 3 <= _n(tok, p) <= sizes.chat_user_max_tokens + 8
                   for p, _ in kw["turns"])


def test_reference_prompt_sizes(tok: Any) -> None:
    """The whole prompts of the reference shape: MMLU ~700 tokens (5 shots of ~115), HellaSwag's
    20 shots ~1,400, ReAct's 6-demo head ~1,550 (6,350 characters), DSPy's demos ~2,000."""
    ref = replace(wl.Sizes(), **wl.REFERENCE)
    mmlu_kw = wl._mmlu_args(ref)[0]
    assert 600 <= _n(tok, mmlu_kw["shots"] + mmlu_kw["question"]) <= 800
    shots = data.hellaswag_shots(ref.hellaswag_shots, ref.hellaswag_ctx_tokens, ref.hellaswag_ending_tokens)
    assert 1200 <= _n(tok, shots) <= 1600
    assert 1300 <= _n(tok, data.react_header(ref.react_demos, ref.react_demo_steps, 30)) <= 1800
    passages = data.corpus(wl.RAG_CORPUS_SIZE, ref.rag_passage_tokens)
    assert 1500 <= _n(tok, wl._rag_header(ref, passages)) <= 2500


def test_readme_lists_every_reference_flag() -> None:
    readme = (Path(__file__).resolve().parent / "README.md").read_text()
    text = " ".join(readme.replace("\\\n", " ").split())
    for name, value in wl.REFERENCE.items():
        assert f"--{name.replace('_', '-')} {value}" in text, name
    assert all(hasattr(wl.Sizes(), name) for name in wl.REFERENCE)


@pytest.mark.parametrize("name", ["hellaswag_20shot", "react_agent", "rag_pipeline"])
def test_bound_shared_text_is_the_constant_prefix(name: str) -> None:
    """The size-dependent shots / demos bound by `make` are what the prefix hint sends."""
    w = next(w for w in wl.WORKLOADS if w.name == name)
    kwargs = w.make(SMALL)
    backend = MockBackend(respond=_respond)
    prefix = w.program.cache(backend)
    shared = next(iter(w.program.bound.bind_arguments.values()))
    assert prefix.startswith(shared) and len(shared) > 500
    state = w.program.run(backend=backend, temperature=0, **kwargs[0])
    state.sync()
    assert state.text().startswith(prefix)


def test_short_workloads_are_repeated_and_the_median_run_reported() -> None:
    import run_all  # noqa: PLC0415 - imports the server's test helpers; only this test needs them

    rates = iter([5.0, 1.0, 3.0, 4.0, 2.0])

    def run() -> dict[str, Any]:
        return {"seconds": 0.5, "programs_per_s": next(rates)}

    row = run_all.run_repeated(run, min_seconds=2.4)  # 0.5 s runs: five of them reach 2.4 s
    assert row["runs_programs_per_s"] == [5.0, 1.0, 3.0, 4.0, 2.0]
    assert row["programs_per_s"] == 3.0
    assert run_all.run_repeated(lambda: {"seconds": 9.0, "programs_per_s": 7.0}, 2.4)["runs_programs_per_s"] == [7.0]
    many = run_all.run_repeated(lambda: {"seconds": 0.0, "programs_per_s": 1.0}, 1.0)
    assert len(many["runs_programs_per_s"]) == run_all.MAX_RUNS


def test_prefill_ceiling_from_the_no_radix_prefill_share() -> None:
    """1 / (1 - p * h): p the no_radix run's prefill share, h the optimal hit rate; empty without the timing."""
    full = {"optimal_hit_rate": 0.5}
    assert report.prefill_ceiling({"prefill_server_share": 0.6}, full) == "60% / 1.43x"
    assert report.prefill_ceiling({"prefill_server_share": 0.0}, full) == "0% / 1.00x"
    assert report.prefill_ceiling({}, full) == ""  # recorded before the server timed prefills
    assert report.prefill_ceiling(None, full) == "" and report.prefill_ceiling({"prefill_server_share": 0.6}, None) == ""
    row = {"workload": "w", "programs": 2, "programs_per_s": 1.0, "mean_latency_s": 1.0, "num_errors": 0,
           "hit_rate": 0.4, "optimal_hit_rate": 0.5, "radix_server_share": 0.0, "slot_server_share": 0.0,
           "sanity_ok": 2, "sanity_label": "ok", "errors": [], "token_count_mismatches": 0}
    result = {"machine": "m", "model": "x", "date": "d", "commit": "c", "concurrency": 1, "server_threads": 1,
              "suite_seconds": 60.0, "command": "cmd", "configs": {"full": "", "no_radix": ""},
              "rows": [{**row, "config": "full", "programs_per_s": 3.0},
                       {**row, "config": "no_radix", "hit_rate": 0.0, "prefill_server_share": 0.8}]}
    line = next(ln for ln in report.machine_section(result).splitlines() if ln.startswith("| w |"))
    assert "| 3.00x | 80% / 1.67x |" in line
