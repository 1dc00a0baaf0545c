"""A JSON Schema `pattern` (search semantics) compiles its open ends by first match
(`json_schema._then_any_body`): the same language as the plain tree `L` then "anything", checked
against that construction (equal minimal DFAs) and against `jsonschema` on JSON texts."""

from __future__ import annotations

import itertools
import json
import time

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfsm.automata.automaton import Dfa, build_dfa
from cfsm.config import CfsmConfig
from cfsm.errors import UnsupportedRegexError
from cfsm.regex.json_lexical import json_escape
from cfsm.regex.parser import parse_regex
from cfsm.schema.json_schema import _pattern_lang, schema_tree
from cfsm.schema.patterns import search_body

# no newline: Python's `$` also matches before a final newline, ECMA's (cfsm's) does not
_ALPHABET = ['a', 'b', '/', '"', '\\', '\t', 'é']
_STRINGS = ["".join(p) for n in range(4) for p in itertools.product(_ALPHABET, repeat=n)]


def _equivalent(x: Dfa, y: Dfa) -> bool:
    """Whether two DFAs accept the same byte strings (a walk over their pairs of states)."""
    seen = {(x.start, y.start)}
    todo = [(x.start, y.start)]
    while todo:
        p, q = todo.pop()
        if bool(x.accepting[p]) != bool(y.accepting[q]):
            return False
        for b in range(256):
            pair = (int(x.transitions[p, b]), int(y.transitions[q, b]))
            if pair not in seen:
                seen.add(pair)
                todo.append(pair)
    return True


def _check(pattern: str) -> None:
    try:
        tree = json_escape(parse_regex(pattern, search=True))
    except UnsupportedRegexError:
        return
    search_body.cache_clear()
    _pattern_lang.cache_clear()
    node, _ = _pattern_lang(pattern, 200_000)
    plain = build_dfa(tree)
    dfa = build_dfa(node)
    assert _equivalent(dfa, plain), pattern
    validator = jsonschema.Draft202012Validator({"type": "string", "pattern": pattern})
    for s in _STRINGS:
        body = json.dumps(s, ensure_ascii=False)[1:-1].encode()
        assert dfa.fullmatch(body) == validator.is_valid(s), (pattern, s)


@pytest.mark.parametrize("pattern", [
    "", "a", "^a", "a$", "^a$", "a|^b$|/$", "a*", "(a|b)+/", "^$|a", "[^a]", "\\\\", '"', "\\t|é", "a.b", ".",
    "^(a|b)*$", "a{2,3}", "(?:a|b/)a",
])
def test_search_patterns_by_first_match(pattern: str) -> None:
    _check(pattern)


_atoms = st.sampled_from(["a", "b", "/", "[ab]", "a*", "b?", "(a|/)", "(?:b/)*", ".", "[^a]", "\\\\", '"', "é", "^",
                          "$", "a+", "(?:ab|ba)"])


@settings(max_examples=120, deadline=None)
@given(st.lists(st.lists(_atoms, min_size=1, max_size=5), min_size=1, max_size=3))
def test_search_patterns_by_first_match_random(branches: list[list[str]]) -> None:
    _check("|".join("".join(b) for b in branches))


def test_time_zone_alternation_compiles_fast() -> None:
    # JSONSchemaBench o47656: the plain subset construction made ~20,000 states (> 20 s) for a
    # minimal DFA of ~70
    pattern = "UTC|" + "|".join(f"({zone}/[A-Za-z]+)" for zone in (
        "Africa", "America", "Antarctica", "Arctic", "Asia", "Atlantic", "Australia", "Europe", "Indian", "Pacific"))
    search_body.cache_clear()
    _pattern_lang.cache_clear()
    t = time.process_time()
    node, _ = _pattern_lang(pattern, 200_000)
    assert time.process_time() - t < 5
    dfa = build_dfa(node)
    validator = jsonschema.Draft202012Validator({"type": "string", "pattern": pattern})
    for s in ["UTC", "x Europe/Paris y", "Europe/", "Asia", "America/X", "Pacific/Ab\\t", "utc", "Arctic/é"]:
        body = json.dumps(s, ensure_ascii=False)[1:-1].encode()
        assert dfa.fullmatch(body) == validator.is_valid(s), s


@pytest.mark.parametrize("pattern", ["a|b/", "^a", "b$", "(?:ab|ba)", "é"])
def test_pattern_property_keys_by_first_match(pattern: str) -> None:
    # `patternProperties` keys take the same first-match DFA (JSONSchemaBench o48425's game names)
    schema = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}, "additionalProperties": False}
    dfa = build_dfa(schema_tree(schema, CfsmConfig(whitespace="compact"))[0])
    validator = jsonschema.Draft202012Validator(schema)
    for key in _STRINGS:
        for value in (1, "x"):
            instance = {key: value}
            text = json.dumps(instance, ensure_ascii=False, separators=(",", ":")).encode()
            assert dfa.fullmatch(text) == validator.is_valid(instance), (pattern, instance)
