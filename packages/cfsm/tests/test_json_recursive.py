"""Recursive JSON Schemas and free JSON through the pushdown matcher: no depth bound, and every
output a guide lets through (random walks completed by the shortest continuation) validates
with `jsonschema`."""

from __future__ import annotations

import functools
import json
import random
from collections import deque
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cfsm
from cfsm.grammar.testing import byte_vocab, greedy_tokens

TREE = {
    "$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
        "required": ["name", "children"], "additionalProperties": False}},
    "$ref": "#/$defs/node",
}
LINKED = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
          "required": ["v", "next"]}
WITH_FREE = {"type": "object", "properties": {"meta": {}, "tags": {"type": "array"}}, "required": ["meta", "tags"]}
SCHEMAS = {"tree": TREE, "linked": LINKED, "free": WITH_FREE}


@functools.cache
def _vocab() -> cfsm.Vocabulary:
    return byte_vocab(['{"', '":', '",', '":"', '"}', "null", "true", "false", "children", "name", "[]", "]}",
                       "}]", "next", '{"v":', "12", ", "])


@pytest.fixture(scope="module")
def vocab() -> cfsm.Vocabulary:
    return _vocab()


@functools.cache
def _schema_index(name: str) -> cfsm.GrammarIndex:
    index = cfsm.compile_json_schema(SCHEMAS[name], _vocab())
    assert isinstance(index, cfsm.GrammarIndex)
    return index


def _index(name: str, vocab: cfsm.Vocabulary) -> cfsm.GrammarIndex:
    assert vocab is _vocab()
    return _schema_index(name)


def _accepted(index: cfsm.GrammarIndex | cfsm.Index, vocab: cfsm.Vocabulary, text: str) -> bool:
    guide = cfsm.Guide(index)
    try:
        guide.advance_many(greedy_tokens(vocab, text.encode()))
    except cfsm.RejectedTokenError:
        return False
    return guide.can_stop()


def _completion(index: cfsm.GrammarIndex, sid: int, limit: int = 50_000) -> bytes:
    """The shortest bytes from configuration `sid` to one where the grammar may end."""
    seen = {sid: b""}
    queue = deque([sid])
    while queue:
        s = queue.popleft()
        if index.can_end(s):
            return seen[s]
        for b in range(32, 127):
            t = index.walk(s, bytes([b]))
            if t and t not in seen:
                seen[t] = seen[s] + bytes([b])
                queue.append(t)
        assert len(seen) < limit
    raise AssertionError("no completion")


def _trees(depth: int) -> st.SearchStrategy[Any]:
    names = st.text(alphabet="abc xyz\"\\é", max_size=6)
    if depth == 0:
        return st.builds(lambda n: {"name": n, "children": []}, names)
    return st.builds(lambda n, c: {"name": n, "children": c}, names, st.lists(_trees(depth - 1), max_size=3))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=_trees(4), indent=st.sampled_from([None, 1]))
def test_valid_trees_are_accepted(vocab: cfsm.Vocabulary, tree: Any, indent: int | None) -> None:
    text = json.dumps(tree, indent=indent, ensure_ascii=False)
    assert _accepted(_index("tree", vocab), vocab, text), text


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_walks_validate(vocab: cfsm.Vocabulary, name: str, seed: int) -> None:
    """Random tokens from the masks, then the shortest completion: the text validates."""
    index = _index(name, vocab)
    rng = random.Random(seed)
    guide = cfsm.Guide(index)
    eos = vocab.eos_token_ids[0]
    tokens: list[int] = []
    for _ in range(rng.randrange(5, 60)):
        ids = [t for t in guide.allowed_token_ids().tolist() if t != eos and vocab.tokens[t].isascii()
               and vocab.tokens[t] not in (b"\t", b"\n", b"\r")]
        if not ids:
            break
        tokens.append(rng.choice(ids))
        guide.advance(tokens[-1])
    text = vocab.decode(tokens) + _completion(index, guide.state)
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMAS[name])
    assert _accepted(index, vocab, text.decode())


def test_depth_32_without_a_bound(vocab: cfsm.Vocabulary) -> None:
    def tree(d: int) -> Any:
        return {"name": "n", "children": [tree(d - 1)] if d else []}

    deep = json.dumps(tree(32))
    jsonschema.validate(json.loads(deep), TREE)
    assert _accepted(_index("tree", vocab), vocab, deep)
    assert not _accepted(_index("tree", vocab), vocab, deep[:-1])
    linked: Any = None
    for v in range(40):
        linked = {"v": v, "next": linked}
    assert _accepted(_index("linked", vocab), vocab, json.dumps(linked))
    free: Any = "x"
    for _ in range(32):
        free = {"k": [free, 1.5, None]}
    obj = cfsm.compile_json_object(vocab)
    assert isinstance(obj, cfsm.GrammarIndex)
    assert _accepted(obj, vocab, json.dumps(free))
    assert _accepted(_index("free", vocab), vocab, json.dumps({"meta": free, "tags": [free]}))
    assert not _accepted(obj, vocab, json.dumps(free)[:-1] + "]")
    # the old regular compile still cuts at json_depth when asked to
    unrolled = cfsm.compile_json_object(vocab, cfsm.CfsmConfig(recursion="unroll"))
    assert isinstance(unrolled, cfsm.Index) and not _accepted(unrolled, vocab, json.dumps(free))


def test_non_recursive_schemas_stay_regular(vocab: cfsm.Vocabulary) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/s"}},
              "$defs": {"s": {"type": "string"}}, "required": ["a", "b"]}
    assert isinstance(cfsm.compile_json_schema(schema, vocab), cfsm.Index)


def test_a_pushdown_matcher_past_the_position_limit_compiles_unrolled(vocab: cfsm.Vocabulary) -> None:
    """`max_pushdown_positions`: the same schema compiles to the pushdown matcher under the limit
    and unrolled (an `Index`, free JSON cut at `json_depth`) over it; the two accept the same
    documents up to that depth (and `jsonschema` validates them), only the matcher deeper ones."""
    positions = int(cfsm.compile_json_schema(WITH_FREE, vocab).pda.has_bytes.sum())
    stack = cfsm.compile_json_schema(WITH_FREE, vocab, cfsm.CfsmConfig(max_pushdown_positions=positions))
    unrolled = cfsm.compile_json_schema(WITH_FREE, vocab, cfsm.CfsmConfig(max_pushdown_positions=positions - 1))
    assert isinstance(stack, cfsm.GrammarIndex) and isinstance(unrolled, cfsm.Index)
    rng = random.Random(7)

    def value(depth: int) -> Any:
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(["x", 12, None, True, 1.5])
        if rng.random() < 0.5:
            return [value(depth - 1) for _ in range(rng.randrange(3))]
        return {rng.choice("ab"): value(depth - 1) for _ in range(rng.randrange(3))}

    for _ in range(40):
        doc = {"meta": value(2), "tags": [value(1) for _ in range(rng.randrange(3))]}
        jsonschema.validate(doc, WITH_FREE)
        text = json.dumps(doc)
        assert _accepted(stack, vocab, text) and _accepted(unrolled, vocab, text), text
        for cut in (text[:-1], text + "}"):
            assert not _accepted(stack, vocab, cut) and not _accepted(unrolled, vocab, cut)
    deep: Any = 1
    for _ in range(8):
        deep = [deep]
    text = json.dumps({"meta": deep, "tags": []})
    assert _accepted(stack, vocab, text) and not _accepted(unrolled, vocab, text)
    with pytest.raises(ValueError):
        cfsm.CfsmConfig(max_pushdown_positions=-1)
