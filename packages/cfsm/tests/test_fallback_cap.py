"""A refused pushdown matcher's unrolled fallback is tried within `compiler.FALLBACK_DFA_STATES`
states (`build_dfa(node, max_states)` stops early); past it the schema compiles as the pushdown
matcher with one rule per reference target. Oracles: the uncapped `build_dfa` (a capped build
below its cap is the same DFA), and `jsonschema` for the languages. The limits are lowered here
so that small schemas reach them."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cfsm
import cfsm.compiler
from cfsm.automata.automaton import build_dfa
from cfsm.regex.parser import parse_regex
from cfsm.testing import accepts_bytes

BYTES = cfsm.Vocabulary([bytes([b]) for b in range(256)] + [b""], [256])
EOS = 256
COMPACT = cfsm.CfsmConfig(whitespace="compact", max_pushdown_positions=4)

TREE = {"$defs": {"t": {"type": "object", "additionalProperties": False, "required": ["v"],
                        "properties": {"v": {"type": "integer", "minimum": 0},
                                       "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 3}}}},
        "$ref": "#/$defs/t"}


@pytest.mark.parametrize("pattern", ["[a-c]{2,9}x", "(ab|a)*b{3}", "[0-9]{1,30}(\\.[0-9]+)?", "é|[^a]{2}", "(a|b)*a(a|b){4}"])
def test_a_capped_build_is_the_same_dfa_or_too_large(pattern: str) -> None:
    node = parse_regex(pattern)
    whole = build_dfa(node)
    for cap in (2, whole.num_states - 1, whole.num_states, 4 * whole.num_states, 10**6):
        try:
            dfa = build_dfa(node, cap)
        except cfsm.GrammarTooLargeError:
            assert cap < 10**6
            continue
        assert np.array_equal(dfa.transitions, whole.transitions)
        assert np.array_equal(dfa.accepting, whole.accepting) and dfa.start == whole.start
    with pytest.raises(cfsm.GrammarTooLargeError):
        build_dfa(node, 1)


def _doc(depth: int, width: int, value: int) -> dict[str, Any]:
    out: dict[str, Any] = {"v": value}
    if depth:
        out["kids"] = [_doc(depth - 1, width, value + k) for k in range(width)]
    return out


def _texts(doc: dict[str, Any]) -> list[str]:
    text = json.dumps(doc, separators=(",", ":"))
    return [text, text.replace('"v":0', '"v":-1', 1), text.replace('"v"', '"w"', 1), text[:-1],
            text.replace('"v":1', '"v":1.5', 1), text.replace("[", '[{"v":1},', 1)]


def _fallbacks(cap: int) -> Any:
    config = dataclasses.replace(COMPACT, limits=cfsm.CfsmLimits(fallback_dfa_states=cap))
    return cfsm.compile_json_schema(TREE, BYTES, config)


def test_a_large_unrolled_fallback_compiles_as_rules() -> None:
    unrolled = _fallbacks(10**6)
    assert isinstance(unrolled, cfsm.Index)  # the pushdown matcher is refused: unrolled, as before
    rules = _fallbacks(unrolled.dfa.num_states // 3)
    assert isinstance(rules, cfsm.GrammarIndex)
    validator = jsonschema.Draft202012Validator(TREE)
    depth = cfsm.CfsmConfig().max_recursion_depth
    for doc_depth in range(depth + 3):
        for text in _texts(_doc(doc_depth, 2, 0)):
            try:
                valid = validator.is_valid(json.loads(text))
            except json.JSONDecodeError:
                valid = False
            assert accepts_bytes(rules, text, EOS) == valid, text  # the schema's language, any depth
            if doc_depth < depth:
                assert accepts_bytes(unrolled, text, EOS) == valid, text


@functools.cache
def _rules_fallback() -> Any:
    return _fallbacks(8)


@settings(max_examples=40, deadline=None)
@given(st.recursive(st.builds(lambda v: {"v": v}, st.integers(-2, 20)),
                    lambda kids: st.builds(lambda v, k: {"v": v, "kids": k}, st.integers(-2, 20),
                                           st.lists(kids, max_size=4)),
                    max_leaves=12))
def test_the_rules_fallback_agrees_with_jsonschema(doc: dict[str, Any]) -> None:
    """Documents with the properties in their declared order (the default config fixes it)."""
    index = _rules_fallback()
    assert isinstance(index, cfsm.GrammarIndex)
    text = json.dumps(doc, separators=(",", ":"))
    assert accepts_bytes(index, text, EOS) == jsonschema.Draft202012Validator(TREE).is_valid(doc), text
