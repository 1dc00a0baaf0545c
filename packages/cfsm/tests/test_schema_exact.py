"""Keywords compiled exactly (no approximation reported), checked against `jsonschema` on every
small instance of a finite universe: `dependentRequired` (and `dependencies` lists),
`propertyNames` over string keywords, `not` of `const` / `enum` scalars, `uniqueItems` over items
of a few scalar values, `contains` / `minContains`, `unevaluatedProperties` / `unevaluatedItems`
in a schema without in-place applicators, `if` / `then` /
`else` whose condition has a simple negation (booleans, types, scalar values, one numeric bound),
`maxContains` over such a `contains`, up to three dependent schemas (absent, or present and valid).

Each schema compiles in the spec config and the default one (compact and flexible whitespace);
an instance is accepted exactly when the validator says it is valid, except for what the config
narrows by design (defaults: fixed property order, no undeclared properties, integers without a
fraction; numbers under a `not` are spelled without an exponent), which only ever rejects.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest

import cfsm
from cfsm.automata.automaton import build_dfa
from cfsm.schema.json_schema import schema_tree
from cfsm.schema.refs import META_FRAGMENTS

SCALARS = [1, 2, 1.0, 2.5, 0, "a", "b", "a/b", "\n", True, False, None]
ITEMS = [1, 2, "a", True, False, None, 1.0, {}, []]
NAMES = ["a", "b", "c", "zz"]
STRINGS = ["", "x", "ab", "abc", "abcd", "abcde", "abcdef", "\u00e9\u00e9"]


def _arrays() -> list[Any]:
    return [list(p) for n in range(4) for p in itertools.product(ITEMS, repeat=n)]


def _objects() -> list[Any]:
    out: list[Any] = []
    for n in range(4):
        for keys in itertools.permutations(NAMES, n):
            out.append({k: 1 for k in keys})
    return out


def _texts(instance: Any, whitespace: str) -> list[str]:
    texts = [json.dumps(instance, separators=(",", ":")), json.dumps(instance, separators=(",", ":"), ensure_ascii=False)]
    if whitespace == "flexible":
        texts.append(json.dumps(instance))
    if isinstance(instance, str) and "/" in instance:
        texts.append(json.dumps(instance).replace("/", "\\/"))  # the other spelling of a slash
    if instance == "\n":
        texts += ['"\\u000a"', '"\\u000A"']
    return list(dict.fromkeys(texts))


CASES: list[tuple[str, Any, list[Any]]] = [
    ("dependentRequired", {"type": "object", "properties": {"a": {}, "b": {}, "c": {}},
                           "dependentRequired": {"a": ["b"], "c": ["a"]}}, _objects()),
    ("dependencies (list, draft 7)", {"type": "object", "properties": {"a": {}, "b": {}},
                                      "dependencies": {"b": ["a"]}, "additionalProperties": False}, _objects()),
    ("dependentSchemas that only require", {"type": "object", "properties": {"a": {}, "b": {}, "c": {}},
                                            "dependentSchemas": {"a": {"required": ["c"]}}}, _objects()),
    ("dependentRequired on an undeclared name, closed object",
     {"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["zz"]}, "additionalProperties": False},
     _objects()),
    ("dependentSchemas", {"type": "object", "properties": {"a": {}, "b": {}, "c": {}},
                          "dependentSchemas": {"a": {"properties": {"b": {"enum": [1, 2]}}}, "b": {"required": ["c"]}}},
     _objects()),
    ("dependencies with a schema (draft 7)", {"type": "object", "properties": {"a": {}, "b": {}},
                                              "dependencies": {"a": {"properties": {"b": {"type": "string"}}}}},
     _objects()),
    ("propertyNames maxLength", {"type": "object", "propertyNames": {"maxLength": 1},
                                 "additionalProperties": {"type": "integer"}}, _objects()),
    ("propertyNames pattern and declared names", {"type": "object", "properties": {"a": {}, "zz": {}},
                                                  "propertyNames": {"pattern": "^[a-c]$"}}, _objects()),
    ("propertyNames enum", {"type": "object", "propertyNames": {"enum": ["b", "c"]}}, _objects()),
    ("propertyNames false", {"propertyNames": False}, [*_objects(), 1, "a"]),
    ("not const", {"not": {"const": 1}}, SCALARS),
    ("not enum of scalars", {"not": {"enum": [0, "a/b", "\n", True, None, 2.5]}}, SCALARS),
    ("not const beside enum", {"enum": [1, 2, "a"], "not": {"const": 1.0}}, SCALARS),
    ("two nots under allOf", {"allOf": [{"not": {"const": 1}}, {"not": {"enum": ["a", False]}}]}, SCALARS),
    ("typed not", {"type": "string", "not": {"enum": ["a", "a/b"]}}, SCALARS),
    ("uniqueItems booleans", {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True}, _arrays()),
    ("uniqueItems enum with bounds", {"type": "array", "items": {"enum": [1, "a", None, 1.0]}, "uniqueItems": True,
                                      "minItems": 1, "maxItems": 2}, _arrays()),
    ("contains", {"type": "array", "contains": {"type": "string"}}, _arrays()),
    ("contains with items", {"type": "array", "items": {"type": ["integer", "string"]}, "contains": {"const": 2}},
     _arrays()),
    ("minContains", {"type": "array", "contains": {"type": "boolean"}, "minContains": 2}, _arrays()),
    ("contains false", {"type": "array", "contains": False}, _arrays()),
    ("if on a numeric bound", {"type": "number", "if": {"exclusiveMaximum": 0}, "then": {"minimum": -10},
                               "else": {"multipleOf": 2}}, [*SCALARS, -100, -5, 3, 4, -0.5]),
    ("if true", {"if": True, "then": {"const": "a"}, "else": {"const": "b"}}, SCALARS),
    ("if false", {"if": False, "then": {"const": "a"}, "else": {"const": "b"}}, SCALARS),
    ("if const, then false", {"if": {"const": 1}, "then": False}, SCALARS),
    ("if const, else false", {"if": {"enum": [1, "a"]}, "else": False}, SCALARS),
    ("if type", {"if": {"type": "string"}, "then": {"maxLength": 1}, "else": {"type": "integer"}}, SCALARS),
    ("if, then and else in separate allOf subschemas", {"allOf": [{"if": {"exclusiveMaximum": 0}},
                                                                 {"then": {"minimum": -10}}, {"else": {"multipleOf": 2}}]},
     [*SCALARS, -100, -5, 3, 4]),
    ("two conditionals under allOf", {"allOf": [{"if": {"const": 1}, "then": {"type": "integer"}},
                                                {"if": {"const": "a"}, "else": {"type": "string"}}]}, SCALARS),
    ("maxContains", {"type": "array", "contains": {"const": 1}, "maxContains": 2, "minContains": 2}, _arrays()),
    ("maxContains, minContains 0", {"type": "array", "contains": {"const": 1}, "minContains": 0, "maxContains": 1},
     _arrays()),
    ("maxContains over items", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1},
                                "maxContains": 1}, _arrays()),
    ("uniqueItems over prefixItems", {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "boolean"}],
                                      "uniqueItems": True, "items": False}, _arrays()),
    ("uniqueItems over prefixItems and items", {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": [1, True]}],
                                                "uniqueItems": True, "items": {"enum": [1, 2, "a"]}}, _arrays()),
    ("unevaluatedProperties false", {"type": "object", "properties": {"a": {}}, "patternProperties": {"^b": {}},
                                     "unevaluatedProperties": False}, _objects()),
    ("unevaluatedProperties schema", {"type": "object", "properties": {"a": {}},
                                      "unevaluatedProperties": {"type": "string"}}, _objects()),
    ("unevaluatedItems after prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}],
                                            "unevaluatedItems": False}, _arrays()),
    ("unevaluatedItems schema", {"type": "array", "prefixItems": [True], "unevaluatedItems": {"type": "boolean"}},
     _arrays()),
    ("oneOf of overlapping string lengths", {"type": "string", "oneOf": [{"minLength": 2}, {"maxLength": 4}]}, STRINGS),
    ("oneOf of overlapping numeric bounds", {"oneOf": [{"minimum": 2}, {"exclusiveMaximum": 5}]},
     [*SCALARS, -1, 4, 5, 7.5]),
    ("oneOf of boolean schemas", {"oneOf": [True, {"const": 1}, False]}, SCALARS),
    ("oneOf with an empty schema", {"oneOf": [{"type": "number"}, {}]}, SCALARS),
    ("oneOf of disjoint types", {"oneOf": [{"type": "string", "maxLength": 1}, {"type": "integer", "minimum": 1},
                                           {"enum": [None, False]}]}, [*SCALARS, *STRINGS]),
    ("oneOf of required properties", {"type": "object", "properties": {"a": {}, "b": {}, "c": {}},
                                      "oneOf": [{"required": ["a"]}, {"required": ["b", "c"]}]}, _objects()),
    ("oneOf of several keywords each", {"oneOf": [{"type": "string", "maxLength": 1}, {"type": ["string", "boolean"]},
                                                  {"minimum": 1, "maximum": 2}]}, [*SCALARS, *STRINGS]),
    ("oneOf as a discriminated union", {"oneOf": [
        {"type": "object", "properties": {"k": {"const": 1}, "a": {}}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"enum": [2, "a"]}, "b": {"type": "string"}}, "required": ["k"]}]},
     [{"k": k, **extra} for k in (1, 2, "a", None) for extra in ({}, {"a": 1}, {"b": "x"}, {"b": 1})]),
    ("oneOf through references", {"$defs": {"s": {"type": "string"}, "n": {"type": "number"}},
                                  "oneOf": [{"$ref": "#/$defs/s"}, {"$ref": "#/$defs/n"}]}, SCALARS),
    ("maxContains over objects that require", {"type": "array", "contains": {"type": "object", "required": ["a"]},
                                               "maxContains": 1},
     [[], [{}], [{"a": 1}], [{"a": 1}, {"a": 2}], [{"a": 1}, {}, 1], [{}, {"a": 1}, {"a": 2}]]),
    ("unevaluatedProperties beside anyOf", {"type": "object", "properties": {"a": {}}, "anyOf": [
        {"properties": {"b": {}}, "required": ["b"]}, {"properties": {"c": {}}, "required": ["c"]}],
        "unevaluatedProperties": False}, _objects()),
    ("unevaluatedProperties in a cousin", {"allOf": [{"properties": {"a": {}}}, {"unevaluatedProperties": False}]},
     _objects()),
    ("unevaluatedProperties beside oneOf", {"type": "object", "properties": {"c": {}, "a": {}, "b": {}},
                                            "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
                                            "unevaluatedProperties": {"const": 1}},
     [*_objects(), {"a": 2}, {"a": 1, "b": 2}, {"c": 2, "a": 1}, {"a": 1, "zz": 2}]),
    ("unevaluatedProperties beside a discriminated oneOf", {"oneOf": [
        {"type": "object", "properties": {"k": {"const": 1}, "a": {}}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"const": 2}, "b": {}}, "required": ["k"]}],
        "unevaluatedProperties": False},
     [{"k": 1}, {"k": 1, "a": 1}, {"k": 1, "b": 1}, {"k": 2, "b": 1}, {"k": 2, "a": 1}, {"k": 3}, {"a": 1}]),
    ("unevaluatedProperties beside if/then/else", {"type": "object", "properties": {"a": {}}, "if": {"required": ["a"]},
                                                   "then": {"properties": {"b": {}}}, "else": {"properties": {"c": {}}},
                                                   "unevaluatedProperties": False}, _objects()),
    ("unevaluatedProperties beside a lone if", {"type": "object", "if": {"properties": {"a": {"const": 1}}},
                                                "unevaluatedProperties": False},
     [{}, {"a": 1}, {"a": 2}, {"a": 1, "b": 1}, {"b": 1}]),
    ("unevaluatedProperties beside $ref", {"$defs": {"d": {"properties": {"a": {}}}}, "$ref": "#/$defs/d",
                                           "properties": {"b": {}}, "unevaluatedProperties": False}, _objects()),
    ("unevaluatedProperties beside dependentSchemas", {"type": "object", "properties": {"a": {}},
                                                       "dependentSchemas": {"a": {"properties": {"b": {}}}},
                                                       "unevaluatedProperties": False}, _objects()),
    ("unevaluatedProperties over a cousin's additionalProperties", {"allOf": [
        {"properties": {"a": {}}, "additionalProperties": {"type": "string"}}, {"properties": {"b": {}}}],
        "unevaluatedProperties": False}, [*_objects(), {"b": "x"}, {"a": 1, "b": "x"}]),
    ("unevaluatedItems beside allOf and anyOf", {"type": "array", "allOf": [{"prefixItems": [{"type": "integer"}]}],
                                                 "anyOf": [{"prefixItems": [True, {"type": "string"}]},
                                                           {"prefixItems": [True, True, True]}],
                                                 "unevaluatedItems": False}, _arrays()),
    ("unevaluatedItems true in a subschema", {"allOf": [{"prefixItems": [{"type": "string"}]}, {"unevaluatedItems": True}],
                                             "unevaluatedItems": False}, _arrays()),
    ("unevaluatedItems in a cousin", {"allOf": [{"prefixItems": [True]}, {"unevaluatedItems": False}]}, _arrays()),
    ("not integer", {"not": {"type": "integer"}}, [*SCALARS, 1.5, -0.5, 0.25, -3, 10.0]),
    ("not integer nor boolean", {"not": {"type": ["integer", "boolean"]}, "enum": [1, 1.5, True, "a", 2.0, None]},
     [*SCALARS, 1.5]),
    ("multipleOf under allOf", {"allOf": [{"multipleOf": 2}, {"multipleOf": 3}], "anyOf": [{"multipleOf": 4}]},
     [0, 1, 2, 3, 4, 6, 9, 12, 18, 24, 36, -12, 2.5, 12.0]),
    ("unevaluatedItems beside contains", {"type": "array", "contains": {"type": "string"},
                                          "unevaluatedItems": {"type": "integer"}}, _arrays()),
    ("unevaluatedItems beside contains, minContains 0", {"type": "array", "contains": {"type": "string"},
                                                         "minContains": 0, "unevaluatedItems": False}, _arrays()),
    ("if on required properties", {"type": "object", "properties": {"a": {}, "b": {}, "c": {}},
                                   "if": {"required": ["a", "b"]}, "then": {"maxProperties": 2},
                                   "else": {"required": ["c"]}}, _objects()),
]

CONFIGS = {"spec": cfsm.CfsmConfig.spec(whitespace="compact"), "spec-flexible": cfsm.CfsmConfig.spec(),
           "default": cfsm.CfsmConfig(whitespace="compact"), "default-flexible": cfsm.CfsmConfig()}


def _extras_first(schema: Any, instance: Any) -> bool:
    """An undeclared property before a declared one (a documented limit of every config)."""
    declared = schema.get("properties", {}) if isinstance(instance, dict) else {}
    kinds = [k in declared for k in instance] if declared else []
    return any(not a and b for a, b in itertools.pairwise(kinds))


def _narrowed_by_default(schema: Any, instance: Any) -> bool:
    """Valid instances the default config rejects by design (see the module docstring)."""
    if isinstance(instance, float) and instance.is_integer():
        return True
    if "type" not in schema and "propertyNames" in schema and not isinstance(instance, dict):
        return True  # type inference: object keywords make an object
    if isinstance(instance, list) and any(isinstance(x, float) and x.is_integer() for x in instance):
        return True
    if isinstance(instance, dict):
        declared = list(schema.get("properties", {}))
        if any(k not in declared for k in instance) and "additionalProperties" not in schema:
            return True
        return [k for k in instance if k in declared] != [k for k in declared if k in instance]
    return False


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(("what", "schema", "universe"), CASES, ids=[c[0] for c in CASES])
def test_exact_keywords_agree_with_the_validator(what: str, schema: Any, universe: list[Any], config: str) -> None:
    cfg = CONFIGS[config]
    node, notes = schema_tree(schema, cfg)
    assert notes == (), f"{what}: reported as approximated: {notes}"
    dfa = build_dfa(node)
    # NOTE: draft 2020-12 replaced `dependencies` (draft 7's validator still enforces it)
    validator = (jsonschema.Draft7Validator if "dependencies" in schema else jsonschema.Draft202012Validator)(schema)
    for instance in universe:
        valid = validator.is_valid(instance)
        for text in _texts(instance, cfg.whitespace):
            accepted = dfa.fullmatch(text.encode())
            if accepted:
                assert valid, f"{what} ({config}): false accept: {text}"
            elif valid:
                assert _extras_first(schema, instance) or config.startswith("default") and \
                    _narrowed_by_default(schema, instance), \
                    f"{what} ({config}): false reject: {text}"


def test_numbers_under_not_are_spelled_without_an_exponent() -> None:
    """The documented subset: a valid number written with an exponent is rejected, never an invalid one accepted."""
    dfa = build_dfa(schema_tree({"type": "number", "not": {"const": 1}}, cfsm.CfsmConfig.spec())[0])
    validator = jsonschema.Draft202012Validator({"type": "number", "not": {"const": 1}})
    for text in ["1e0", "10e-1", "0.1E1", "2e0", "1", "1.00", "-1", "2"]:
        if dfa.fullmatch(text.encode()):
            assert validator.is_valid(json.loads(text)) and "e" not in text.lower(), text


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "object", "properties": {"a": {"const": 1}}}, "maxContains": 1}, "contains"),
    ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, "oneOf"),
    ({"oneOf": [{"type": "object", "properties": {"a": {"const": 1}}}, {"required": ["a"]}]}, "oneOf"),
    ({"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["zz"]}}, "dependentRequired"),
    ({"type": "object", "dependentSchemas": {k: {"properties": {"a": {"type": "string"}}} for k in "wxyz"}},
     "dependentSchemas"),
    ({"type": "object", "propertyNames": {"type": "string", "minimum": 3, "allOf": [{"maxLength": 2}]}},
     "propertyNames"),
    ({"type": "array", "allOf": [{"prefixItems": [True]}], "contains": {"type": "string"}, "unevaluatedItems": False},
     "unevaluatedItems"),
    ({"type": "array", "contains": {"type": "string", "pattern": "a"}, "unevaluatedItems": False}, "unevaluatedItems"),
    ({"type": "object", "anyOf": [{"properties": {"b": {}}}, {"patternProperties": {"^a": {}}}],
      "allOf": [{"additionalProperties": {"type": "string"}}], "unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"$dynamicAnchor": "x", "$defs": {"d": {"$dynamicRef": "#x", "prefixItems": [True]}}, "$ref": "#/$defs/d",
      "unevaluatedItems": False}, "unevaluatedItems"),
])
def test_what_stays_approximated_is_reported(schema: Any, keyword: str) -> None:
    _, notes = schema_tree(schema, cfsm.CfsmConfig.spec())
    assert keyword in {n.keyword for n in notes}
    with pytest.raises(cfsm.UnsupportedSchemaError):
        schema_tree(schema, cfsm.CfsmConfig.spec(strict=True))


def test_ref_beside_an_id_resolves_inside_its_target() -> None:
    """A `$ref` whose target has its own `$id` (and relative references under it): merged with the
    target first, the target's base stays the base of what it contains (JSON-Schema-Test-Suite)."""
    schema = {"$id": "http://example.com/a.json", "$ref": "b.json",
              "properties": {"foo": {"$id": "b.json", "$defs": {"inner": {"properties": {"bar": {"type": "string"}}}},
                                     "$ref": "#/$defs/inner"}}}
    dfa = build_dfa(schema_tree(schema, cfsm.CfsmConfig.spec(whitespace="compact"))[0])
    validator = jsonschema.Draft202012Validator(schema)
    for instance in [{"foo": {"bar": 1}, "bar": "a"}, {"foo": {"bar": "a"}, "bar": 1}, {"foo": {"bar": "a"}, "bar": "a"}]:
        text = json.dumps(instance, separators=(",", ":"))
        assert dfa.fullmatch(text.encode()) == validator.is_valid(instance), text


@pytest.mark.parametrize("schema", [
    {"properties": {"foo": {}}, "dependentSchemas": {"foo": {"properties": {"bar": {}}, "additionalProperties": False}}},
    {"properties": {"foo2": {}}, "dependentSchemas": {"foo2": {"properties": {"bar": {}}}}, "additionalProperties": False},
])
def test_dependent_schemas_beside_additional_properties_stay_approximated(schema: Any) -> None:
    """Merged, additionalProperties would see the other schema's properties (test-suite cases)."""
    _, notes = schema_tree(schema, cfsm.CfsmConfig.spec())
    assert "dependentSchemas" in {n.keyword for n in notes}


@pytest.mark.parametrize("config", ["spec", "default"])
@pytest.mark.parametrize("schema", [
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "boolean"}], "uniqueItems": True},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": [1, True, None]}], "uniqueItems": True,
     "minItems": 1, "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": [1, True]}, {"const": False}], "uniqueItems": True,
     "minItems": 3},
])
def test_unique_items_over_a_finite_prefix_and_free_items(schema: Any, config: str) -> None:
    """Spec: the approximation is a superset that still keeps the prefix items distinct: every
    valid array is accepted, and an accepted invalid one repeats a value only with a later item.
    Default: narrowed (`cfsm.schema.narrow`), every accepted array is valid."""
    cfg = CONFIGS[config]
    node, notes = schema_tree(schema, cfg)
    assert [n.keyword for n in notes] == ["uniqueItems"]
    dfa = build_dfa(node)
    validator = jsonschema.Draft202012Validator(schema)
    k = len(schema["prefixItems"])
    for instance in _arrays():
        text = json.dumps(instance, separators=(",", ":"))
        accepted, valid = dfa.fullmatch(text.encode()), validator.is_valid(instance)
        if config == "default":
            assert valid or not accepted, text
        elif valid:
            assert accepted, text
        elif accepted:
            head = instance[:k]
            assert jsonschema.Draft202012Validator({"uniqueItems": True}).is_valid(head), text
            assert jsonschema.Draft202012Validator({**schema, "uniqueItems": False}).is_valid(instance), text


_META_URIS = ["http://json-schema.org/draft-04/schema", "http://json-schema.org/draft-07/schema"]


@pytest.mark.parametrize("uri", _META_URIS)
@pytest.mark.parametrize("pointer", sorted(META_FRAGMENTS))
def test_meta_schema_fragments_agree_with_the_published_meta_schemas(uri: str, pointer: str) -> None:
    """A `$ref` into a meta-schema (swagger-2.0's `.../draft-04/schema#/properties/title`) compiles
    that part of the meta-schema, which `jsonschema` resolves from its own copy: an instance is
    accepted exactly when valid (a reported narrowing: only valid instances are accepted)."""
    import referencing.exceptions

    schema = {"$ref": f"{uri}#{pointer}"}
    validator = jsonschema.validators.validator_for({"$schema": f"{uri}#"})(schema)
    try:
        validator.is_valid(None)
    except referencing.exceptions.Unresolvable:
        pytest.skip(f"{pointer} is not part of {uri}")
    node, notes = schema_tree(schema, CONFIGS["default"])
    dfa = build_dfa(node)
    for instance in [*SCALARS, *_arrays()[:60], {}, {"a": 1}, 0.5, -1, ["a", "a"], ["string", "null"], ["x"]]:
        valid = validator.is_valid(instance)
        text = json.dumps(instance, separators=(",", ":"))
        if dfa.fullmatch(text.encode()):
            assert valid, (pointer, text)
        elif valid and not notes and not (isinstance(instance, float) and instance.is_integer()):
            raise AssertionError(f"{pointer}: false reject of {text}")


def test_a_pointer_through_empty_keys_resolves() -> None:
    """JSON pointers name the key "" by an empty segment (`#/$defs//$defs/`); a trailing slash
    written in the wild (`#/$defs/a/`, not a pointer `jsonschema` resolves) still reads `#/$defs/a`."""
    schema = {"$defs": {"": {"$defs": {"": {"type": "number"}}}, "a": {"type": "string"}},
              "properties": {"n": {"$ref": "#/$defs//$defs/"}, "s": {"$ref": "#/$defs/a"}}, "type": "object"}
    sloppy = {**schema, "properties": {**schema["properties"], "s": {"$ref": "#/$defs/a/"}}}
    dfa, dfa_sloppy = (build_dfa(schema_tree(s, CONFIGS["default"])[0]) for s in (schema, sloppy))
    validator = jsonschema.Draft202012Validator(schema)
    for instance in [{"n": 1}, {"n": "x"}, {"s": "x"}, {"s": 1}, {"n": 1, "s": "x"}]:
        text = json.dumps(instance, separators=(",", ":")).encode()
        assert dfa.fullmatch(text) == dfa_sloppy.fullmatch(text) == validator.is_valid(instance), instance
