"""Schemas too large to compile as one automaton fall back to the pushdown matcher with one rule
per reference target (`schema_grammar(refs_as_rules=True)`): the same language, checked against
`jsonschema` and against the regular compile of the same schema. The limits are lowered here so
that small schemas reach them (the real ones take large schemas and seconds)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jsonschema
import pytest

import cfsm
import cfsm.automata.automaton
import cfsm.compiler
import cfsm.schema.json_schema
from cfsm.schema.json_schema import schema_grammar
from cfsm.testing import accepts_bytes

BYTES = cfsm.Vocabulary([bytes([b]) for b in range(256)] + [b""], [256])
EOS = 256
DEPTH = 5


def _dag(depth: int) -> dict[str, Any]:
    """Each definition refers twice to the next: 2**depth copies when references are inlined."""
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"},
                                                                       "b": {"$ref": f"#/$defs/d{i + 1}"}},
                                      "required": ["a"]} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "integer", "minimum": 3}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _instances(depth: int) -> list[str]:
    def build(i: int, both: bool) -> Any:
        if i == depth:
            return 3
        out = {"a": build(i + 1, both)}
        if both and i % 2 == 0:
            out["b"] = build(i + 1, False)
        return out

    texts = []
    for both in (False, True):
        text = json.dumps(build(0, both), separators=(",", ":"))
        texts += [text, text.replace("3", "2", 1), text.replace('"a"', '"c"', 1), text[:-1], text.replace("3", "3.5")]
    return texts


def _accepts(index: Any, text: str) -> bool:
    return accepts_bytes(index, text, EOS)


def _check_language(index: Any, schema: Any) -> None:
    regular = cfsm.compile_json_schema(schema, BYTES, cfsm.CfsmConfig(whitespace="compact", recursion="unroll"))
    assert isinstance(regular, cfsm.Index)
    validator = jsonschema.Draft202012Validator(schema)
    for text in _instances(DEPTH):
        accepted = _accepts(index, text)
        try:
            valid = validator.is_valid(json.loads(text))
        except json.JSONDecodeError:
            valid = False
        assert accepted == valid, text
        assert accepted == _accepts(regular, text), text


def test_refs_as_rules_keeps_the_language() -> None:
    schema = _dag(DEPTH)
    _, rules, _ = schema_grammar(schema, cfsm.CfsmConfig(whitespace="compact"), refs_as_rules=True)
    assert rules  # every plain reference became a rule (the inliner may put small ones back)
    _, plain_rules, _ = schema_grammar(schema, cfsm.CfsmConfig(whitespace="compact"))
    assert not plain_rules  # not recursive: the default compile stays regular


def test_too_many_schema_nodes_falls_back_to_rules() -> None:
    schema = _dag(DEPTH)
    config = cfsm.CfsmConfig(whitespace="compact", limits=cfsm.CfsmLimits(max_schema_visits=40))
    with pytest.raises(cfsm.SchemaTooLargeError):
        cfsm.schema.json_schema.schema_tree(schema, config)
    index = cfsm.compile_json_schema(schema, BYTES, config)
    assert isinstance(index, cfsm.GrammarIndex)
    _check_language(index, schema)


def test_too_many_dfa_states_falls_back_to_rules() -> None:
    schema = _dag(DEPTH)
    size = cfsm.compile_json_schema(schema, BYTES, cfsm.CfsmConfig(whitespace="compact")).dfa.num_states
    # rules stay rules (bodies stay small: max_inline_nodes)
    limits = cfsm.CfsmLimits(max_dfa_states=size // 2, max_inline_nodes=64)
    index = cfsm.compile_json_schema(schema, BYTES, cfsm.CfsmConfig(whitespace="compact", limits=limits))
    assert isinstance(index, cfsm.GrammarIndex)
    _check_language(index, schema)


def _free_values(count: int) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False,
            "properties": {f"p{i}": {"type": ["object", "array"][i % 2]} for i in range(count)}}


def test_optional_members_with_free_json_share_their_tails() -> None:
    """Optional properties whose values are free JSON (rules of the pushdown matcher): each
    member's tail is built once (a `Shared` fragment), not once per path through the members
    before it (2**n). The language is checked against `jsonschema`."""
    small = cfsm.compile_json_schema(_free_values(4), BYTES, cfsm.CfsmConfig(whitespace="compact"))
    large = cfsm.compile_json_schema(_free_values(8), BYTES, cfsm.CfsmConfig(whitespace="compact"))
    assert isinstance(large, cfsm.GrammarIndex) and isinstance(small, cfsm.GrammarIndex)
    assert large.pda.num_states < 3 * small.pda.num_states  # linear in the members, not exponential
    schema = _free_values(8)
    validator = jsonschema.Draft202012Validator(schema)
    for instance in [{}, {"p0": {}}, {"p1": [1, {"a": [2]}], "p4": {"x": {"y": []}}}, {"p0": [], "p1": []},
                     {"p7": [[[]]], "p0": {}}, {"p0": {}, "p7": [[[]]]}, {"p2": {"a": 1}, "p2x": 1},
                     {f"p{i}": ({} if i % 2 == 0 else []) for i in range(8)}]:
        text = json.dumps(instance, separators=(",", ":"))
        accepted = _accepts(large, text)
        if accepted:
            assert validator.is_valid(instance), text
        else:  # the default config fixes the property order
            assert not validator.is_valid(instance) or list(instance) != sorted(instance, key=lambda k: int(k[1:])), text


def test_long_string_bounds_are_approximated_as_a_last_resort() -> None:
    """No references to turn into rules: the compile drops string bounds above
    `MAX_EXACT_LENGTH` and reports it (a superset: every valid text still accepted)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 300},
                                               "n": {"type": "integer"}}, "required": ["name"]}
    exact = cfsm.compile_json_schema(schema, BYTES, cfsm.CfsmConfig(whitespace="compact"))
    assert isinstance(exact, cfsm.Index) and not exact.approximations
    limits = cfsm.CfsmLimits(max_dfa_states=exact.dfa.num_states // 2)
    loose = cfsm.compile_json_schema(schema, BYTES, cfsm.CfsmConfig(whitespace="compact", limits=limits))
    assert [(a.keyword, a.path) for a in loose.approximations] == [("maxLength", "#/properties/name")]
    with pytest.raises(cfsm.UnsupportedSchemaError):
        cfsm.compile_json_schema(schema, BYTES, cfsm.CfsmConfig(whitespace="compact", strict=True, limits=limits))
    validator = jsonschema.Draft202012Validator(schema)
    for name in ["", "a", "a" * 300, "a" * 301, "é" * 40]:
        for extra in ["", ',"n":3', ',"n":"x"']:
            text = '{"name":' + json.dumps(name, ensure_ascii=False) + extra + "}"
            valid = validator.is_valid(json.loads(text))
            if valid:
                assert _accepts(loose, text), text
            elif _accepts(loose, text):
                assert len(name) > 300, text  # only the approximated bound lets an invalid text through


def test_rules_nested_too_deep_for_python_are_not_an_escape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inlining a deep chain of rules may pass Python's stack (a JSONSchemaBench schema): that is a
    `GrammarError`, so a recursive schema compiles unrolled and the rule fallback goes on to the
    last resort, instead of a RecursionError escaping."""
    def too_deep(*args: Any, **kwargs: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(cfsm.compiler, "compile_grammar", too_deep)
    tree = {"$defs": {"t": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/t"}}}, "required": ["v"]}}, "$ref": "#/$defs/t"}
    index = cfsm.compile_json_schema(tree, BYTES, cfsm.CfsmConfig(whitespace="compact"))
    assert isinstance(index, cfsm.Index)  # unrolled
    assert _accepts(index, '{"v":1,"kids":[{"v":2}]}') and not _accepts(index, '{"kids":[]}')
    config = cfsm.CfsmConfig(whitespace="compact", limits=cfsm.CfsmLimits(max_schema_visits=40))
    with pytest.raises(cfsm.CfsmError):  # the last resort unrolls the references again: still too large
        cfsm.compile_json_schema(_dag(DEPTH), BYTES, config)


@pytest.mark.parametrize("config", [cfsm.CfsmConfig(whitespace="compact"), cfsm.CfsmConfig.spec(whitespace="compact")])
def test_thousands_of_counted_characters_and_items_are_approximated_up_front(config: cfsm.CfsmConfig) -> None:
    """Past MAX_COUNTED counted characters / items the bounds above MAX_EXACT_LENGTH / MAX_EXACT_ITEMS
    are approximated before any automaton is built (reported; a superset); strict mode keeps them
    exact; bounds at or below those limits stay exact."""
    schema = {"type": "object", "properties": {
        "text": {"type": "string", "maxLength": 5000},
        "short": {"type": "string", "maxLength": 3},
        "list": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 100}},
        "required": ["short"]}
    node, notes = cfsm.schema.json_schema.schema_tree(schema, config)
    assert {n.keyword for n in notes} == {"maxLength", "maxItems"}
    dfa = cfsm.automata.automaton.build_dfa(node)
    validator = jsonschema.Draft202012Validator(schema)
    for instance in [{"short": "abc"}, {"short": "abcd"}, {"text": "x" * 5000, "short": ""}, {"short": "", "list": []},
                     {"short": "", "list": [1] * 100}, {"text": "x" * 5001, "short": ""}, {"short": "", "list": [1] * 101},
                     {"short": "", "list": ["a"]}]:
        text = json.dumps(instance, separators=(",", ":"))
        if validator.is_valid(instance):
            assert dfa.fullmatch(text.encode()), text  # a superset
        elif len(instance.get("text", "")) <= 5000 and len(instance.get("list", [])) <= 100:
            assert not dfa.fullmatch(text.encode()), text  # what stays exact
    strict = cfsm.schema.json_schema.schema_tree({"type": "string", "maxLength": 5000}, dataclasses.replace(config, strict=True))
    assert strict[1] == ()
    small = {"type": "string", "maxLength": cfsm.schema.json_schema.MAX_COUNTED}
    assert cfsm.schema.json_schema.schema_tree(small, config)[1] == ()
