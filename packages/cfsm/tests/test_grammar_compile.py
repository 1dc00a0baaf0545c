"""The pushdown compile's shortcuts against plain references: the subset construction's byte
pieces against stepping byte by byte, the vectorized counted-chain search against the search
state by state, the escape-pair sorting against a lexsort."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import cfsm
from cfsm.grammar import build_pda, inline_rules, parse_ebnf
from cfsm.grammar import index as grammar_index
from cfsm.grammar import pda as grammar_pda
from cfsm.grammar.testing import JSON_GBNF

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


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(0, 50), max_size=40), members=st.lists(st.integers(0, 50), max_size=20))
def test_sorted_set_helpers(values: list[int], members: list[int]) -> None:
    v = np.array(values, dtype=np.int64)
    s = np.unique(np.array(members, dtype=np.int64))
    assert np.array_equal(grammar_index._member(v, s), np.isin(v, s))
    assert np.array_equal(grammar_index._sorted_distinct(np.sort(v)), np.unique(v))
