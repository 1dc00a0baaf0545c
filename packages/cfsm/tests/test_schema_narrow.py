"""Narrowings (`CfsmConfig.narrow`, the default): where a keyword cannot be compiled exactly, the
default config compiles a subset of its language, reported as an `Approximation` of kind
"subset", while `CfsmConfig.spec()` keeps the superset (kind "superset") and strict mode refuses.

The oracle is `jsonschema` (draft 2020-12): every short member of the compiled language (all
of them up to a length, breadth-first over a small alphabet) and every accepted instance of a
finite universe must be valid; a typical valid instance the narrowing keeps is accepted.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cfsm
from cfsm.automata.automaton import Dfa, build_dfa
from cfsm.regex.syntax import Node
from cfsm.schema.json_schema import schema_grammar, schema_tree
from cfsm.schema.merge import MAX_MERGED_ALTERNATIVES, finite_values, implies, is_empty, merge_schemas
from cfsm.schema.narrow import negation_subset, prefer_declared
from cfsm.testing import accepts_bytes

# bytes of short JSON texts: structure, digits, a few letters, the literals' letters
ALPHABET = sorted(set(b'[]{}",:-.012ab') | set(b"truefalsn"))
MAX_VISITS = 10_000
MAX_LENGTH = 16

ITEMS: list[Any] = [1, 2, 1.0, 2.5, "a", "b", True, False, None, {}, {"a": 1}, [], [1]]


def _universe() -> list[Any]:
    arrays = [list(p) for n in range(4) for p in itertools.product(ITEMS, repeat=n)]
    objects = [{k: v for k, v in zip(keys, values, strict=True)} for n in range(3)
               for keys in itertools.permutations(["a", "b", "foo"], n) for values in itertools.product([1, "a", []], repeat=n)]
    return [*ITEMS, *arrays, *objects, 35, 3, 4.5, -3]


UNIVERSE = _universe()


def _members(dfa: Dfa, max_visits: int = 0) -> list[bytes]:
    """Accepted strings over `ALPHABET`, shortest first: all of them up to the length where the
    breadth-first walk passes `MAX_VISITS` strings (at most `MAX_LENGTH` bytes)."""
    steps = dfa.transitions[:, ALPHABET]  # (num_states + 1, len(ALPHABET))
    out: list[bytes] = []
    level: list[tuple[int, bytes]] = [(dfa.start, b"")]
    visited = 0
    while level and visited < (max_visits or MAX_VISITS):
        nxt_level: list[tuple[int, bytes]] = []
        for state, text in level:
            visited += 1
            if dfa.accepting[state]:
                out.append(text)
            if len(text) < MAX_LENGTH:
                nxt_level += [(int(q), text + bytes([ALPHABET[i]])) for i, q in enumerate(steps[state]) if q != dfa.dead]
        level = nxt_level
    return out


def _compile(schema: Any, config: cfsm.CfsmConfig) -> tuple[Dfa, tuple[cfsm.Approximation, ...]]:
    node, approximations = schema_tree(schema, config)
    return build_dfa(node), approximations


def _valid(schema: Any, instance: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


BYTES = cfsm.Vocabulary([bytes([b]) for b in range(128)] + [b""], eos_token_ids=[128])  # token id = byte, EOS 128
NARROW = cfsm.CfsmConfig(whitespace="compact", recursion="unroll", json_depth=2)

# (name, schema, keyword narrowed, an instance the narrowing keeps)
CASES: list[tuple[str, Any, str, Any]] = [
    ("uniqueItems over free items", {"uniqueItems": True}, "uniqueItems", [1, "a", {}, [], True, None]),
    ("uniqueItems over strings", {"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems",
     ["a"]),
    ("uniqueItems over objects", {"type": "array", "items": {"type": "object"}, "uniqueItems": True,
                                  "minItems": 1}, "uniqueItems", [{"a": 1}]),
    ("uniqueItems after boolean prefix items", {"prefixItems": [{"type": "boolean"}, {"type": "boolean"}],
                                                "uniqueItems": True}, "uniqueItems", [True]),
    ("uniqueItems over numbers or strings, maxItems", {"type": "array", "items": {"type": ["number", "string"]},
                                                       "uniqueItems": True, "maxItems": 3}, "uniqueItems", [1.5, "b"]),
    ("not of an object schema", {"not": {"type": "object", "properties": {"foo": {"type": "string"}}}}, "not",
     {"foo": 1}),
    ("not of properties without type", {"not": {"properties": {"a": {"type": "integer"}}, "required": ["b"]}},
     "not", {"a": "a"}),
    ("if without a simple negation", {"type": "object", "properties": {"a": {}, "b": {}},
                                      "if": {"properties": {"a": {"const": 1}}},
                                      "then": {"required": ["b"]}, "else": {"properties": {"b": {"type": "array"}}}},
     "if", {"a": 2, "b": []}),
    ("oneOf of overlapping branches", {"oneOf": [{"type": "integer"}, {"minimum": 2}]}, "oneOf", 1),
    ("oneOf of objects", {"type": "object", "properties": {"a": {}, "b": {}},
                          "oneOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "string"}}}]},
     "oneOf", {"a": 1, "b": 1}),
    ("multipleOf 1.5", {"multipleOf": 1.5}, "multipleOf", 3),
    ("dependentSchemas beside additionalProperties", {"properties": {"foo": {}, "bar": {}},
                                                      "dependentSchemas": {"foo": {"properties": {"bar": {}},
                                                                                   "additionalProperties": False}}},
     "dependentSchemas", {"bar": 1}),
    ("meta-schema reference", {"$ref": "https://json-schema.org/draft/2020-12/schema"}, "$ref", {}),
    ("dynamicRef with several anchors", {
        "$id": "https://example.com/root", "$ref": "list", "$defs": {
            "list": {"$id": "list", "type": "array", "items": {"$dynamicRef": "#item"},
                     "$defs": {"item": {"$dynamicAnchor": "item", "type": ["string", "number"]}}},
            "other": {"$id": "other", "$defs": {"item": {"$dynamicAnchor": "item", "type": "string"}}}}},
     "$dynamicRef", ["a"]),
]


@pytest.mark.parametrize(("name", "schema", "keyword", "kept"), CASES, ids=[c[0] for c in CASES])
def test_narrowed_language_is_valid(name: str, schema: Any, keyword: str, kept: Any) -> None:
    dfa, approximations = _compile(schema, NARROW)
    kinds = {a.kind for a in approximations if a.keyword == keyword}
    assert kinds == {"subset"}, approximations
    assert all(a.kind == "subset" for a in approximations), approximations
    members = _members(dfa)
    assert members, "the narrowed language has short members"
    for text in members:
        assert _valid(schema, json.loads(text)), text
    for instance in UNIVERSE:
        if dfa.fullmatch(json.dumps(instance, separators=(",", ":")).encode()):
            assert _valid(schema, instance), instance
    assert _valid(schema, kept)
    assert dfa.fullmatch(json.dumps(kept, separators=(",", ":")).encode()), kept


@pytest.mark.parametrize(("name", "schema", "keyword", "kept"), CASES, ids=[c[0] for c in CASES])
def test_spec_keeps_the_superset_and_strict_refuses(name: str, schema: Any, keyword: str, kept: Any) -> None:
    dfa, approximations = _compile(schema, cfsm.CfsmConfig.spec(whitespace="compact", recursion="unroll",
                                                                  json_depth=2))
    assert {a.kind for a in approximations if a.keyword == keyword} == {"superset"}, approximations
    for instance in UNIVERSE:
        # NOTE: objects of one member: an undeclared member before a declared one is a known spec-mode limit
        if _valid(schema, instance) and not (isinstance(instance, dict) and len(instance) > 1):
            assert dfa.fullmatch(json.dumps(instance, separators=(",", ":")).encode()), instance
    with pytest.raises(cfsm.UnsupportedSchemaError) as err:
        _compile(schema, cfsm.CfsmConfig(strict=True, recursion="unroll", json_depth=2))
    assert err.value.keyword == keyword


def test_narrowing_is_reported_in_the_index() -> None:
    index = cfsm.compile_json_schema({"uniqueItems": True}, BYTES, cfsm.CfsmConfig(whitespace="compact"))
    assert accepts_bytes(index, '[1,"a"]', 128) and not accepts_bytes(index, "[1,2]", 128)
    (note,) = [a for a in index.approximations if a.keyword == "uniqueItems"]
    assert note.kind == "subset" and str(note).startswith("uniqueItems at #/uniqueItems: narrowed: ")


# ---- property test: random schemas that need narrowings -------------------------------------------------------------

_LEAVES = st.sampled_from([
    {"type": "integer"}, {"type": "string"}, {"type": "object"}, {"type": ["string", "null"]}, {"minimum": 2},
    {"maxLength": 1}, {"const": 1}, {"enum": ["a", None]}, {"required": ["a"]}, True, False,
    {"type": "object", "properties": {"a": {"type": "integer"}}}, {"properties": {"a": {"const": "a"}}},
    {"type": "array", "items": {"type": "integer"}}, {"not": {"type": "integer"}}, {"required": ["b"]},
    {"properties": {"b": {"type": "string"}}}, {"prefixItems": [True, {"const": 1}]},
])


def _combined(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        inner.map(lambda s: {"not": s}),
        st.tuples(inner, inner, inner).map(lambda t: {"if": t[0], "then": t[1], "else": t[2]}),
        st.lists(inner, min_size=2, max_size=3).map(lambda b: {"oneOf": b}),
        inner.map(lambda s: {"type": "array", "items": s, "uniqueItems": True, "maxItems": 3}),
        st.tuples(inner, inner).map(lambda t: {"allOf": [t[0], {"not": t[1]}]}),
        st.tuples(inner, inner).map(lambda t: {"type": "object", "properties": {"a": {}}, "allOf": [t[0]],
                                               "not": t[1], "unevaluatedProperties": False}),
        inner.map(lambda s: {"prefixItems": [{"type": "integer"}], "not": {"not": s}, "unevaluatedItems": False}),
        st.tuples(inner, inner).map(lambda t: {"type": "object", "properties": {"a": t[0], "b": {}},
                                               "dependentSchemas": {"a": {"properties": {"b": t[1]},
                                                                          "additionalProperties": False}}}),
    )


_SCHEMAS = st.recursive(_LEAVES, _combined, max_leaves=4)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_SCHEMAS)
def test_random_narrowed_schemas_accept_only_valid_documents(schema: Any) -> None:
    _check_narrowed(schema)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_SCHEMAS)
def test_random_narrowed_schemas_accept_only_valid_documents_more(schema: Any) -> None:
    _check_narrowed(schema)


def _check_narrowed(schema: Any) -> None:
    """Every short member of the narrowed language, and every accepted universe instance, is valid."""
    try:
        dfa, approximations = _compile(schema, NARROW)
    except cfsm.UnsupportedSchemaError as err:
        assert "accepts no string" in str(err), err  # a narrowing may leave no document at all
        return
    except cfsm.GrammarTooLargeError:
        # NOTE: a random schema may exceed the DFA budget (e.g. uniqueItems over 3 items of any JSON): a clear
        # refusal, not an accepted invalid document, which is what this property is about
        return
    if any(a.kind == "superset" for a in approximations):
        return  # NOTE: a reported superset (a `oneOf` whose narrowing would be empty, ...)
    for text in _members(dfa, max_visits=3000):
        assert _valid(schema, json.loads(text)), (schema, text)
    for instance in UNIVERSE:
        if dfa.fullmatch(json.dumps(instance, separators=(",", ":")).encode()):
            assert _valid(schema, instance), (schema, instance)


def test_a_narrowing_that_leaves_no_document_compiles_the_superset() -> None:
    """`not` of patternProperties narrows to the non-objects, which the `enum` rules out: the
    compile falls back to the reported superset instead of refusing a schema with valid documents."""
    schema = {"allOf": [{"enum": [{"a": "bar"}]},
                        {"not": {"patternProperties": {"a*": {"type": "integer"}, "aaa*": {"maximum": 20}}}}]}
    assert _valid(schema, {"a": "bar"})
    assert build_dfa(schema_tree(schema, NARROW)[0]).num_states == 0
    index = cfsm.compile_json_schema(schema, BYTES, cfsm.CfsmConfig(whitespace="compact"))
    assert {a.kind for a in index.approximations} == {"superset"}, index.approximations
    assert accepts_bytes(index, '{"a":"bar"}', 128)


def test_a_double_negation_does_not_evaluate_properties() -> None:
    """`not: {not: x}` is x, except that x's evaluated properties do not count for
    `unevaluatedProperties` (test-suite case): the narrowing must not accept `bar`."""
    schema = {"type": "object", "properties": {"foo": {"type": "string"}},
              "not": {"not": {"properties": {"bar": {"const": "bar"}}, "required": ["bar"]}},
              "unevaluatedProperties": False}
    assert not _valid(schema, {"foo": "foo", "bar": "bar"})
    dfa, _ = _compile(schema, NARROW)
    assert not dfa.fullmatch(b'{"foo":"foo","bar":"bar"}')


# ---- allOf merges of anyOf / oneOf lists (`cfsm.schema.merge`) -----------------------------------------------------
# distributed only as far as needed, the product bounded (defaults: a subset; spec: a superset), and the tests that
# prune it (`implies`, `is_empty`, `finite_values`) sound against the validator. The blow-up itself (a narrowed
# `oneOf` whose negated branches multiplied under `allOf`: 4^(n-1) alternatives per branch) is caught by the size of
# the syntax tree, which must grow linearly with the number of branches.

MERGE_SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
SPEC = cfsm.CfsmConfig.spec(whitespace="compact", recursion="unroll", json_depth=2)
# strings the universe adds for `pattern` / `const` checks
WORDS = ["a", "b", "ab", "BLANK", "STRING", "a\n"]
INSTANCES: list[Any] = [*UNIVERSE, *WORDS, {"a": "a"}, {"a": "BLANK"}, {"a": "STRING", "b": 1}, {"b": "a"}]


def _tree_size(node: Node) -> int:
    """Distinct nodes of a syntax tree (shared subtrees once)."""
    seen: set[int] = set()
    stack: list[Any] = [node]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        for value in vars(item).values() if hasattr(item, "__dict__") else \
                (getattr(item, slot) for slot in getattr(type(item), "__slots__", ())):
            if isinstance(value, Node):
                stack.append(value)
            elif isinstance(value, tuple | list):
                stack.extend(v for v in value if isinstance(v, Node))
    return len(seen)


# ---- implies / is_empty / finite_values against the validator -----------------------------------------------------

_LEAVES = st.sampled_from([
    True, False, {}, {"type": "object"}, {"type": "string"}, {"type": ["string", "null"]}, {"type": "integer"},
    {"type": "number"}, {"const": "a"}, {"enum": ["a", "b", 1]}, {"enum": [1.0, None]}, {"required": ["a"]},
    {"required": ["a", "b"]}, {"not": {"enum": ["a"]}}, {"not": {"type": "string"}}, {"not": {"type": "integer"}},
    {"pattern": "^(a|b)$"}, {"type": "string", "pattern": "^BLANK$"}, {"type": "string", "pattern": "^(a|ab)$"},
    {"pattern": "^a|b$"}, {"minLength": 2}, {"maxLength": 1}, {"minProperties": 2}, {"maxProperties": 0},
    {"additionalProperties": False}, {"properties": {"a": False}}, {"minimum": 2}, {"exclusiveMaximum": 2},
    {"maximum": 1}, {"type": "number", "exclusiveMinimum": 1},
])


def _schemas(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2).map(lambda p: {"properties": p}),
        st.tuples(inner, inner).map(lambda t: {"allOf": list(t)}),
        st.lists(inner, min_size=1, max_size=3).map(lambda parts: {"anyOf": parts}),
        st.tuples(inner, inner).map(lambda t: {**t[0], **t[1]} if isinstance(t[0], dict) and isinstance(t[1], dict)
                                    else t[0]),
    )


_SCHEMAS = st.recursive(_LEAVES, _schemas, max_leaves=5)


@MERGE_SETTINGS
@given(_SCHEMAS, _SCHEMAS)
def test_implies_is_sound(a: Any, b: Any) -> None:
    if implies(a, b):
        for instance in INSTANCES:
            if _valid(a, instance):
                assert _valid(b, instance), (a, b, instance)


@MERGE_SETTINGS
@given(_SCHEMAS)
def test_is_empty_and_finite_values_are_sound(schema: Any) -> None:
    if is_empty(schema):
        assert not any(_valid(schema, x) for x in INSTANCES), schema
    values = finite_values(schema)
    if values is not None:
        for instance in INSTANCES:
            if _valid(schema, instance):
                assert any(instance == v and type(instance) is type(v) or
                           isinstance(instance, int | float) and not isinstance(instance, bool) and instance == v
                           for v in values), (schema, values, instance)


@MERGE_SETTINGS
@given(_SCHEMAS, st.sampled_from([{"type": "object", "properties": {"a": {}}}, {"properties": {"b": {"type": "string"}}},
                                  {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"]}]))
def test_prefer_declared_keeps_a_subset_of_the_negation(negated: Any, branch: Any) -> None:
    subset = prefer_declared(negation_subset(negated), branch)
    for instance in INSTANCES:
        if _valid({"allOf": [branch, subset]}, instance):
            assert not _valid(negated, instance), (negated, subset, instance)


def test_implies_and_is_empty_find_the_discriminated_cases() -> None:
    """What the pruning relies on (so that the tests above do not pass by always saying no)."""
    branch = {"type": "object", "required": ["kind"], "properties": {"kind": {"type": "string", "enum": ["A"]}}}
    assert implies(branch, {"type": "object", "required": ["kind"], "properties": {"kind": {"not": {"enum": ["B"]}}}})
    assert implies(branch, {"anyOf": [{"type": "array"}, {"required": ["kind"]}]})
    assert not implies(branch, {"required": ["other"]})
    assert is_empty({"allOf": [branch, {"type": ["array", "string"]}]})
    assert is_empty({"type": "object", "required": ["kind"],
                     "properties": {"kind": {"allOf": [{"type": "string", "pattern": "^BLANK$"}, {"const": "STRING"}]}}})
    assert not is_empty({"properties": {"kind": False}, "required": ["kind"]})  # non-objects are valid
    assert finite_values({"type": "string", "pattern": "^(A|B)$"}) == ["A", "A\n", "B", "B\n"]
    assert finite_values({"type": "string", "pattern": "^A|B$"}) is None
    assert is_empty({"type": "string", "enum": ["A", "B"], "not": {"enum": ["A", "B"]}})
    assert is_empty({"type": "number", "minimum": 0, "maximum": 12, "anyOf": [{"exclusiveMinimum": 12},
                                                                            {"exclusiveMaximum": 0}]})


# ---- merged products -----------------------------------------------------------------------------------------------

def _anyof_product(lists: int) -> dict[str, Any]:
    """`lists` anyOf lists of three alternatives under allOf, none prunable: 3^lists combinations."""
    return {"type": "object", "properties": {"a": {}, "b": {}},
            "allOf": [{"anyOf": [{"required": ["a"]}, {"required": ["b"]}, {"maxProperties": i}]}
                      for i in range(lists)]}


def test_the_product_is_cut_to_a_subset_with_the_defaults() -> None:
    schema = _anyof_product(4)  # 81 > MAX_MERGED_ALTERNATIVES
    assert MAX_MERGED_ALTERNATIVES < 3 ** 4
    node, approximations = schema_tree(schema, NARROW)
    assert [a.kind for a in approximations if a.keyword == "anyOf"] == ["subset"], approximations
    dfa = build_dfa(node)
    for text in _members(dfa):
        assert _valid(schema, json.loads(text)), text
    for instance in INSTANCES:
        if dfa.fullmatch(json.dumps(instance, separators=(",", ":")).encode()):
            assert _valid(schema, instance), instance
    assert dfa.fullmatch(b'{"a":1}')  # the first alternatives are kept
    with pytest.raises(cfsm.UnsupportedSchemaError):
        schema_tree(schema, cfsm.CfsmConfig(strict=True))


def test_the_product_is_cut_to_a_superset_in_spec_mode() -> None:
    schema = _anyof_product(4)
    node, approximations = schema_tree(schema, SPEC)
    assert [a.kind for a in approximations if a.keyword == "anyOf"] == ["superset"], approximations
    dfa = build_dfa(node)
    for instance in INSTANCES:
        if _valid(schema, instance) and not (isinstance(instance, dict) and len(instance) > 1):
            assert dfa.fullmatch(json.dumps(instance, separators=(",", ":")).encode()), instance


@pytest.mark.parametrize("lists", [1, 2, 3])
def test_small_products_stay_exact(lists: int) -> None:
    schema = _anyof_product(lists)
    for config in (NARROW, SPEC):
        node, approximations = schema_tree(schema, config)
        assert not [a for a in approximations if a.keyword == "anyOf"], approximations
        dfa = build_dfa(node)
        for instance in INSTANCES:
            text = json.dumps(instance, separators=(",", ":")).encode()
            if isinstance(instance, dict) and list(instance) not in ([], ["a"], ["b"], ["a", "b"]):
                continue  # NOTE: the defaults keep properties in schema order and no undeclared ones
            assert dfa.fullmatch(text) == _valid(schema, instance), (config, instance)


def test_merge_drops_alternatives_the_rest_rules_out_or_implies() -> None:
    notes: list[tuple[str, str, str]] = []
    rest = {"type": "object", "required": ["kind"], "properties": {"kind": {"enum": ["A"]}}}
    negated_b = {"anyOf": [{"type": ["array", "string", "number", "boolean", "null"]},
                           {"type": "object", "required": ["kind"], "properties": {"kind": {"not": {"enum": ["B"]}}}}]}
    assert "anyOf" not in merge_schemas(rest, negated_b, "#", lambda *n: notes.append(n))  # implied: dropped
    other = {"anyOf": [{"type": "string"}, {"required": ["x"]}, {"required": ["y"]}]}
    assert merge_schemas(rest, other, "#", lambda *n: notes.append(n))["anyOf"] == other["anyOf"][1:]
    assert not notes


def _discriminated(branches: int) -> dict[str, Any]:
    """A union like Azure's linked services: the discriminator `kind` is required beside the
    `oneOf`, each branch names it without requiring it."""
    return {
        "type": "object", "required": ["kind", "body"],
        "allOf": [{"properties": {"note": {"type": "string"}}},
                  {"oneOf": [{"$ref": f"#/$defs/b{i}"} for i in range(branches)]}],
        "$defs": {f"b{i}": {"type": "object", "properties": {
            "kind": {"type": "string", "enum": [f"k{i}"]},
            "body": {"type": "object", "required": [f"f{i}"], "properties": {f"f{i}": {"type": "integer"}},
                     "additionalProperties": False}}} for i in range(branches)},
    }


def test_a_discriminated_one_of_stays_linear_and_exact() -> None:
    small, large = (_tree_size(schema_grammar(_discriminated(n), NARROW)[0]) for n in (3, 6))
    # NOTE: linear growth; multiplying the negated branches gave 4^(n-1) alternatives per branch
    assert large <= 3 * small, (small, large)
    schema = _discriminated(4)
    node, approximations = schema_tree(schema, NARROW)
    assert not approximations, approximations  # disjoint beside `required`: exact, nothing narrowed
    dfa = build_dfa(node)
    for i in range(4):
        for j in range(4):
            doc = {"kind": f"k{i}", "body": {f"f{j}": 1}}
            assert dfa.fullmatch(json.dumps(doc, separators=(",", ":")).encode()) == _valid(schema, doc) == (i == j)


def test_a_discriminator_by_literal_pattern_is_exact() -> None:
    """tree-sitter's grammar schema: branches told apart by `"pattern": "^BLANK$"`-like literals."""
    schema = {"oneOf": [{"type": "object", "required": ["type"], "properties": {"type": {"type": "string",
                                                                                                 "pattern": f"^{t}$"}}}
                        for t in ("BLANK", "STRING", "(SEQ|CHOICE)")]}
    node, approximations = schema_tree(schema, NARROW)
    assert not approximations, approximations
    dfa = build_dfa(node)
    for value in ("BLANK", "STRING", "SEQ", "CHOICE", "OTHER"):
        doc = {"type": value}
        assert dfa.fullmatch(json.dumps(doc).replace(" ", "").encode()) == _valid(schema, doc)


def test_a_conditional_branch_into_another_resource_resolves_there() -> None:
    """`then` / `else` referencing resources with their own `$id` and a `$dynamicRef`: the narrowed
    `if` compiles each branch under that resource's base (merged with the root, the root's `$id`
    took over and `#item` did not resolve)."""
    schema = {
        "$id": "https://example.com/root",
        "if": {"properties": {"kind": {"const": "n"}}, "required": ["kind"]},
        "then": {"$ref": "numbers"}, "else": {"$ref": "strings"},
        "$defs": {
            "generic": {"$id": "generic", "properties": {"list": {"items": {"$dynamicRef": "#item"}}},
                        "$defs": {"default": {"$dynamicAnchor": "item"}}},
            "numbers": {"$id": "numbers", "$defs": {"item": {"$dynamicAnchor": "item", "type": "number"}},
                        "$ref": "generic"},
            "strings": {"$id": "strings", "$defs": {"item": {"$dynamicAnchor": "item", "type": "string"}},
                        "$ref": "generic"},
        },
    }
    node, approximations = schema_tree(schema, NARROW)
    assert all(a.kind == "subset" for a in approximations), approximations
    dfa = build_dfa(node)
    for doc in ({"kind": "n", "list": [1]}, {"kind": "s", "list": ["a"]}, {"list": ["a"]}, {"kind": "n", "list": ["a"]},
                {"kind": "s", "list": [1]}):
        if dfa.fullmatch(json.dumps(doc, separators=(",", ":")).encode()):
            assert _valid(schema, doc), doc
    # NOTE: every `item` anchor applies at once (the narrowing of `$dynamicRef`): lists stay empty here
    assert dfa.fullmatch(b'{"kind":"n","list":[]}')
    assert dfa.fullmatch(b'{"kind":"s","list":[]}') or dfa.fullmatch(b'{"list":[],"kind":"s"}')
