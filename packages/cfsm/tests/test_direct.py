"""The direct DFA construction (`cfsm.automata.direct`) against the generic one: the very same `Dfa`."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cfsm
from cfsm import CfsmConfig
from cfsm.automata.automaton import Dfa, build_dfa
from cfsm.automata.direct import build_dfa_direct
from cfsm.masks.index import build_index
from cfsm.regex.json_values import format_node
from cfsm.regex.parser import parse_regex
from cfsm.regex.syntax import Chars, Node, Repeat, cat, lit
from cfsm.schema.json_schema import schema_to_node


def _same(a: Dfa, b: Dfa) -> bool:
    return (np.array_equal(a.transitions, b.transitions) and np.array_equal(a.accepting, b.accepting)
            and a.start == b.start and all(np.array_equal(x, y) for x, y in zip(a.byte_classes, b.byte_classes, strict=True)))


_VALUES: list[dict[str, Any]] = [
    {"type": "string"},
    {"type": "string", "maxLength": 9},
    {"type": "string", "minLength": 2, "maxLength": 12},
    {"type": "string", "format": "date"},
    {"type": "string", "pattern": "^[a-c]{2}$"},
    {"type": "integer"},
    {"type": "integer", "minimum": 1, "maximum": 999},
    {"type": "number"},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["alpha", "beta", 3]},
    {"const": "x"},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    {"type": "array", "items": {"type": "string"}},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    {"type": ["string", "null"]},
    {"type": "array", "items": {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]},
     "minItems": 1, "maxItems": 9},
    {"anyOf": [{"type": "object", "properties": {"u": {"type": "boolean"}}}, {"type": "string", "maxLength": 10}]},
    {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "integer"}}, "additionalProperties": False},
    {"type": "object", "additionalProperties": {"type": "string", "maxLength": 8}, "maxProperties": 2},
    {"type": "string", "pattern": "ab+"},
    {"type": "string", "format": "email"},
    {"type": "string", "minLength": 8},
    {"enum": []},
    {"type": "string", "minLength": 3, "maxLength": 2},
    {"type": "string", "minLength": 12, "maxLength": 9},
]


@st.composite
def _objects(draw: st.DrawFn, depth: int = 2) -> dict[str, Any]:
    n = draw(st.integers(1, 5))
    props: dict[str, Any] = {}
    for i in range(n):
        if depth > 0 and draw(st.integers(0, 4)) == 0:
            props[f"k{i}"] = draw(_objects(depth - 1))
        else:
            props[f"k{i}"] = draw(st.sampled_from(_VALUES))
    names = list(props)
    required = draw(st.sampled_from([names, names[: len(names) // 2], []]))
    schema: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    schema["additionalProperties"] = draw(st.sampled_from([False, False, False, {"type": "integer"}, True]))
    return schema


@st.composite
def _schemas(draw: st.DrawFn) -> dict[str, Any]:
    # repeated sections (as in a real document) make the direct construction worth taking
    section = draw(_objects())
    prefixes = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4, unique=True))
    props = {p: {**section, "properties": {f"{p}{k}": v for k, v in section["properties"].items()},
                 "required": [f"{p}{k}" for k in section["required"]]} for p in prefixes}
    return {"type": "object", "properties": props, "required": prefixes[: draw(st.integers(0, len(prefixes)))],
            "additionalProperties": False}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_schemas(), st.sampled_from(["compact", "flexible"]))
def test_direct_dfa_is_the_generic_dfa(schema: dict[str, Any], whitespace: str) -> None:
    node = schema_to_node(schema, CfsmConfig(whitespace=whitespace))
    direct = build_dfa_direct(node, force=True)
    if direct is not None:
        assert _same(direct, build_dfa(node))


def _sections(n: int) -> dict[str, Any]:
    section = {"type": "object", "additionalProperties": False,
               "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 1000},
                              "label": {"type": "string", "maxLength": 20},
                              "kind": {"enum": ["alpha", "beta"]}, "ratio": {"type": "number"},
                              "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
               "required": ["id", "label", "kind", "ratio", "tags"]}
    return {"type": "object", "properties": {f"s{i}": section for i in range(n)},
            "required": [f"s{i}" for i in range(n)], "additionalProperties": False}


def test_repeated_sections_take_the_direct_path_and_give_the_same_index() -> None:
    vocab = cfsm.Vocabulary([b"", b'{"', b"s0", b"s1", b"s2", b'":{"', b"id", b"label", b'":', b"1", b"12", b",",
                             b'"', b"a", b"ab", b"alpha", b"beta", b"[", b"]", b"}", b".", b"-", b"e", b'","'],
                            eos_token_ids=[0])
    node = schema_to_node(_sections(3), CfsmConfig())
    direct = build_dfa_direct(node)
    assert direct is not None
    generic = build_dfa(node)
    assert _same(direct, generic)
    a, b = build_index(direct, vocab, grammar="x"), build_index(generic, vocab, grammar="x")
    assert np.array_equal(a.masks, b.masks) and np.array_equal(a.mask_row, b.mask_row)
    compiled = cfsm.compile_json_schema(_sections(3), vocab)
    assert np.array_equal(compiled.masks, b.masks) and np.array_equal(compiled.mask_row, b.mask_row)


def test_an_empty_language_gives_the_empty_dfa() -> None:
    for value in ({"enum": []}, {"type": "integer", "minimum": 5, "maximum": 2}):
        schema = {"type": "object", "properties": {"a": value, "b": {"type": "string", "maxLength": 9}},
                  "required": ["a", "b"]}
        node = schema_to_node(schema, CfsmConfig())
        direct = build_dfa_direct(node, force=True)
        assert direct is not None and direct.num_states == 0 and _same(direct, build_dfa(node))


@pytest.mark.parametrize("lo, hi", [(0, 8), (3, 9), (9, 9), (12, 9), (0, None), (1, None), (9, None), (0, 0)])
@pytest.mark.parametrize("unit", [lit("ab"), cat(lit("a"), Repeat(lit("b"), 0, 1), lit("c")), Chars(((0x41, 0x5A), (0xE9, 0xE9)))])
def test_counted_blocks(unit: Node, lo: int, hi: int | None) -> None:
    node = cat(lit("x"), Repeat(unit, lo, hi), lit("y"))
    direct = build_dfa_direct(node, force=True)
    assert direct is not None and _same(direct, build_dfa(node))


def test_pieces_that_overlap_their_continuation_fall_back() -> None:
    # a piece's end reads the byte its continuation starts with (a+ then a); flexible whitespace
    # runs are loop states (test_whitespace_runs.py)
    node = cat(lit("x"), Repeat(lit("a"), 1, None), lit("a"))
    assert build_dfa_direct(node, force=True) is None


_ATOMS = ["a", "b", "[ab]", "[^a]", "\\d", ".", "é", "😀", "-", "ab", "\\s"]


@st.composite
def _patterns(draw: st.DrawFn, depth: int = 0) -> str:
    kind = draw(st.integers(0, 3 if depth < 3 else 0))
    if kind == 0:
        return draw(st.sampled_from(_ATOMS))
    if kind == 1:
        return "".join(draw(st.lists(_patterns(depth + 1), min_size=1, max_size=4)))
    if kind == 2:
        return "(" + "|".join(draw(st.lists(_patterns(depth + 1), min_size=2, max_size=3))) + ")"
    return "(?:" + draw(_patterns(depth + 1)) + ")" + draw(st.sampled_from(["*", "+", "?", "{2}", "{1,9}", "{8,}"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_patterns())
def test_direct_dfa_is_the_generic_dfa_on_regex_trees(pattern: str) -> None:
    # concatenations of literals and blocks with every kind of overlap between a piece's end and
    # what follows it (the direct construction must then decline)
    node = parse_regex(pattern)
    direct = build_dfa_direct(node, force=True)
    if direct is not None:
        assert _same(direct, build_dfa(node))


def test_prepared_blocks_are_the_blocks_built_at_compile_time() -> None:
    """`prepare_blocks` holds, for every per-process value tree, the very block `Block` builds."""
    import cfsm.automata.direct as direct

    direct.prepare_blocks()
    assert len(direct.PREPARED) >= 8
    for node, blk in direct.PREPARED.values():
        fresh = direct.Block(node)
        for name in direct.Block.__slots__:
            a, b = getattr(blk, name), getattr(fresh, name)
            if name in ("fragment", "string_facts", "fragment_facts") and a is not None:
                assert b is not None and len(a) == len(b), name
                assert all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
                           for x, y in zip(a, b, strict=True)), name
                continue
            assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, name


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_schemas(), st.sampled_from(["compact", "flexible"]))
def test_direct_dfa_with_and_without_prepared_blocks(schema: dict[str, Any], whitespace: str) -> None:
    import cfsm.automata.direct as direct

    direct.prepare_blocks()
    node = schema_to_node(schema, CfsmConfig(whitespace=whitespace))
    with_prepared = build_dfa_direct(node, force=True)
    saved = dict(direct.PREPARED)
    direct.PREPARED.clear()
    try:
        without = build_dfa_direct(node, force=True)
    finally:
        direct.PREPARED.update(saved)
    assert (with_prepared is None) == (without is None)
    if with_prepared is not None and without is not None:
        assert _same(with_prepared, without)


def _built(node: Node) -> Any:
    """(builder, start, table, byte_map, accepting, shortest lengths) of the direct construction,
    or None where it declines."""
    import cfsm.automata.direct as direct

    b = direct._Builder()
    try:
        final = b.final()
        start = b.build(node, final)
        table, byte_map = b.table()
    except direct.Fallback:
        return None
    acc, dist = b.arrays()
    return b, start, table, byte_map, acc, dist


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    pairs = np.unique(np.column_stack([a, b]), axis=0)
    return len(pairs) == len(np.unique(a)) == len(np.unique(b))


def _refined(table: np.ndarray, acc: np.ndarray, dist: np.ndarray) -> np.ndarray:
    from cfsm.automata.automaton import refine

    live = dist >= 0
    return refine(table, np.where(live, (acc.astype(np.int64) + 1) * (int(dist.max()) + 2) + dist + 1, 0))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_schemas(), st.sampled_from(["compact", "flexible"]))
def test_structural_classes_are_the_refined_partition(schema: dict[str, Any], whitespace: str) -> None:
    """Where `_Builder.classes` answers, its partition of the direct table is the coarsest one
    (the refinement's), unreachable states included; where it declines, the DFA is still the same."""
    _check_structural_classes(schema_to_node(schema, CfsmConfig(whitespace=whitespace)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_patterns())
def test_structural_classes_on_regex_trees(pattern: str) -> None:
    _check_structural_classes(parse_regex(pattern))


def _check_structural_classes(node: Any) -> None:
    built = _built(node)
    if built is None:
        return
    b, _, table, _, acc, dist = built
    cls = b.classes(table, acc, dist)
    if cls is not None:
        assert _same_partition(cls, _refined(table, acc, dist))


def test_structural_classes_take_repeated_sections_and_decline_the_email_loop() -> None:
    built = _built(schema_to_node(_sections(4), CfsmConfig()))
    assert built is not None
    b, _, table, _, acc, dist = built
    cls = b.classes(table, acc, dist)
    assert cls is not None and _same_partition(cls, _refined(table, acc, dist))
    # a schema's email format is one prepared block (`json_schema.piece`): proven
    schema = {"type": "object", "properties": {"e": {"type": "string", "format": "email"}}, "required": ["e"]}
    node = schema_to_node(schema, CfsmConfig())
    built = _built(node)
    assert built is not None
    b, _, table, _, acc, dist = built
    cls = b.classes(table, acc, dist)
    assert cls is not None and _same_partition(cls, _refined(table, acc, dist))
    # the email tree itself, piece by piece: a block (atext+) whose loop the next one ("." atext+)*
    # repeats is not proven apart
    node = cat(lit('{"e":"'), format_node("email"), lit('"}'))
    built = _built(node)
    assert built is not None
    b, _, table, _, acc, dist = built
    assert b.classes(table, acc, dist) is None
    direct = build_dfa_direct(node, force=True)
    assert direct is not None and _same(direct, build_dfa(node))


@pytest.mark.parametrize("lo, hi", [(0, 8), (3, 9), (9, 9), (0, None), (1, None), (2, None), (9, None), (12, None)])
@pytest.mark.parametrize("unit", [lit("ab"), cat(lit("a"), Repeat(lit("b"), 0, 1), lit("c")), Chars(((0x41, 0x5A), (0xE9, 0xE9)))])
def test_counted_block_classes_are_its_own_minimal_classes(unit: Node, lo: int, hi: int | None) -> None:
    import cfsm.automata.block_facts as facts
    import cfsm.automata.direct as direct

    node = Repeat(unit, lo, hi)
    blk = direct.Block(node)
    acc = np.zeros(blk.size, dtype=bool)
    acc[blk.accepting] = True
    assert _same_partition(blk.classes, facts.own_classes(blk.rows, acc, blk.dist))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_patterns())
def test_small_block_facts_are_the_numpy_ones(pattern: str) -> None:
    """`facts_small` (plain Python, small blocks) gives what the numpy path gives."""
    import cfsm.automata.block_facts as facts
    import cfsm.automata.direct as direct

    node = parse_regex(pattern)
    try:
        blk = direct.Block(node)
    except direct.Fallback:
        return
    t, dist = blk.rows, blk.dist
    acc = np.zeros(blk.size, dtype=bool)
    acc[blk.accepting] = True
    classes, live = facts.facts_small(t, acc, dist, blk.col_of)
    assert _same_partition(classes, facts.own_classes(t, acc, dist))
    assert np.array_equal(classes < 0, dist < 0)
    assert np.array_equal(live, facts.live_bytes(t, classes, blk.col_of))


_STRING_VOCAB = cfsm.Vocabulary([b"", b'"', b'",', b'"}', b"a", b"ab", b"abc", b"\\", b'\\"', b"\\u00", b"1f", b"\xc3",
                                 b"\xa9", b"\xc3\xa9", b"x", b"xy", b'x"', b":", b'":', b'":"', b"{", b"}", b",", b" "],
                                eos_token_ids=[0])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_schemas())
def test_proven_string_states_match_as_the_verification_does(schema: dict[str, Any]) -> None:
    """The string text states the direct construction proves (`DirectFacts.string_text`, left out of
    the verification) are matched with the very bounds and continuations as when checked."""
    from cfsm.masks.templates import match_string_states

    direct = build_dfa_direct(schema_to_node(schema, CfsmConfig()), force=True)
    if direct is None or direct.facts is None or direct.facts.string_text is None:
        return
    st_ = _STRING_VOCAB.prepare().string_tables
    proven = match_string_states(direct, st_)
    checked_dfa = Dfa(transitions=direct.transitions, accepting=direct.accepting, start=direct.start)
    checked = match_string_states(checked_dfa, st_)
    for name in ("t", "rem", "need", "cont"):
        assert np.array_equal(getattr(proven, name), getattr(checked, name)), name
    # every proven state is marked: it passed the checks it was spared
    marked = checked.t[: direct.num_states] >= 0
    assert marked[direct.facts.string_text[0][:-1]].all()


def test_bounded_and_free_string_bodies_are_proven() -> None:
    dfa = build_dfa_direct(schema_to_node(_sections(3), CfsmConfig()))
    assert dfa is not None and dfa.facts is not None and dfa.facts.string_text is not None
    proven = dfa.facts.string_text[0]
    assert proven.sum() >= 3 * 21  # the three label strings (maxLength 20), at least


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_schemas(), st.sampled_from(["compact", "flexible"]))
def test_fresh_classes_are_the_hash_consed_ones(schema: dict[str, Any], whitespace: str) -> None:
    """`_fresh_classes` (every key new, at once) gives the partition of the hash-consing loop."""
    import cfsm.automata.direct as direct

    built = _built(schema_to_node(schema, CfsmConfig(whitespace=whitespace)))
    if built is None:
        return
    b, _, table, _, acc, dist = built
    if b._fresh_classes() is None:
        return
    fast = b.classes(table, acc, dist)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(direct._Builder, "_fresh_classes", lambda self: None)
        slow = b.classes(table, acc, dist)
    assert (fast is None) == (slow is None)
    if fast is not None and slow is not None:
        assert _same_partition(fast, slow)


_LEADS = ["a", "b", ",", "]", "cb", ",a", "d", "]x", "e", "fg", "h", "i"]


@st.composite
def _choice_trees(draw: st.DrawFn, depth: int = 0) -> Node:
    """Trees of literal-led alternations and short bounded repeats (the direct construction's
    union states, `_Builder._choice`), with blocks and empty strings among them."""
    from cfsm.regex.syntax import EMPTY, Alt

    kind = draw(st.integers(0, 4 if depth < 3 else 1))
    if kind == 0:
        return lit(draw(st.sampled_from(_LEADS)))
    if kind == 1:
        return draw(st.sampled_from([Repeat(Chars(((0x30, 0x39),)), 1, None), Chars(((0x61, 0x62), (0xE9, 0xE9))),
                                     EMPTY, lit("a")]))
    if kind == 2:
        return cat(*draw(st.lists(_choice_trees(depth + 1), min_size=1, max_size=4)))
    if kind == 3:
        return Alt(draw(st.lists(_choice_trees(depth + 1), min_size=2, max_size=3)))
    lo = draw(st.integers(0, 3))
    return Repeat(draw(_choice_trees(depth + 1)), lo, lo + draw(st.integers(0, 4)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_choice_trees(), st.sampled_from(["", "]", "x", ","]))
def test_union_states_give_the_generic_dfa_and_the_refined_partition(tree: Node, after: str) -> None:
    from unittest import mock

    import cfsm.automata.direct as direct

    node = cat(lit("["), tree, lit(after)) if after else cat(lit("["), tree)
    # NOTE: every choice is tried as union states (not only those around prepared blocks)
    with mock.patch.object(direct, "holds_prepared", lambda node, memo: True):
        built = build_dfa_direct(node, force=True)
        if built is not None:
            assert _same(built, build_dfa(node))
        _check_structural_classes(node)


def test_arrays_of_strings_are_union_states_with_proven_string_text() -> None:
    """An array of strings with maxItems: literal states and string-body copies (no block of its
    own), its string states handed to the string tables as proven."""
    import cfsm.automata.direct as direct

    schema = {"type": "object", "properties": {"t": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
              "required": ["t"]}
    node = schema_to_node(schema, CfsmConfig())
    built = _built(node)
    assert built is not None
    b = built[0]
    assert b.multi and all(c[1].string_body for c in b.copies)
    assert not any(isinstance(c[1], direct.Block) and c[1].size > 20 for c in b.copies)
    dfa = build_dfa_direct(node, force=True)
    assert dfa is not None and _same(dfa, build_dfa(node))
    assert dfa.facts is not None and dfa.facts.string_text is not None
    assert int(dfa.facts.string_text[0].sum()) >= 4


_FORMAT_TOKENS = [b"", b"a", b"b", b"@", b".", b"a@", b"b.", b'"', b'",', b'"}', b'a"', b'.a"}', b"x", b"-", b"{",
                  b'"e":"', b'"u":"', b"http", b":", b"/", b"%2", b"0", b"a.b", b'@b.c"', b',"', b"}", b"]", b"[",
                  b'"]', b'"k', b"k", b'":', b"1", b"true", b"null", b"Z", b"?", b"#", b"a-b", b'b"]', b'"e']


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([{"type": "string", "format": "email"}, {"type": "string", "format": "uri"},
                                 {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 2},
                                 {"type": "string"}, {"type": "integer"}]), min_size=1, max_size=4),
       st.sampled_from(["compact", "flexible"]))
def test_proven_format_states_give_the_matched_masks(values: list[dict[str, Any]], whitespace: str) -> None:
    """The direct construction names its email/uri states (`DirectFacts.fragment_states`, from each format
    block's map onto F); the index built from them equals the one that matches F's states."""
    import cfsm.automata.direct as direct

    direct.prepare_blocks()
    vocab = cfsm.Vocabulary(_FORMAT_TOKENS, eos_token_ids=[0])
    schema = {"type": "object", "properties": {f"k{i}": v for i, v in enumerate(values)},
              "required": [f"k{i}" for i in range(len(values))]}
    node = schema_to_node(schema, CfsmConfig(whitespace=whitespace))
    built = build_dfa_direct(node, force=True)
    if built is None or built.facts is None:
        return
    generic = build_dfa(node)
    assert _same(built, generic)
    a, b = build_index(built, vocab, grammar="x"), build_index(generic, vocab, grammar="x")
    assert np.array_equal(a.masks, b.masks) and np.array_equal(a.mask_row, b.mask_row)


def test_format_blocks_map_onto_f() -> None:
    import cfsm.automata.direct as direct
    from cfsm.automata.json_automata import TABLE_FORMATS
    from cfsm.regex.json_values import piece

    direct.prepare_blocks()
    for fmt in TABLE_FORMATS:
        blk = direct.Block(piece(format_node(fmt)))
        assert blk.fragment is not None and blk.fragment[0] == fmt and (blk.fragment[1] >= 0).all()
    assert direct.Block(piece(format_node("date"))).fragment is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(-2000, 2000), st.integers(0, 5000), st.lists(st.text("abc\"", min_size=1, max_size=4), min_size=1,
                                                              max_size=4, unique=True), st.integers(1, 3))
def test_loop_free_literal_pieces_are_literal_states(lo: int, span: int, words: list[str], copies: int) -> None:
    """Integer ranges and enums (loop-free literal trees) become literal and union states once
    (`_Builder._literal_states`), a block when copied: the generic DFA and the refined partition."""
    from cfsm.regex.syntax import Alt
    from cfsm.schema.numeric import int_range

    enum = Alt([lit(json.dumps(w)) for w in words])
    value = cat(lit('{"a":'), int_range(lo, lo + span), lit(',"b":'), enum, lit("}"))
    node = cat(*([value, lit(",")] * (copies - 1)), value)
    built = build_dfa_direct(node, force=True)
    assert built is not None and _same(built, build_dfa(node))
    _check_structural_classes(node)


def test_schemas_of_prepared_pieces_take_the_direct_path() -> None:
    """Blocks prepared once per process cost a compile nothing: a schema made of them (and of
    literal states) takes the direct construction even where no block repeats."""
    import cfsm.automata.direct as direct

    direct.prepare_blocks()
    schema = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "boolean"},
                                               "c": {"type": "string", "format": "email"},
                                               "d": {"enum": ["x", "y"]}, "e": {"type": "integer", "maximum": 9}},
              "required": ["a", "b", "c", "d", "e"], "additionalProperties": False}
    node = schema_to_node(schema, CfsmConfig())
    built = build_dfa_direct(node)
    assert built is not None and _same(built, build_dfa(node))
