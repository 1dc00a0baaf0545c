"""Constrained decoding end to end on the embedded SmolLM2-135M-Instruct (CPU, float32).

Oracles: the `regex` module (fullmatch), `jsonschema` (validate), the tokenizer's full decode
of the returned token ids, unconstrained greedy runs of the same engine (the texts a grammar
must not change), and the KV memory invariant after every workload.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import regex

from lmserver import Engine
from lmserver.io_struct import InvalidRequestError

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
YES_NO = r" (yes|no)"
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "is_student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "is_student"],
}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(dtype="float32", max_total_tokens=8192, max_running_requests=32)
    yield eng
    eng.shutdown()


def _idle_check(engine: Engine) -> None:
    assert not engine.core.has_work()
    assert engine.core.constrained.num_waiting == 0
    engine.core.check_memory_invariant()


def _check(engine: Engine, out: dict[str, Any], kind: str, grammar: Any) -> None:
    """The output is in the grammar's language (complete when it stopped, a prefix otherwise)
    and its token ids decode to its text."""
    text = out["text"]
    reason = out["meta_info"]["finish_reason"]["type"]
    assert engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True) == text
    complete = reason == "stop"
    if kind == "regex":
        assert regex.fullmatch(grammar, text, partial=not complete), (grammar, text, reason)
    elif complete:
        jsonschema.validate(json.loads(text), grammar)
    assert reason in ("stop", "length"), out["meta_info"]


def _params(kind: str, grammar: Any, max_new: int, **extra: Any) -> dict[str, Any]:
    key = "regex" if kind == "regex" else "json_schema"
    value = grammar if kind == "regex" else json.dumps(grammar)
    return {"max_new_tokens": max_new, key: value, **extra}


def test_regex_and_schema_outputs_are_in_the_language(engine: Engine) -> None:
    cases = [
        ("Call me at", "regex", PHONE),
        ("Is the sky blue? Answer:", "regex", YES_NO),
        ("Today's date is", "regex", DATE),
        ("Describe a person as JSON:", "json", PERSON),
        ("Describe a student as JSON:", "json", PERSON),
    ]
    outs = engine.generate([c[0] for c in cases], [
        _params(kind, g, 64, temperature=0.0 if i % 2 == 0 else 0.8, sampling_seed=i)
        for i, (_, kind, g) in enumerate(cases)])
    assert isinstance(outs, list)
    for (_, kind, g), out in zip(cases, outs, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        _check(engine, out, kind, g)
    assert outs[0]["meta_info"]["jump_forward_tokens"] >= 1  # " " and "-" are forced
    assert outs[3]["meta_info"]["jump_forward_tokens"] >= 10  # keys are forced
    assert list(json.loads(outs[3]["text"]))[0] == "name"  # properties in schema order
    _idle_check(engine)


NESTED_LIST = r"""
root ::= "[" ( item ( ", " item )* )? "]"
item ::= [0-9]{1,3} | root
"""


def test_ebnf_outputs_are_in_the_language(engine: Engine) -> None:
    import cfsm
    from cfsm.grammar import parse_ebnf
    from cfsm.grammar.testing import accepts

    grammar = parse_ebnf(NESTED_LIST)
    outs = engine.generate(["A nested list of small numbers: ", "Matrix 2x2 as nested lists: "], [
        {"max_new_tokens": 40, "ebnf": NESTED_LIST, "temperature": t, "sampling_seed": 3} for t in (0.0, 0.9)])
    assert isinstance(outs, list)
    vocab = engine.core.constrained.backend.vocab
    index = cfsm.compile_ebnf(NESTED_LIST, vocab)
    assert isinstance(index, cfsm.GrammarIndex)  # recursive: the pushdown matcher
    for out in outs:
        assert engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True) == out["text"]
        guide = cfsm.Guide(index)
        guide.advance_many([t for t in out["output_ids"] if t not in vocab.eos_token_ids])  # every token allowed
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert accepts(grammar, out["text"]) and isinstance(json.loads(out["text"]), list), out
    _idle_check(engine)


def test_json_object_and_errors(engine: Engine) -> None:
    out = engine.generate("A JSON object:", {"max_new_tokens": 48, "temperature": 0.0,
                                             "json_schema": '{"type": "object"}'})
    assert isinstance(out, dict)
    assert out["text"].startswith("{")
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert isinstance(json.loads(out["text"]), dict)
    with pytest.raises(InvalidRequestError, match="json_schema is not valid JSON"):
        engine.generate("x", {"json_schema": "{not json"})
    # a bad grammar fails its own request only
    bad, good, bad_ebnf = engine.generate(["x", "The capital of France is", "y"], [
        {"regex": "(ab", "max_new_tokens": 4}, {"max_new_tokens": 3, "temperature": 0.0},
        {"ebnf": "root ::= '[' \nitem ']'", "max_new_tokens": 4}])
    assert "invalid regex grammar" in bad["meta_info"]["error"]
    assert "line 2, column 1: undefined rule 'item'" in bad_ebnf["meta_info"]["error"]
    assert bad["meta_info"]["finish_reason"]["type"] == "abort" and bad["output_ids"] == []
    assert good["meta_info"]["completion_tokens"] == 3
    _idle_check(engine)


def test_a_pattern_needing_bytes_no_token_spells_fails_its_request_not_the_engine(engine: Engine) -> None:
    # U+B1234 is F2 B1 88 B4 in UTF-8, and SmolLM2's vocabulary has no token with byte 0xF2 (a fuzzed request once
    # killed the server's engine core here: its jump-forward could not tokenize the forced text). Oracle: the
    # vocabulary itself (no token holds the byte), and the regex module on what was produced.
    import regex

    char = "\U000b1234"
    vocab = engine.core.constrained.backend.vocab
    assert not any(0xF2 in t for t in vocab.tokens)
    first, middle, jumped, either, good = engine.generate(["x", "x", "x", "x", "The capital of France is"], [
        {"regex": f"{char}+", "max_new_tokens": 4}, {"regex": f"x{char}y", "max_new_tokens": 4, "temperature": 0.0},
        {"regex": f"xyz({char}|\U000b1235)", "max_new_tokens": 6, "temperature": 0.0},
        {"regex": f"(a|{char})b", "max_new_tokens": 4, "temperature": 0.0}, {"max_new_tokens": 3, "temperature": 0.0}])
    # nothing spellable matches the start: a bad request, no tokens
    assert "allows no token" in first["meta_info"]["error"] and first["output_ids"] == []
    # stuck after a valid prefix: the request ends there, the prefix kept, no rejected token appended
    assert middle["text"] == "x" and middle["meta_info"]["finish_reason"]["type"] == "abort"
    assert "allows no token" in middle["meta_info"]["finish_reason"]["message"]
    assert regex.fullmatch(f"x{char}y", middle["text"], partial=True)
    # the same after a jump-forward over the forced "xyz"
    assert jumped["text"] == "xyz" and jumped["meta_info"]["finish_reason"]["type"] == "abort"
    assert "allows no token" in jumped["meta_info"]["finish_reason"]["message"]
    # the spellable branch is taken
    assert either["text"] == "ab" and either["meta_info"]["finish_reason"]["type"] == "stop"
    assert good["meta_info"]["completion_tokens"] == 3
    _idle_check(engine)


def test_compile_timeout_is_a_clear_error(engine: Engine) -> None:
    backend = engine.core.constrained.backend
    saved = backend.compile_timeout_s
    backend.compile_timeout_s = 1e-4
    try:
        out = engine.generate("x", {"regex": r"\w{2,9}@\w{3,7}\.(com|org)", "max_new_tokens": 4})
    finally:
        backend.compile_timeout_s = saved
    assert isinstance(out, dict)
    assert "longer than" in out["meta_info"]["error"] and "grammar-compile-timeout" in out["meta_info"]["error"]
    _idle_check(engine)


def test_unconstrained_neighbours_are_unaffected(engine: Engine) -> None:
    prompts = ["The capital of France is", "Once upon a time", "Water boils at"]
    greedy = {"max_new_tokens": 12, "temperature": 0.0}
    alone = engine.generate(prompts, greedy)
    constrained = [("Call me at", _params("regex", PHONE, 20)),
                   ("A person:", _params("json", PERSON, 40, temperature=0.9, sampling_seed=3)),
                   ("Answer:", _params("regex", YES_NO, 4))]
    mixed = engine.generate(prompts[:1] + [c[0] for c in constrained] + prompts[1:],
                            [greedy] + [c[1] for c in constrained] + [greedy, greedy])
    assert isinstance(alone, list) and isinstance(mixed, list)
    got = [mixed[0], mixed[4], mixed[5]]
    assert [o["text"] for o in got] == [o["text"] for o in alone]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in alone]
    _idle_check(engine)


def _model_pick_regex(engine: Engine, text: str, ids: list[int]) -> str:
    """A regex whose forced part (after the first comma) is exactly what greedy decoding wrote."""
    toks = [engine.tokenizer.decode([t]) for t in ids]
    i = next(j for j, t in enumerate(toks) if t.startswith(","))
    seg = "".join(toks[i : i + 4])
    assert engine.tokenizer.encode(seg, add_special_tokens=False) == ids[i : i + 4]  # canonical tokens
    return "[^,]*" + re.escape(seg) + r"[\s\S]*"


def test_jump_forward_on_off_identical_where_forced_text_is_the_models_pick(engine: Engine) -> None:
    prompts = ["Once upon a time", "List three colors:", "Water boils at"]
    greedy = {"max_new_tokens": 16, "temperature": 0.0}
    free = engine.generate(prompts, greedy)
    assert isinstance(free, list)
    cd = engine.core.constrained
    params = [{**greedy, "regex": _model_pick_regex(engine, o["text"], o["output_ids"])} for o in free]
    # NOTE: the grammars compile first (cached after): a cold compile in the counted run staggers the requests'
    # starts by the workers' timing, which adds forwards that have nothing to do with jump-forward
    engine.generate(prompts, params)
    runs = {}
    for jf in (True, False):
        cd.jump_forward = jf
        try:
            before = engine.core.get_stats()["forwards"]
            runs[jf] = engine.generate(prompts, params)
            runs[jf, "forwards"] = engine.core.get_stats()["forwards"] - before
        finally:
            cd.jump_forward = True
    for on, off, ref in zip(runs[True], runs[False], free, strict=True):
        assert on["text"] == off["text"] == ref["text"]
        assert on["output_ids"] == off["output_ids"] == ref["output_ids"]
        assert on["meta_info"]["jump_forward_tokens"] == 3 and "jump_forward_tokens" not in off["meta_info"]
    assert runs[True, "forwards"] < runs[False, "forwards"]
    _idle_check(engine)


def test_jump_forward_on_off_same_language(engine: Engine) -> None:
    cd = engine.core.constrained
    cases = [("regex", DATE), ("json", PERSON), ("regex", PHONE)]
    for jf in (True, False):
        cd.jump_forward = jf
        try:
            outs = engine.generate(["Fill in:"] * 3, [_params(kind, g, 48, temperature=1.0, sampling_seed=7 + i)
                                                        for i, (kind, g) in enumerate(cases)])
        finally:
            cd.jump_forward = True
        assert isinstance(outs, list)
        for (kind, g), out in zip(cases, outs, strict=True):
            _check(engine, out, kind, g)
            assert ("jump_forward_tokens" in out["meta_info"]) == jf
    _idle_check(engine)


def test_stop_string_inside_forced_text(engine: Engine) -> None:
    cd = engine.core.constrained
    texts = []
    for jf in (True, False):
        cd.jump_forward = jf
        try:
            out = engine.generate("Question: is water wet?", {
                "max_new_tokens": 16, "temperature": 0.0, "regex": r"The answer is (yes|no)\.", "stop": [" is"]})
        finally:
            cd.jump_forward = True
        assert isinstance(out, dict)
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " is"}
        texts.append(out["text"])
    assert texts == ["The answer", "The answer"]
    _idle_check(engine)


def test_streaming_text_with_jump_forward_is_consistent(engine: Engine) -> None:
    it = engine.generate("Describe a person as JSON:", _params("json", PERSON, 64, temperature=0.0), stream=True)
    chunks = list(it)  # type: ignore[arg-type]
    final = chunks[-1]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # never taken back
    _check(engine, final, "json", PERSON)
    assert final["meta_info"]["jump_forward_tokens"] >= 10
    _idle_check(engine)


GRAMMARS: list[tuple[str, Any]] = [
    ("regex", PHONE), ("regex", YES_NO), ("regex", DATE), ("regex", r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?"),
    ("regex", r"(\+|-)?[0-9]{1,4}(\.[0-9]{1,2})?"), ("regex", r"#[0-9a-f]{6}"),
    ("regex", r"(red|green|blue)(, (red|green|blue)){0,2}"), ("regex", r"[a-z]+@[a-z]+\.(com|org)"),
    ("json", PERSON),
    ("json", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4}),
    ("json", {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {
        "type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["ok", "tags"]}),
    ("json", {"type": "string", "pattern": "^[a-z]{2,6}$"}),
]


@pytest.mark.slow
def test_200_constrained_requests(engine: Engine) -> None:
    rng = random.Random(0)
    picks = [GRAMMARS[i % len(GRAMMARS)] for i in range(200)]
    prompts = [rng.choice(["Answer:", "Output:", "Here it is:", "Data:"]) for _ in picks]
    params = [_params(kind, g, 24, temperature=rng.choice([0.0, 0.7, 1.0]), sampling_seed=i)
              for i, (kind, g) in enumerate(picks)]
    outs = engine.generate(prompts, params)
    assert isinstance(outs, list) and len(outs) == 200
    stopped = 0
    for (kind, g), out in zip(picks, outs, strict=True):
        _check(engine, out, kind, g)
        stopped += out["meta_info"]["finish_reason"]["type"] == "stop"
    assert stopped >= 100  # most grammars here are short; every output is checked either way
    assert engine.core.get_stats()["jump_forward_tokens"] > 200
    _idle_check(engine)


def test_readme_example(engine: Engine) -> None:
    before = engine.core.get_stats()["prompt_tokens"]
    out = engine.generate("Call me at", {"max_new_tokens": 24, "temperature": 0, "regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert isinstance(out, dict)
    assert regex.fullmatch(PHONE, out["text"]) and out["meta_info"]["jump_forward_tokens"] >= 2
    # jump-forward re-prefills are not new prompts
    assert engine.core.get_stats()["prompt_tokens"] - before == out["meta_info"]["prompt_tokens"]


def test_jump_policy_keeps_text_and_metadata(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under any --jump-forward-min-tokens the greedy text where the forced text is the model's
    pick is the unconstrained one, and meta_info's jump-forward tokens are exactly the output
    tokens that were not sampled (counted at the engine's token append)."""
    prompts = ["Once upon a time", "List three colors:", "Water boils at"]
    greedy = {"max_new_tokens": 16, "temperature": 0.0}
    free = engine.generate(prompts, greedy)
    assert isinstance(free, list)
    cd, core = engine.core.constrained, engine.core
    sampled: dict[str, int] = {}
    append = core._append_token

    def counting_append(state: Any, token: int) -> Any:
        sampled[state.req.rid] = sampled.get(state.req.rid, 0) + 1
        return append(state, token)

    monkeypatch.setattr(core, "_append_token", counting_append)
    cases = [(p, {**greedy, "regex": _model_pick_regex(engine, o["text"], o["output_ids"])}) for p, o in zip(
        prompts, free, strict=True)] + [("Fill in:", _params("json", PERSON, 48, temperature=0.0)),
                                        ("Call me at", _params("regex", PHONE, 24, temperature=0.0))]
    try:
        for min_tokens in ("2", "8", "1"):
            cd.jump_forward_min_tokens = min_tokens
            before = dict(cd.stats)
            outs = engine.generate([c[0] for c in cases], [c[1] for c in cases])
            assert isinstance(outs, list)
            for out, ref in zip(outs[:3], free, strict=True):
                assert out["text"] == ref["text"] and out["output_ids"] == ref["output_ids"]
            _check(engine, outs[3], "json", PERSON)
            _check(engine, outs[4], "regex", PHONE)
            for out in outs:
                meta = out["meta_info"]
                assert meta.get("jump_forward_tokens", 0) == meta["completion_tokens"] - sampled[meta["id"]]
            made = cd.stats["jump_forward_tokens"] - before["jump_forward_tokens"]
            assert made == sum(o["meta_info"].get("jump_forward_tokens", 0) for o in outs)
            if min_tokens == "1":
                assert cd.stats["jump_forward_declined"] == before["jump_forward_declined"]
            else:  # the 3-token segments of the first three never pay an extend round of their own at 8
                assert cd.stats["jump_forward_declined"] > before["jump_forward_declined"] or min_tokens == "2"
            if min_tokens == "8":
                assert all("jump_forward_tokens" not in o["meta_info"] for o in outs[:3])
    finally:
        cd.jump_forward_min_tokens = "auto"
    _idle_check(engine)
