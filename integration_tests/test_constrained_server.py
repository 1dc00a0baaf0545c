"""Constrained decoding through the real server (embedded SmolLM2, CPU) and real clients.

The server runs with `--disable-jump-forward` here (the flag's path; the other server tests and
the engine tests cover jump-forward on). Oracles: `regex` fullmatch, `jsonschema` validate, the
tokenizer decode of the returned token ids, and OpenAI-format 400 bodies.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import regex

import lmdsl as sgl
from lmserver.testing import ServerProcess

ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(idle_invariant: Any) -> Any:
    srv = ServerProcess(["--context-length", "1024", "--disable-jump-forward", "--grammar-compile-timeout-s", "20"],
                        core=None, env=ENV)
    srv.start(timeout_s=900)
    yield srv
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        idle_invariant(client)  # after the module's tests, in whatever order they ran
    assert srv.stop() == 0, srv.log_tail()


def test_native_regex_schema_and_stop_regex(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    r = http.post("/generate", json={
        "text": ["Date:", "JSON:", "Count:"],
        "sampling_params": [
            {"max_new_tokens": 16, "temperature": 0, "regex": r"20[0-9]{2}-[01][0-9]"},
            {"max_new_tokens": 24, "temperature": 0.8, "sampling_seed": 1, "json_schema": json.dumps(schema)},
            {"max_new_tokens": 24, "temperature": 0, "regex": r"[0-9]( [0-9]){2,9}", "stop_regex": r"3 4"},
        ]})
    assert r.status_code == 200, r.text
    date, obj, count = r.json()
    assert regex.fullmatch(r"20[0-9]{2}-[01][0-9]", date["text"]), date
    jsonschema.validate(json.loads(obj["text"]), schema)
    assert "jump_forward_tokens" not in obj["meta_info"]  # --disable-jump-forward
    assert regex.fullmatch(r"[0-9]( [0-9]){0,9}", count["text"].strip() or "0"), count
    tok = http.post("/detokenize", json={"tokens": obj["output_ids"]})
    assert tok.status_code == 200 and tok.json()["text"] == obj["text"]


def test_native_bad_grammars_are_400(http: httpx.Client) -> None:
    cases = [({"regex": "(ab"}, "invalid regex grammar"),
             ({"json_schema": "{not json"}, "not valid JSON"),
             ({"json_schema": json.dumps({"type": "integer", "minimum": 5, "maximum": 1})}, "invalid json_schema"),
             ({"ebnf": "root ::= '[' \n  item ']'"}, "line 2, column 3: undefined rule 'item'"),
             ({"ebnf": "root ::= e\ne ::= e '+' 'x' | 'x'"}, "left-recursive")]
    for params, message in cases:
        r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4, **params}})
        assert r.status_code == 400, (params, r.text)
        assert message in r.json()["error"]["message"], r.text
    assert http.get("/health").status_code == 200  # the server survives


def test_openai_response_formats_and_errors(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "Any JSON object."}],
                                    max_tokens=40, temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content or ""
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    r = oai.completions.create(model="default", prompt="The answer is", max_tokens=8, temperature=0.7, n=2, seed=3,
                               extra_body={"regex": " (yes|no|maybe)"})
    assert len(r.choices) == 2 and all(c.text in (" yes", " no", " maybe") for c in r.choices)
    with pytest.raises(openai.BadRequestError, match="line 1, column 14"):
        oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                    extra_body={"ebnf": "root ::= 'a' @"})
    with pytest.raises(openai.BadRequestError, match="invalid regex grammar"):
        oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                    extra_body={"regex": "a{3,1}"})


@sgl.function
def profile(s: Any) -> None:
    s += "Name: Bob\nHeight in meters:" + sgl.gen("height", dtype=float, max_tokens=8)
    s += "\nMarried:" + sgl.gen("married", dtype=bool, max_tokens=4)
    s += "\nPet:" + sgl.gen("pet", json_schema={"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 30}},
        "required": ["kind", "age"]}, max_tokens=32)


def test_lmdsl_typed_and_schema_gens(server: ServerProcess) -> None:
    state = profile.run(backend=sgl.RuntimeEndpoint(server.base_url), temperature=0)
    assert state.error() is None, state.error()
    float(state["height"])
    assert state["married"] in ("True", "False")
    pet = json.loads(state["pet"])
    assert pet["kind"] in ("cat", "dog") and 0 <= pet["age"] <= 30


# recursive (a pushdown grammar, not regular): nested lists of small numbers
NESTED = 'root ::= "[" ( item ( ", " item )* )? "]"\nitem ::= [0-9]{1,2} | root'


def _in_nested(text: str, complete: bool) -> bool:
    from cfsm.grammar import parse_ebnf
    from cfsm.grammar.testing import accepts

    grammar = parse_ebnf(NESTED)
    if complete:
        return accepts(grammar, text)
    return any(accepts(grammar, text + tail) for tail in ("]" * k for k in range(0, 40)))


def test_ebnf_native_openai_and_lmdsl(http: httpx.Client, oai: openai.OpenAI, server: ServerProcess) -> None:
    r = http.post("/generate", json={"text": ["A nested list: ", "Numbers as nested lists: "], "sampling_params": [
        {"max_new_tokens": 32, "temperature": t, "sampling_seed": 2, "ebnf": NESTED} for t in (0.0, 1.0)]})
    assert r.status_code == 200, r.text
    for out in r.json():
        complete = out["meta_info"]["finish_reason"]["type"] == "stop"
        assert out["text"].startswith("[") and _in_nested(out["text"], complete), out
        if complete:
            assert isinstance(json.loads(out["text"]), list)
    for kw in ({"extra_body": {"ebnf": NESTED}}, {"response_format": {"type": "ebnf", "ebnf": NESTED}}):
        c = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "A nested list."}],
                                        max_tokens=32, temperature=0, **kw)  # type: ignore[call-overload]
        text = c.choices[0].message.content or ""
        assert _in_nested(text, c.choices[0].finish_reason == "stop"), (kw, text)

    @sgl.function
    def nested(s: Any) -> None:
        s += "A nested list: " + sgl.gen("v", ebnf=NESTED, max_tokens=32, temperature=0)

    state = nested.run(backend=sgl.RuntimeEndpoint(server.base_url))
    assert state.error() is None and _in_nested(state["v"], False), state["v"]


def test_memory_invariant_when_idle(http: httpx.Client, idle_invariant: Any) -> None:
    idle_invariant(http)
