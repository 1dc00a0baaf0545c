"""Flexible whitespace: loop states in the direct construction and in the index (`cfsm.masks.loops`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cfsm
import cfsm.masks.loops
from cfsm import CfsmConfig
from cfsm.automata.automaton import Dfa, build_dfa
from cfsm.automata.direct import build_dfa_direct
from cfsm.masks.index import build_index
from cfsm.masks.loops import find_loops
from cfsm.schema.json_schema import json_value_node, schema_to_node

_FLEX = CfsmConfig(whitespace="flexible")


def _same(a: Dfa, b: Dfa) -> bool:
    return (np.array_equal(a.transitions, b.transitions) and np.array_equal(a.accepting, b.accepting)
            and a.start == b.start and all(np.array_equal(x, y) for x, y in zip(a.byte_classes, b.byte_classes, strict=True)))


_LEAVES = [
    {"type": "string"}, {"type": "string", "maxLength": 5}, {"type": "integer"},
    {"type": "integer", "minimum": 1, "maximum": 30}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
    {"enum": ["ab", "cd", 7]}, {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
    {"type": ["string", "null"]}, {"type": "string", "format": "date"},
    {"type": "array", "items": {"type": "integer"}}, {"type": "array", "items": {"type": "string"}, "minItems": 2},
    {"type": "array", "items": {"type": "object", "properties": {"q": {"type": "number"}}, "required": ["q"]}},
    {"type": "object"}, {"type": "array"},
]


@st.composite
def _objects(draw: st.DrawFn, depth: int = 2) -> dict[str, Any]:
    n = draw(st.integers(1, 4))
    props: dict[str, Any] = {}
    for i in range(n):
        nested = depth > 0 and draw(st.integers(0, 3)) == 0
        props[f"k{i}"] = draw(_objects(depth - 1)) if nested else draw(st.sampled_from(_LEAVES))
    names = list(props)
    required = draw(st.sampled_from([names, names[: len(names) // 2], []]))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@st.composite
def _schemas(draw: st.DrawFn) -> dict[str, Any]:
    section = draw(_objects())
    names = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True))
    return {"type": "object", "properties": dict.fromkeys(names, section), "required": names,
            "additionalProperties": False}


def _sections(n: int) -> dict[str, Any]:
    section = {"type": "object", "additionalProperties": False,
               "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 1000},
                              "label": {"type": "string", "maxLength": 20}, "kind": {"enum": ["alpha", "beta"]},
                              "ratio": {"type": "number"}, "ok": {"type": "boolean"},
                              "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
               "required": ["id", "label", "kind", "ratio", "ok", "tags"]}
    return {"type": "object", "properties": {f"s{i}": section for i in range(n)},
            "required": [f"s{i}" for i in range(n)], "additionalProperties": False}


def test_whitespace_runs_take_the_direct_path() -> None:
    for n in (1, 4):
        node = schema_to_node(_sections(n), _FLEX)
        direct = build_dfa_direct(node, force=True)
        assert direct is not None and _same(direct, build_dfa(node))


def test_lists_and_free_json_take_the_direct_path() -> None:
    # unbounded arrays and free JSON: the separator's whitespace run before each item
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}},
                                               "b": {"type": "object"}}, "required": ["a", "b"]}
    for node in (schema_to_node(schema, _FLEX), json_value_node(_FLEX, object_only=True)):
        direct = build_dfa_direct(node, force=True)
        assert direct is not None and _same(direct, build_dfa(node))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_schemas())
def test_direct_dfa_with_whitespace_runs_is_the_generic_dfa(schema: dict[str, Any]) -> None:
    node = schema_to_node(schema, _FLEX)
    direct = build_dfa_direct(node, force=True)
    if direct is not None:
        assert _same(direct, build_dfa(node))


# a vocabulary with whitespace runs, whitespace-led tokens and long ones
_TOKENS = [b"", b" ", b"  ", b"\n", b"\n  ", b"\t", b"\r\n", b" \"", b"\n  \"", b" {", b" [", b" ]", b" }", b" ,",
           b", ", b",\n", b", \"", b"\":", b"\": ", b"\": \"", b" 1", b" 12", b"1", b"2", b"0", b"-", b".", b"5",
           b"true", b" true", b"false", b" false", b"null", b" null", b"\"", b"{", b"}", b"[", b"]", b",", b":",
           b"{\"", b"\"}", b"a", b"b", b"ab", b"cd", b" \"ab", b"\"ab\"", b"k", b"k0", b"k1", b"\"k0", b" \"k1",
           b"s", b"s0", b"id", b"label", b"2024", b"-01", b" " * 20, b"\n" + b" " * 18 + b"\"",
           b" \"abcdefghijklmnopqrstuvwxyz", b"                \"k0\": 1", b"x", "é".encode(), " é".encode()]
_VOCAB = cfsm.Vocabulary(_TOKENS, eos_token_ids=[0])


def _oracle_rows(dfa: Dfa) -> list[set[int]]:
    """Per live state, the token ids whose bytes survive from it (EOS where accepting)."""
    out = []
    for q in range(dfa.num_states):
        ids = {i for i, t in enumerate(_TOKENS) if t and dfa.walk(q, t) != dfa.dead}
        if dfa.accepting[q]:
            ids.add(0)
        out.append(ids)
    return out


def _rows(index: cfsm.Index) -> list[set[int]]:
    out = []
    for q in range(index.dfa.num_states):
        if index.mask_row[q] < 0:
            out.append(set())
            continue
        bits = np.unpackbits(index.mask(q).view(np.uint8), bitorder="little")[: _VOCAB.size]
        out.append(set(np.flatnonzero(bits).tolist()))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=_schemas())
def test_loop_states_give_the_walked_masks(schema: dict[str, Any]) -> None:
    dfa = build_dfa(schema_to_node(schema, _FLEX))
    # every whitespace state a loop state here
    loops = find_loops(dfa, _VOCAB.trie_tables, np.arange(dfa.num_states), min_tokens=0)
    index = build_index(dfa, _VOCAB, tuning=cfsm.IndexTuning(loop_min_tokens=0, tiny_states=0))
    assert loops is not None and len(loops.states)
    oracle = _oracle_rows(dfa)
    rows = _rows(index)
    reached = np.flatnonzero(index.mask_row[: dfa.num_states] >= 0)
    for q in reached.tolist():
        assert rows[q] == oracle[q], q


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_schemas())
def test_structural_classes_with_runs_and_lists_are_the_refined_partition(schema: dict[str, Any]) -> None:
    """Where `_Builder.classes` answers (loop, block-union and list states included), its partition
    is the refinement's."""
    _check_classes(schema)


def _check_classes(schema: dict[str, Any]) -> None:
    import cfsm.automata.direct as direct
    from cfsm.automata.automaton import refine

    b = direct._Builder()
    try:
        b.build(schema_to_node(schema, _FLEX), b.final())
        table, _ = b.table()
    except direct.Fallback:
        return
    acc, dist = b.arrays()
    cls = b.classes(table, acc, dist)
    if cls is None:
        return
    live = dist >= 0
    refined = refine(table, np.where(live, (acc.astype(np.int64) + 1) * (int(dist.max()) + 2) + dist + 1, 0))
    pairs = np.unique(np.column_stack([cls, refined]), axis=0)
    assert len(pairs) == len(np.unique(cls)) == len(np.unique(refined))


def test_a_union_equal_to_a_loop_state_shares_its_class() -> None:
    # the optional property's value accepts nothing: the state after "{" with its runs is "S* }",
    # as the loop state before "}" is (a union that reads S into it with the same other ranges)
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"k": {"enum": []}},
                                                     "required": ["k"]}}, "additionalProperties": False}
    node = schema_to_node(schema, _FLEX)
    direct = build_dfa_direct(node, force=True)
    assert direct is not None and _same(direct, build_dfa(node))
    _check_classes(schema)  # the union state is unreachable: the partition tells
