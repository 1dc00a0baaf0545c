"""Length bounds beside a `pattern`: exact while the pattern's DFA states times the bound stay
within `MAX_PATTERN_LENGTH_STATES` (or the pattern's language is finite), else a reported
superset (the bounds dropped, the pattern kept); `jsonschema` decides validity."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cfsm import CfsmConfig
from cfsm.automata.automaton import build_dfa
from cfsm.errors import UnsupportedSchemaError
from cfsm.schema.json_schema import schema_tree

_WORDS = r"^(?:\S+\s+){0,49}\S+$"  # JSONSchemaBench o21115: 1,700 states, a cycle per word


def _accepts(schema: dict, text: str) -> bool:
    node, _ = schema_tree(schema, CfsmConfig(whitespace="compact"))
    return build_dfa(node).fullmatch(json.dumps(text, ensure_ascii=False).encode())


def test_word_count_beside_a_long_bound_is_a_reported_superset() -> None:
    schema = {"type": "string", "pattern": _WORDS, "maxLength": 500}
    node, approx = schema_tree(schema, CfsmConfig(whitespace="compact"))
    assert [(a.keyword, a.kind) for a in approx] == [("maxLength", "superset")]
    assert "beside `pattern`" in approx[0].detail
    dfa = build_dfa(node)
    for text in ["one", "two words", "x " * 49 + "y", "a" * 600, "é ü"]:
        valid = jsonschema.Draft7Validator(schema).is_valid(text)
        if valid:
            assert dfa.fullmatch(json.dumps(text, ensure_ascii=False).encode()), text
    # the pattern itself is still enforced
    for text in ["", " lead", "x " * 50 + "y"]:
        assert not jsonschema.Draft7Validator({"pattern": _WORDS}).is_valid(text)
        assert not dfa.fullmatch(json.dumps(text, ensure_ascii=False).encode()), text
    with pytest.raises(UnsupportedSchemaError, match="maxLength"):
        schema_tree(schema, CfsmConfig(strict=True))


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": r"^\d{1,15}$", "maxLength": 3},  # finite pattern: always exact
    {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4},  # 2 states x 5
    {"type": "string", "pattern": "ab", "maxLength": 5},  # search semantics: a cycle, 30 states x 6
    {"type": "string", "pattern": "/^[0-9]{4}$/"},  # matches nothing (mid-pattern anchors)
])
def test_small_products_stay_exact(schema: dict) -> None:
    node, approx = schema_tree({"anyOf": [schema, {"type": "null"}]}, CfsmConfig(whitespace="compact"))
    assert approx == ()
    dfa = build_dfa(node)
    for text in ["", "1", "12", "123", "1234", "ab", "abc", "abcd", "abcde", "xaby", "xxabyy", "/1234/", "1234"]:
        want = jsonschema.Draft7Validator(schema).is_valid(text)
        assert dfa.fullmatch(json.dumps(text).encode()) == want, (schema, text)
