"""`_product` (frontier at a time over joint byte classes) gives the very `Dfa` of a pair-by-pair
walk over 256 byte columns (the implementation before it), and the intersection's language."""

from __future__ import annotations

import numpy as np
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from cfsm.automata import automaton as A
from cfsm.regex.parser import parse_regex


def _pairwise_product(a: A.Dfa, b: A.Dfa) -> A.Dfa:
    """The reference: one pair at a time, 256 columns, pairs numbered as met."""
    nb = b.num_states + 1
    ids = {a.start * nb + b.start: 0}
    pairs = [(a.start, b.start)]
    rows = []
    k = 0
    while k < len(pairs):
        x, y = pairs[k]
        keys = a.transitions[x].astype(np.int64) * nb + b.transitions[y]
        dead = (a.transitions[x] == a.dead) | (b.transitions[y] == b.dead)
        uniq, inv = np.unique(keys, return_inverse=True)
        mapped = []
        for key in uniq.tolist():
            if key not in ids:
                ids[key] = len(pairs)
                pairs.append((key // nb, key % nb))
            mapped.append(ids[key])
        row = np.asarray(mapped, dtype=np.int64)[inv.reshape(-1)]
        row[dead] = -1
        rows.append(row)
        k += 1
    n = len(pairs)
    table = np.stack(rows)
    table[table < 0] = n
    table = np.vstack([table, np.full((1, 256), n)]).astype(np.int32)
    acc = np.array([bool(a.accepting[x] and b.accepting[y]) for x, y in pairs] + [False])
    return A.minimize(table, acc, 0)


_PIECES = [r"\S+\s", r"[a-c]{1,3}", r"\d", r"é?", r"[^\"\\]", r".", r"(ab|b)*", r"x{0,2}", r"[\u00e0-\u07ff]", r"\w"]
_regexes = st.lists(st.sampled_from(_PIECES), min_size=1, max_size=4).map("".join)


@settings(max_examples=40, deadline=None)
@given(_regexes, _regexes, st.lists(st.text(alphabet="abcx1é ß\"\\ࠀ", max_size=6), max_size=20))
def test_product_is_the_pairwise_walks_dfa(p: str, q: str, texts: list[str]) -> None:
    a, b = A.build_dfa(parse_regex(p)), A.build_dfa(parse_regex(q))
    got, want = A._product(a, b), _pairwise_product(a, b)
    assert got.start == want.start
    assert np.array_equal(got.transitions, want.transitions)
    assert np.array_equal(got.accepting, want.accepting)
    assert np.array_equal(got.byte_classes[1], want.byte_classes[1])
    assert np.array_equal(got.class_table, want.class_table)
    for t in texts:
        inside = regex.fullmatch(p, t) is not None and regex.fullmatch(q, t) is not None
        assert got.fullmatch(t.encode()) == inside, (p, q, t)


def test_product_of_an_empty_language() -> None:
    a, b = A.build_dfa(parse_regex("a{2}")), A.build_dfa(parse_regex("b"))
    got = A._product(a, b)
    assert got.num_states == 0 and got.num_states == _pairwise_product(a, b).num_states
