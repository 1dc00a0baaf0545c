"""The pushdown compile's shortcuts against plain references: the subset construction's byte
pieces against stepping byte by byte, the vectorized counted-chain search against the search
state by state, the escape-pair sorting against a lexsort, the direct DFAs of ASCII chains and small parts
against the regular compiler's, and free JSON compiled once per vocabulary against a fresh
compile (keys, settlements and masks along random members)."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cfsm
from cfsm import compiler as cfsm_compiler
from cfsm.automata.automaton import Nfa, build_dfa, subset_construction
from cfsm.compiler import _rules_index
from cfsm.errors import GrammarTooLargeError
from cfsm.grammar import Grammar, GrammarIndex, build_pda, inline_rules, parse_ebnf
from cfsm.grammar import index as grammar_index
from cfsm.grammar import pda as grammar_pda
from cfsm.grammar.testing import JSON_GBNF, byte_vocab, draw_member, greedy_tokens
from cfsm.regex.syntax import Alt, Cat, Chars, Node, Repeat
from cfsm.schema.json_schema import json_value_grammar

_ranges = st.lists(st.tuples(st.integers(0, 255), st.integers(0, 40), st.integers(0, 5)), max_size=8).map(
    lambda xs: [(lo, min(255, lo + w), t) for lo, w, t in xs])


@settings(max_examples=300, deadline=None)
@given(ranges=_ranges)
def test_pieces_are_the_byte_steps(ranges: list[tuple[int, int, int]]) -> None:
    """Every byte gets the target set that stepping byte by byte gives, and the distinct target
    sets come in the same first-seen order (which numbers the new subsets)."""
    by_byte: dict[int, set[int]] = {}
    for lo, hi, t in ranges:
        for b in range(lo, hi + 1):
            by_byte.setdefault(b, set()).add(t)
    want = {b: frozenset(ts) for b, ts in by_byte.items()}
    got: dict[int, frozenset[int]] = {}
    order: list[frozenset[int]] = []
    for lo, hi, key in grammar_pda._pieces(ranges):
        assert lo <= hi
        for b in range(lo, hi + 1):
            assert b not in got
            got[b] = key
        if key not in order:
            order.append(key)
    assert got == want
    assert order == list(dict.fromkeys(want[b] for b in by_byte))


def _class_of(byte_set: set[int]) -> Chars:
    """The class of `byte_set` as sorted, disjoint, non-adjacent ranges."""
    ranges: list[tuple[int, int]] = []
    for b in sorted(byte_set):
        if ranges and ranges[-1][1] == b - 1:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((b, b))
    return Chars(tuple(ranges))


_ascii_classes = st.sets(st.integers(0, 127), min_size=1, max_size=12).map(_class_of)


@st.composite
def _ascii_chains(draw: Any) -> Node:
    """One ASCII class, a concatenation of them, or one repeated; sometimes a node the direct
    construction must leave to `build_dfa` (an empty concatenation, a class past ASCII, a
    class inside an alternation)."""
    kind = draw(st.sampled_from(["chars", "cat", "cat-loops", "repeat", "other"]))
    if kind == "chars":
        return draw(_ascii_classes)  # type: ignore[no-any-return]
    if kind == "cat":
        return Cat(draw(st.lists(_ascii_classes, max_size=5)))
    if kind == "cat-loops":  # NOTE: classes and `{lo,}` repeats (two in a row, or overlapping the next: None)
        item = st.one_of(_ascii_classes, st.builds(Repeat, _ascii_classes, st.integers(0, 2), st.none()))
        return Cat(draw(st.lists(item, max_size=5)))
    if kind == "repeat":
        lo = draw(st.integers(0, 4))
        hi = draw(st.one_of(st.none(), st.integers(0, 6).map(lambda k: lo + k)))
        return Repeat(draw(_ascii_classes), lo, hi)
    return draw(st.sampled_from([Chars(((97, 200),)), Alt([Chars(((97, 98),)), Chars(((120, 120),))]),
                                 Repeat(Cat([Chars(((97, 97),)), Chars(((98, 98),))]), 0, None), Repeat(Chars(((97, 97),)), 0, 0)]))


def _assert_same_dfa(got: Any, want: Any) -> None:
    """A `pda._Chain` is the `Dfa` `build_dfa` gives: same states, numbering, edges (the maximal
    byte ranges of one target `embed` takes, in byte order) and accepting states."""
    n = want.num_states
    assert got.num_states == n
    assert got.start == want.start
    assert np.array_equal(got.accepting[:n], want.accepting[:n])
    assert np.array_equal(np.where(got.transitions[:n] == got.dead, -1, got.transitions[:n]),
                          np.where(want.transitions[:n] == want.dead, -1, want.transitions[:n]))
    # the edges `embed` takes from the chain: each state's maximal byte ranges of one target, in byte order
    for k in range(n):
        row = want.transitions[k].tolist()
        runs = [(b, b, t) for b, t in enumerate(row) if t != want.dead]
        merged: list[tuple[int, int, int]] = []
        for lo, hi, t in runs:
            if merged and merged[-1][1] == lo - 1 and merged[-1][2] == t:
                merged[-1] = (merged[-1][0], hi, t)
            else:
                merged.append((lo, hi, t))
        assert list(got.runs[k]) == merged
    assert list(got.ends) == np.flatnonzero(want.accepting[:n]).tolist()


@settings(max_examples=300, deadline=None)
@given(node=_ascii_chains())
def test_ascii_chains_are_the_regular_compilers_dfas(node: Node) -> None:
    """`pda._ascii_dfa` gives the DFA `build_dfa` gives, or None."""
    got = grammar_pda._ascii_dfa(node)
    if got is not None:
        _assert_same_dfa(got, build_dfa(node))


# code point classes: ASCII, two-, three- and four-byte UTF-8 (surrogates and the last code point included)
_code_points = st.one_of(st.integers(0, 127), st.integers(0x80, 0x7FF), st.integers(0x800, 0xFFFF),
                         st.integers(0x10000, 0x10FFFF))
_char_classes = st.lists(st.tuples(_code_points, st.sampled_from([0, 1, 30, 5000, 0x10FFFF])), min_size=1,
                         max_size=3).map(lambda xs: _class_of_ranges([(lo, min(0x10FFFF, lo + w)) for lo, w in xs]))


def _class_of_ranges(ranges: list[tuple[int, int]]) -> Chars:
    """Code point ranges as one class (sorted, merged where they overlap or touch)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return Chars(tuple(out))


_regular_trees = st.recursive(
    _char_classes,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(Cat),
        st.lists(inner, min_size=1, max_size=3).map(Alt),
        st.tuples(inner, st.integers(0, 2), st.one_of(st.none(), st.integers(0, 3))).map(
            lambda t: Repeat(t[0], t[1], None if t[2] is None else t[1] + t[2]))),
    max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(node=_regular_trees)
def test_small_dfas_are_the_regular_compilers_dfas(node: Node) -> None:
    """`pda._small_dfa` (reference-free parts built in Python: subset construction over byte
    ranges, Moore rounds, breadth-first numbering) gives the DFA `build_dfa` gives, or None
    only where that DFA is empty or past its limits."""
    got = grammar_pda._small_dfa(node, 400)
    try:
        want = build_dfa(node, limit=400)
    except GrammarTooLargeError:
        assert got is None
        return
    if got is None:
        nfa = Nfa(0, 400)
        start, final = nfa.build(node)
        subsets = subset_construction(nfa, start, final, None, 400)[0].shape[0] - 1
        assert want.num_states == 0 or len(nfa.eps) > grammar_pda._SMALL_NFA or subsets > grammar_pda._SMALL_SUBSETS
        return
    _assert_same_dfa(got, want)


def test_free_json_parts_skip_the_regular_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Free JSON's network (its number and strings with any code point) is built without
    `build_dfa`, and is the network built with it."""
    root, rules = json_value_grammar(cfsm.CfsmConfig(), object_only=False)
    grammar = inline_rules(Grammar(rules={"root": root, **rules}, root="root"))
    reference = build_pda(grammar)
    with monkeypatch.context() as m:
        m.setattr(grammar_pda, "build_dfa", _refuse)
        direct = build_pda(grammar)
    with monkeypatch.context() as m:
        m.setattr(grammar_pda, "_small_dfa", lambda node, limit: None)
        m.setattr(grammar_pda, "_ascii_dfa", lambda node: None)
        generic = build_pda(grammar)
    for pda in (reference, direct):
        assert np.array_equal(pda.trans, generic.trans)
        assert pda.calls == generic.calls and pda.rule_start == generic.rule_start
        assert np.array_equal(pda.accepting, generic.accepting)


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("build_dfa called")


def test_ascii_chains_cover_the_json_grammars_literals() -> None:
    """The JSON GBNF's literals, punctuation and whitespace runs take the direct construction, and
    so does free JSON's separator (whitespace, a comma, whitespace); `a* b*` does not."""
    ws = Repeat(Chars(((9, 10), (13, 13), (32, 32))), 0, None)
    for node in (Chars(((123, 123),)), Cat([Chars(((110, 110),)), Chars(((117, 117),)), Chars(((108, 108),))]),
                 Repeat(Chars(((9, 10), (32, 32))), 0, 20), ws, Repeat(Chars(((48, 57),)), 1, None),
                 Cat([ws, Chars(((44, 44),)), ws]), Cat([Chars(((49, 57),)), Repeat(Chars(((48, 57),)), 0, None)])):
        assert grammar_pda._ascii_dfa(node) is not None
    assert grammar_pda._ascii_dfa(Cat([ws, Repeat(Chars(((97, 97),)), 0, None)])) is None


def _links_state_by_state(pda: grammar_pda.Pda) -> dict[int, tuple[int, bytes]]:
    """`_chain_links` as it was first written: one state and one target at a time."""
    trans, acc, calls, rule = pda.trans, pda.accepting, pda.calls, pda.state_rule
    succ: dict[int, tuple[int, bytes]] = {}
    for s in np.flatnonzero(pda.has_bytes).tolist():
        row = trans[s]
        for t in sorted(set(row[row >= 0].tolist())):
            if t == s or rule[t] != rule[s] or acc[t] != acc[s] or calls[t] != calls[s]:
                continue
            in_class = row == t
            nxt = trans[t][in_class]
            if not (np.array_equal(trans[t][~in_class], row[~in_class]) and (nxt == nxt[0]).all() and nxt[0] != t):
                continue
            succ[s] = (t, bytes(np.flatnonzero(in_class).tolist()))
            break
    return succ


@st.composite
def _chain_grammars(draw: st.DrawFn) -> str:
    """Random GBNF rules over a, b, c with counted runs, optional parts and recursion."""
    parts = ['"a"', '"bc"', "[ab]{0,3}", "[ \\t]{0,4}", "[abc]{1,5}", "[a]{2}", "root", "r1", '"c"?']
    names = ["root", "r1"]
    return "\n".join(
        f"{name} ::= " + " | ".join(" ".join(draw(st.sampled_from(parts)) for _ in range(draw(st.integers(1, 4))))
                                    for _ in range(draw(st.integers(1, 3))))
        for name in names)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(text=_chain_grammars())
def test_chain_links_are_found_state_by_state(text: str) -> None:
    try:
        pda = build_pda(inline_rules(parse_ebnf(text)))
    except cfsm.GrammarError:
        return  # NOTE: left-recursive or empty: no network
    links = grammar_index._chain_links(pda)
    assert links == _links_state_by_state(pda) and list(links) == sorted(links)


def test_counted_chains_of_the_json_grammar() -> None:
    pda = build_pda(inline_rules(parse_ebnf(JSON_GBNF)))
    assert grammar_index._chain_links(pda) == _links_state_by_state(pda)
    chains = grammar_index._counted_chains(pda)
    # NOTE: `ws ::= [ \t\n]{0,3}`: every state of a run but the head, its steps left counted down
    runs: dict[tuple[int, bytes], list[int]] = {}
    for head, left, run_class in chains.values():
        runs.setdefault((head, run_class), []).append(left)
    assert runs and all(sorted(v) == list(range(len(v))) for v in runs.values())
    assert any(run_class == b"\t\n " for _, run_class in runs)


_pairs = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(pairs=_pairs)
def test_key_infos_sort_escapes_as_lexsort(pairs: list[tuple[int, int]]) -> None:
    rank = np.array([p[0] for p in pairs], dtype=np.int64)
    at = np.array([p[1] for p in pairs], dtype=np.int32)
    order = np.lexsort((at, rank))
    want_rank, want_at = rank[order], at[order]
    uncertain, first = np.unique(want_rank, return_index=True)
    last = np.append(first[1:], len(want_rank)) - 1
    row = np.zeros(4, dtype=np.uint32)
    for info in (grammar_index._info(row, rank, at), grammar_index._info(row, want_rank, want_at, presorted=True)):
        assert np.array_equal(info.esc_rank, want_rank) and info.esc_rank.dtype == np.int64
        assert np.array_equal(info.esc_at, want_at) and info.esc_at.dtype == np.int32
        assert np.array_equal(info.uncertain, uncertain)
        assert np.array_equal(info.late, want_at[last] > 0 if len(pairs) else np.zeros(0, dtype=bool))
    assert grammar_index._info(row, rank, at).digest == grammar_index._info(row, rank[::-1], at[::-1]).digest


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 3000])
@pytest.mark.parametrize("wide", [False, True])
def test_escape_digests_hash_the_pair_bytes(n: int, wide: bool) -> None:
    """`_digest` is 16 bytes of SHA-256 over the rank bytes, "|", the offset bytes, whichever way
    it feeds them (joined below 1,024 pairs, in place above); from 1,024 pairs on, ranks below
    2**31 and offsets below 2**16 as int32 and uint16 bytes with "#" between them."""
    rank = np.arange(n, dtype=np.int64) * 3 + (2**31 if wide else 0)
    at = (np.arange(n) % 5).astype(np.int32)
    if n >= 1024 and not wide:
        want = hashlib.sha256(rank.astype(np.int32).tobytes() + b"#" + at.astype(np.uint16).tobytes()).digest()[:16]
    else:
        want = hashlib.sha256(rank.tobytes() + b"|" + at.tobytes()).digest()[:16]
    assert grammar_index._digest(rank, at) == want


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(0, 50), max_size=40), members=st.lists(st.integers(0, 50), max_size=20))
def test_sorted_set_helpers(values: list[int], members: list[int]) -> None:
    v = np.array(values, dtype=np.int64)
    s = np.unique(np.array(members, dtype=np.int64))
    assert np.array_equal(grammar_index._member(v, s), np.isin(v, s))
    assert np.array_equal(grammar_index._sorted_distinct(np.sort(v)), np.unique(v))


# tokens that cross JSON's rule ends, as BPE vocabularies have them
_JSON_PIECES = ["{\"", "\":", "\",", "\"}", "}]", "],", "]}", ", ", " \"", "12", "1.5", "true", "null", "\n}", "\n  ",
                "ab", "\": \"", "[{", "}}", "e5", "-0"]


def _masks(index: GrammarIndex, vocab: cfsm.Vocabulary, text: str) -> list[bytes]:
    """The masks along `text`'s tokens, up to the first token refused (then b"refused")."""
    guide = cfsm.Guide(index)
    out = np.zeros((1, vocab.mask_words), dtype=np.int32)
    masks = []
    for tid in greedy_tokens(vocab, text.encode()):
        guide.fill_mask(out, 0)
        masks.append(out.tobytes())
        try:
            guide.advance(tid)
        except cfsm.RejectedTokenError:
            return [*masks, b"refused"]
    return [*masks, b"end" if guide.can_stop() else b"open"]


def test_free_json_is_compiled_once_per_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call gets its own copy of one compile per vocabulary: equal to a fresh compile (keys,
    settlements, masks along random members of JSON), and guides on a copy leave the compile
    that later calls copy as it was."""
    vocab = byte_vocab(_JSON_PIECES)
    config = cfsm.CfsmConfig()
    root, rules = json_value_grammar(config, object_only=False)
    fresh = _rules_index(root, rules, vocab, "fresh")
    compiles: list[str] = []

    def counted(*args: Any, **kwargs: Any) -> GrammarIndex:
        compiles.append(args[3])
        return _rules_index(*args, **kwargs)

    monkeypatch.setattr(cfsm_compiler, "_rules_index", counted)
    first = cfsm.compile_json_object(vocab, object_only=False)
    second = cfsm.compile_json_object(vocab, object_only=False)
    assert len(compiles) == 1
    assert isinstance(first, GrammarIndex) and isinstance(second, GrammarIndex) and first is not second
    for index in (first, second):
        assert set(index._keys) == set(fresh._keys) and set(index._settled) == set(fresh._settled)
        for key, info in fresh._keys.items():
            other = index._keys[key]
            assert np.array_equal(info.row, other.row) and np.array_equal(info.esc_rank, other.esc_rank), key
            assert np.array_equal(info.esc_at, other.esc_at) and info.digest == other.digest, key
        assert index._states == fresh._states
    grammar = parse_ebnf(JSON_GBNF)
    rng = random.Random(7)
    compiled = first.num_configurations
    ends = []
    for _ in range(8):
        text = draw_member(grammar, rng, max_depth=6)
        masks = _masks(first, vocab, text)
        assert masks == _masks(fresh, vocab, text), text
        ends.append(masks[-1])
    assert ends.count(b"end") >= 4, ends  # NOTE: free JSON takes most members of the JSON GBNF
    assert first.num_configurations > compiled  # NOTE: the walk reached configurations the compile did not
    third = cfsm.compile_json_object(vocab, object_only=False)
    assert isinstance(third, GrammarIndex)
    assert third.num_configurations == second.num_configurations == compiled
    # another vocabulary (even an equal one) compiles its own
    again = cfsm.compile_json_object(byte_vocab(_JSON_PIECES), object_only=False)
    assert len(compiles) == 2
    assert isinstance(again, GrammarIndex) and again.vocab is not vocab and set(again._keys) == set(second._keys)
