"""JSON Schema -> automaton: a feature table per keyword, checked against `jsonschema`."""

from __future__ import annotations

import datetime
import functools
import json
import urllib.parse
from typing import Any

import jsonschema
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cfsm import CfsmConfig, UnsupportedSchemaError
from cfsm.automata.automaton import Dfa, build_dfa
from cfsm.regex.formats import URI
from cfsm.schema.json_schema import json_value_node, schema_to_node, schema_tree

_VALIDATOR = jsonschema.Draft202012Validator


def _extra_format_ok(fmt: str, value: str) -> bool:
    """Oracles for the formats this jsonschema install does not check."""
    if fmt == "date-time":
        try:
            datetime.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            return False
        return "T" in value.upper() and regex.search(r"([Zz]|[+-]\d\d:\d\d)$", value) is not None
    if fmt == "time":
        try:
            datetime.time.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            return False
        return regex.search(r"([Zz]|[+-]\d\d:\d\d)$", value) is not None
    if fmt == "uri":
        parts = urllib.parse.urlsplit(value)
        return bool(parts.scheme) and " " not in value and regex.fullmatch(URI, value) is not None
    return True


def _valid(schema: Any, text: str) -> bool:
    instance = json.loads(text)
    if not _VALIDATOR(schema, format_checker=_VALIDATOR.FORMAT_CHECKER).is_valid(instance):
        return False
    fmt = schema.get("format") if isinstance(schema, dict) else None
    return not (fmt and isinstance(instance, str)) or _extra_format_ok(fmt, instance)


OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
TREE = {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
    "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}}, "$ref": "#/$defs/node"}

# (keyword, schema, config, valid JSON texts, invalid JSON texts)
FEATURES: list[tuple[str, Any, CfsmConfig, list[str], list[str]]] = [
    ("properties+required", OBJ_AB, CfsmConfig(), ['{"a":1}', '{"a":1,"b":"x"}'], ['{"b":"x"}', '{"a":"1"}']),
    ("additionalProperties:false", {**OBJ_AB, "additionalProperties": False}, CfsmConfig(), ['{"a":1}'], ['{"a":1,"c":2}']),
    ("additionalProperties:schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": {"type": "boolean"}}, CfsmConfig(),
     ['{"a":1,"x":true}', '{"x":false,"y":true}'], ['{"a":1,"x":1}', '{"a":true}']),
    ("additionalProperties:true", {"type": "object", "properties": {"a": {"type": "integer"}},
                                   "additionalProperties": True}, CfsmConfig(),
     ['{"a":1,"zz":[1,{"q":null}]}'], ['{"a":"x"}']),
    ("patternProperties", {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, CfsmConfig(), ['{"x_a":1,"x_":2}', "{}"],
     ['{"y":1}', '{"x_a":"s"}']),
    ("patternProperties unanchored", {"type": "object", "patternProperties": {"id": {"type": "integer"}},
                                      "additionalProperties": False}, CfsmConfig(), ['{"my_id_1":3}'], ['{"my_i":3}']),
    ("minProperties/maxProperties", {"type": "object", "properties": {k: {"type": "integer"} for k in "abc"},
                                     "minProperties": 2, "maxProperties": 2}, CfsmConfig(),
     ['{"a":1,"b":2}', '{"b":1,"c":2}'], ['{"a":1}', '{"a":1,"b":2,"c":3}']),
    ("any order", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                   "required": ["a", "b"]}, CfsmConfig(any_order=True), ['{"b":true,"a":1}', '{"a":1,"b":false}'],
     ['{"a":1}', '{"b":true,"a":"x"}']),
    ("enum", {"enum": ["red", "green", 1, None, [1, "a"]]}, CfsmConfig(), ['"red"', "1", "null", '[1,"a"]'],
     ['"blue"', "2"]),
    ("const", {"const": {"a": [1, 2]}}, CfsmConfig(), ['{"a":[1,2]}'], ['{"a":[1]}']),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, CfsmConfig(),
     ['"ab"', '"a\\"c"', '"éé"', '"😀😀"'], ['"a"', '"abcd"', "12"]),
    ("pattern (search)", {"type": "string", "pattern": "[0-9]{3}"}, CfsmConfig(), ['"ab123cd"', '"123"'], ['"12a"']),
    ("pattern (anchored)", {"type": "string", "pattern": "^a+$"}, CfsmConfig(), ['"aaa"'], ['"ab"', '"ba"']),
    ("pattern (quote, newline)", {"type": "string", "pattern": '^a"\\nb$'}, CfsmConfig(), ['"a\\"\\nb"'], ['"a\\"b"']),
    ("pattern+maxLength", {"type": "string", "pattern": "^x", "maxLength": 3}, CfsmConfig(), ['"xyz"'],
     ['"xyzw"', '"yx"']),
    ("format date", {"type": "string", "format": "date"}, CfsmConfig(), ['"2024-02-29"', '"1999-12-31"'],
     ['"2023-02-29"', '"2024-13-01"', '"2024-04-31"']),
    ("format time", {"type": "string", "format": "time"}, CfsmConfig(), ['"12:34:56Z"', '"23:59:59.123+05:30"'],
     ['"24:00:00Z"', '"12:34:56"']),
    ("format date-time", {"type": "string", "format": "date-time"}, CfsmConfig(),
     ['"2024-01-02T03:04:05.678-08:00"', '"2024-01-02T03:04:05Z"'], ['"2024-01-02 03:04:05Z"', '"2024-01-02"']),
    ("format uuid", {"type": "string", "format": "uuid"}, CfsmConfig(), ['"123e4567-e89b-12d3-a456-426614174000"'],
     ['"123e4567e89b12d3a456426614174000"']),
    ("format email", {"type": "string", "format": "email"}, CfsmConfig(), ['"a.b@example.com"'], ['"ab.example.com"']),
    ("format ipv4", {"type": "string", "format": "ipv4"}, CfsmConfig(), ['"192.168.0.1"', '"0.0.0.0"'],
     ['"256.1.1.1"', '"1.2.3"']),
    ("format ipv6", {"type": "string", "format": "ipv6"}, CfsmConfig(), ['"2001:db8::1"', '"::1"', '"fe80::"', '"::"'],
     ['"2001:db8:::1"', '"1:2:3:4:5:6:7:8:9"']),
    ("format uri", {"type": "string", "format": "uri"}, CfsmConfig(), ['"https://example.com/a?b=c#d"', '"urn:isbn:1"'],
     ['"example.com"', '"http://a b"']),
    ("integer minimum/maximum", {"type": "integer", "minimum": -15, "maximum": 1234}, CfsmConfig(),
     ["-15", "0", "1234", "999"], ["-16", "1235", "1.5", "10000"]),
    ("integer exclusive bounds", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, CfsmConfig(),
     ["1", "9"], ["0", "10"]),
    ("number minimum/maximum", {"type": "number", "minimum": -1.5, "maximum": 2.25}, CfsmConfig(),
     ["-1.5", "0", "2.25", "2.2", "-0.75"], ["2.26", "-1.51", "3"]),
    ("number exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0.5}, CfsmConfig(), ["0.51", "1", "100.5"],
     ["0.5", "0", "-2"]),
    ("multipleOf", {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 100}, CfsmConfig(),
     ["0", "49", "98"], ["50", "105", "-7"]),
    ("multipleOf 0.01", {"type": "number", "multipleOf": 0.01}, CfsmConfig(), ["1.25", "3"], ["1.255"]),
    ("number", {"type": "number"}, CfsmConfig(), ["1.5e10", "-0.5", "0", "2E-3"], ['"1"', "true"]),
    ("minItems/maxItems/items", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
     CfsmConfig(), ["[1]", "[1,2,3]"], ["[]", "[1,2,3,4]", '["a"]']),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     CfsmConfig(), ['["a",1]', '["a"]', "[]"], ['[1,"a"]', '["a",1,2]']),
    ("prefixItems+items", {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "null"},
                           "minItems": 2}, CfsmConfig(), ['["a",null]', '["a",null,null]'], ['["a"]', '["a",1]']),
    ("anyOf", {"anyOf": [{"type": "string", "maxLength": 1}, {"type": "integer", "minimum": 5}]}, CfsmConfig(),
     ['"x"', "5"], ["null", "4", '"xy"']),
    ("oneOf", {"oneOf": [{"type": "boolean"}, {"type": "null"}]}, CfsmConfig(), ["true", "null"], ["1"]),
    ("allOf (objects)", {"allOf": [OBJ_AB, {"properties": {"b": {"type": "string"}}, "required": ["b"]}]}, CfsmConfig(),
     ['{"a":1,"b":"x"}'], ['{"a":1}']),
    ("allOf (bounds)", {"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}, CfsmConfig(), ["0", "5"],
     ["6", "-1"]),
    ("type list", {"type": ["string", "null"]}, CfsmConfig(), ['"a"', "null"], ["1", "[]"]),
    ("$ref/$defs", {"$defs": {"pos": {"type": "integer", "minimum": 1}}, "type": "array",
                    "items": {"$ref": "#/$defs/pos"}}, CfsmConfig(), ["[1,2]", "[]"], ["[0]"]),
    ("recursive $ref", TREE, CfsmConfig(), ['{"v":1,"kids":[{"v":2,"kids":[]},{"v":3}]}'], ['{"kids":[]}', '{"v":1,"kids":[{}]}']),
    ("boolean/null", {"type": "boolean"}, CfsmConfig(), ["true", "false"], ['"true"', "null"]),
    ("minLength > maxLength", {"anyOf": [{"type": "string", "minLength": 3, "maxLength": 2}, {"type": "integer"}]},
     CfsmConfig(), ["5"], ['""', '"ab"', '"abc"', '"abcd"']),
    ("free JSON", {}, CfsmConfig(), ['{"a":[1,{"b":null}],"c":"d"}', "3", '"s"'], []),
    ("flexible whitespace", OBJ_AB, CfsmConfig(whitespace="flexible"), ['{ "a" : 1 ,\n  "b": "x"}', '{"a":1}'],
     ['{"a": "1"}']),
]


def _dfa(schema: Any, config: CfsmConfig) -> Dfa:
    return build_dfa(schema_to_node(schema, config))


@pytest.mark.parametrize(("keyword", "schema", "config", "valid", "invalid"), FEATURES, ids=[f[0] for f in FEATURES])
def test_feature_table(keyword: str, schema: Any, config: CfsmConfig, valid: list[str], invalid: list[str]) -> None:
    dfa = _dfa(schema, config)
    for text in valid:
        assert _valid(schema, text), f"oracle disagrees with the table: {text}"
        assert dfa.fullmatch(text.encode()), f"{keyword}: valid instance rejected: {text}"
    for text in invalid:
        assert not _valid(schema, text), f"oracle disagrees with the table: {text}"
        assert not dfa.fullmatch(text.encode()), f"{keyword}: invalid instance accepted: {text}"


# (schema, keyword, path, valid texts, invalid texts the over-approximation accepts)
APPROXIMATED: list[tuple[Any, str, str, list[str], list[str]]] = [
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
      "required": ["a"]}, "uniqueItems", "#/properties/a/uniqueItems", ['{"a":[1,2]}'], ['{"a":[1,1]}']),
    ({"type": "string", "format": "regex"}, "format", "#/format", ['"a+b"'], ['"a(b"']),
    ({"type": "string", "pattern": "(?=a)"}, "pattern", "#/pattern", ['"abc"'], ['"bcd"']),
    ({"type": "array", "items": {"not": {"const": [1]}}}, "not", "#/items/not", ["[[2]]"], ["[[1]]"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"properties": {"b": {"maximum": 0}}}, **{k: {"minProperties": 3} for k in "xyz"}}},
     "dependentSchemas", "#/dependentSchemas",
     ['{"a":1,"b":0}', '{"b":2}'], ['{"a":1,"b":2}']),
    # NOTE: compiled as (if and then) or else: an integer that only `else` admits
    ({"if": {"type": "integer"}, "then": {"minimum": 5}, "else": {"maximum": 0}}, "if", "#/if", ["7", "-0.5"],
     ["-3"]),
    ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, "oneOf", "#/oneOf", ["-3", "2.5"], ["3"]),
    ({"type": "number", "multipleOf": 0.25}, "multipleOf", "#/multipleOf", ["0.75"], ["0.3"]),
]


@pytest.mark.parametrize(("schema", "keyword", "path", "valid", "accepted_invalid"), APPROXIMATED,
                         ids=[a[1] for a in APPROXIMATED])
def test_approximations_accept_a_superset_and_strict_refuses_them(
        schema: Any, keyword: str, path: str, valid: list[str], accepted_invalid: list[str]) -> None:
    node, notes = schema_tree(schema, CfsmConfig(narrow=False))  # the superset (the default narrows instead)
    assert (keyword, path) in {(n.keyword, n.path) for n in notes}
    dfa = build_dfa(node)
    for text in valid:
        assert _valid(schema, text) and dfa.fullmatch(text.encode()), text
    for text in accepted_invalid:  # the documented superset: invalid, yet accepted
        assert not _valid(schema, text) and dfa.fullmatch(text.encode()), text
    with pytest.raises(UnsupportedSchemaError) as info:
        schema_tree(schema, CfsmConfig(strict=True))
    assert info.value.keyword == keyword and info.value.path == path and "strict" in str(info.value)


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("schema", "keyword", "path"),
    [
        ({"$ref": "https://127.0.0.1:9/s.json"}, "$ref", "#/$ref"),
        ({"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}, "$ref", "#/properties/a/$ref"),
        ({"$ref": "#/$defs/missing"}, "$ref", "#/$ref"),
        ({"type": "strin"}, "type", "#/type"),
        ({"type": "string", "minLength": "three"}, "schema", "#"),
        ({"type": "object", "properties": {"a": {"type": "integer", "maximum": [1]}}}, "schema", "#/properties/a"),
        (_nested(10_000), "schema", "#"),
        ("{not json", "schema", "#"),
    ],
)
def test_malformed_schemas_raise_with_keyword_and_path(schema: Any, keyword: str, path: str) -> None:
    with pytest.raises(UnsupportedSchemaError) as info:
        schema_tree(schema)
    assert info.value.keyword == keyword and info.value.path == path


def test_unknown_keywords_are_annotations() -> None:
    plain = {"type": "object", "properties": {"d": {"type": "string", "maxLength": 3}}, "required": ["d"]}
    noisy = {"type": "object", "properties": {"d": {"type": "string", "maxLength": 3, "_format": "date-time",
                                                    "x-kubernetes-int-or-string": True, "self": {"vendor": "x"}}},
             "required": ["d"], "propertiesOrder": ["d"], "id": "urn:thing", "$comment": "c", "examples": [{}]}
    node, notes = schema_tree(noisy)
    assert notes == ()
    a, b = build_dfa(node), build_dfa(schema_to_node(plain))
    for text in ['{"d":"ab"}', '{"d":"abc"}', '{"d":"abcd"}', '{"d":1}', "{}"]:
        assert a.fullmatch(text.encode()) == b.fullmatch(text.encode()) == _valid(plain, text), text


def test_not_over_types_is_exact() -> None:
    schema = {"not": {"type": ["string", "null"]}}
    node, notes = schema_tree(schema)
    dfa = build_dfa(node)
    assert notes == ()
    for text in ["1", "[1]", '{"a":"b"}', "true", '"a"', "null"]:
        assert dfa.fullmatch(text.encode()) == _valid(schema, text), text


def test_refs_resolve_by_id_anchor_and_escaped_pointer() -> None:
    schema = {
        "$id": "https://127.0.0.1:9/root.json",
        "type": "object",
        "properties": {
            "a": {"$ref": "item.json"},
            "b": {"$ref": "#/$defs/a~1b~0c"},
            "c": {"$ref": "#pos"},
            "d": {"$ref": "root.json#/$defs/a~1b~0c"},
        },
        "required": ["a", "b", "c", "d"],
        "$defs": {
            "item": {"$id": "item.json", "type": "string", "maxLength": 2},
            "a/b~c": {"type": "boolean"},
            "p": {"$anchor": "pos", "type": "integer", "minimum": 1},
        },
    }
    dfa = build_dfa(schema_to_node(schema))
    for text in ['{"a":"xy","b":true,"c":3,"d":false}', '{"a":"xyz","b":true,"c":3,"d":false}',
                 '{"a":"x","b":1,"c":3,"d":false}', '{"a":"x","b":true,"c":0,"d":false}']:
        assert dfa.fullmatch(text.encode()) == _valid(schema, text), text


def test_spec_config_does_not_infer_types() -> None:
    schema = {"minLength": 3, "maximum": 5}
    spec = build_dfa(schema_to_node(schema, CfsmConfig.spec()))
    narrowed = build_dfa(schema_to_node(schema))
    for text in ['"abc"', '"ab"', "5", "6", "null", "[1]", '{"a":1}']:
        assert spec.fullmatch(text.encode()) == _valid(schema, text), text
        if narrowed.fullmatch(text.encode()):  # generation defaults narrow, never widen
            assert _valid(schema, text), text
    assert not narrowed.fullmatch(b"null")


def test_recursion_is_bounded_by_max_recursion_depth() -> None:
    nested = {"v": 0}
    for i in range(1, 6):
        nested = {"v": i, "kids": [nested]}
    text = json.dumps(nested, separators=(",", ":"))
    assert not _dfa(TREE, CfsmConfig(max_recursion_depth=2)).fullmatch(text.encode())
    assert _dfa(TREE, CfsmConfig(max_recursion_depth=6)).fullmatch(text.encode())


def test_free_json_depth() -> None:
    dfa = build_dfa(json_value_node(CfsmConfig(json_depth=2)))
    assert dfa.fullmatch(b'{"a":{"b":1}}') and not dfa.fullmatch(b'{"a":{"b":{"c":1}}}')
    assert not dfa.fullmatch(b"[1]")  # object_only


# ---- property test: random instances of a schema, accepted iff jsonschema says valid ------------

PROPERTY_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -20, "maximum": 300},
        "name": {"type": "string", "minLength": 1, "maxLength": 4, "pattern": "^[a-z\"é]"},
        "score": {"type": "number", "exclusiveMinimum": -2.5, "maximum": 7.25},
        "tags": {"type": "array", "items": {"enum": ["x", "y", 1]}, "maxItems": 2},
        "kind": {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"const": "k"}]},
        "day": {"type": "string", "format": "date"},
    },
    "required": ["id", "kind"],
    "additionalProperties": False,
}

# NOTE: integer-valued floats ("3.0") are left out: cfsm writes integers without a fraction,
# a documented subset of what JSON Schema's "integer" allows.
_values = st.one_of(
    st.integers(-40, 400),
    st.integers(-800, 800).filter(lambda n: n % 100 != 0).map(lambda n: n / 100),
    st.text(alphabet='ab"\\é\n€', max_size=6),
    st.sampled_from(["2024-02-29", "2023-02-29", "2020-1-01", "x", "k", "y"]),
    st.none(),
    st.booleans(),
    st.lists(st.sampled_from(["x", "y", 1, 2, None]), max_size=3),
)


_NEAR_VALID = {
    "id": st.integers(-40, 400),
    "name": st.text(alphabet='ab"\\é\n€', max_size=5),
    "score": st.integers(-400, 900).filter(lambda n: n % 100 != 0).map(lambda n: n / 100),
    "tags": st.lists(st.sampled_from(["x", "y", 1, 2]), max_size=3),
    "kind": st.sampled_from([None, True, False, "k", "j", 0]),
    "day": st.sampled_from(["2024-02-29", "2023-02-29", "2020-1-01", "2021-12-31", "2000-02-29", "1900-02-29"]),
}


@st.composite
def _instances(draw: st.DrawFn) -> str:
    parts = []
    for key in PROPERTY_SCHEMA["properties"]:
        if draw(st.booleans()) or key in ("id", "kind") and draw(st.integers(0, 9)) > 0:
            value = draw(_values if draw(st.integers(0, 9)) == 0 else _NEAR_VALID[key])
            parts.append(f"{json.dumps(key)}:{json.dumps(value, ensure_ascii=False, separators=(',', ':'))}")
    return "{" + ",".join(parts) + "}"


@functools.cache
def _property_dfa() -> Dfa:
    return _dfa(PROPERTY_SCHEMA, CfsmConfig())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_instances())
def test_random_instances_accepted_iff_valid(text: str) -> None:
    valid = _valid(PROPERTY_SCHEMA, text) and all(
        _extra_format_ok("date", v) for v in [json.loads(text).get("day")] if isinstance(v, str))
    assert _property_dfa().fullmatch(text.encode()) == valid, text


ANY_ORDER_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"enum": ["x", "y"]},
                   "d": {"type": "null"}},
    "required": ["a", "c"],
    "additionalProperties": False,
}


@functools.cache
def _any_order_dfas() -> tuple[Dfa, Dfa]:
    return (_dfa(ANY_ORDER_SCHEMA, CfsmConfig(any_order=True)),
            _dfa(ANY_ORDER_SCHEMA, CfsmConfig(any_order=True, whitespace="flexible")))


@st.composite
def _any_order_instances(draw: st.DrawFn) -> tuple[str, str]:
    keys = draw(st.permutations("abcd"))[: draw(st.integers(0, 4))]
    if draw(st.integers(0, 4)) == 0:  # sometimes a repeated or an unknown key
        keys.insert(draw(st.integers(0, len(keys))), draw(st.sampled_from("abcde")))
    values = {"a": st.integers(-3, 3), "b": st.booleans(), "c": st.sampled_from(["x", "y", "z"]),
              "d": st.none(), "e": st.integers()}
    parts = [(k, draw(values[k] if draw(st.integers(0, 5)) else st.sampled_from([1, "x", None]))) for k in keys]
    compact = "{" + ",".join(f'"{k}":{json.dumps(v)}' for k, v in parts) + "}"
    spaced = "{\n  " + ",\n  ".join(f'"{k}": {json.dumps(v)}' for k, v in parts) + "\n}"
    return compact, spaced


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=_any_order_instances())
def test_any_order_and_flexible_whitespace_accept_iff_valid(texts: tuple[str, str]) -> None:
    compact_dfa, spaced_dfa = _any_order_dfas()
    compact, spaced = texts
    keys = regex.findall(r'"([a-e])":', compact)
    # duplicate keys are valid JSON Schema instances (the last wins) but never generated: excluded
    valid = _valid(ANY_ORDER_SCHEMA, compact) and len(keys) == len(set(keys))
    assert compact_dfa.fullmatch(compact.encode()) == valid, compact
    assert spaced_dfa.fullmatch(spaced.encode()) == valid, spaced


def _mutually_recursive(k: int) -> dict[str, Any]:
    names = [f"n{i}" for i in range(k)]
    anyone = {"anyOf": [{"$ref": f"#/definitions/{n}"} for n in names]}
    defs = {n: {"type": "object", "properties": {"tag": {"const": n}, "kids": {"type": "array", "items": anyone}},
                "required": ["tag"], "additionalProperties": False} for n in names}
    return {"definitions": defs, "$ref": "#/definitions/n0"}


def test_exponential_recursion_unrolls_less_deep_or_refuses() -> None:
    # k definitions that all refer to each other unroll to k^depth subtrees: past the visit
    # budget the compile starts over with recursion unrolled less deep, and refuses when even
    # unrolling nothing is too large
    small = _mutually_recursive(4)
    dfa = build_dfa(schema_to_node(small))
    for text in ['{"tag":"n0"}', '{"tag":"n0","kids":[{"tag":"n3","kids":[{"tag":"n1"}]}]}', '{"tag":"n9"}']:
        assert dfa.fullmatch(text.encode()) == _valid(small, text), text
    with pytest.raises(UnsupportedSchemaError, match="too large"):
        schema_tree(_mutually_recursive(12))


def test_spec_config_counts_integral_floats_as_integers_and_format_as_annotation() -> None:
    # the specification's language: 1.0 is the integer 1, `format` asserts nothing (2019-09 on)
    cases = [({"type": "integer", "minimum": 0}, ["1", "1.0", "0.00", "-1.0", "1.5", "1.", "1e0x"]),
             ({"const": 1}, ["1", "1.0", "1.01", "2.0", "true"]),
             ({"enum": [[0], -2.0]}, ["[0.0]", "[0]", "-2", "-2.0", "-2.5"]),
             ({"type": "string", "format": "date"}, ['"2024-01-01"', '"06/19/1963"', "3"])]
    validator = jsonschema.Draft202012Validator
    for schema, texts in cases:
        spec = build_dfa(schema_to_node(schema, CfsmConfig.spec(whitespace="compact")))
        default = build_dfa(schema_to_node(schema, CfsmConfig(whitespace="compact")))
        for text in texts:
            try:
                valid = validator(schema).is_valid(json.loads(text))
            except ValueError:
                valid = False  # not JSON
            assert spec.fullmatch(text.encode()) == valid, (schema, text)
            if default.fullmatch(text.encode()):  # the defaults narrow, never widen
                assert valid, (schema, text)
