"""`^` / `$` anywhere in a top-level branch are assertions (start / end of the input), as in
ECMA-262 and the `regex` package (no multiline flag): checked against `regex` itself."""

from __future__ import annotations

import itertools

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from cfsm.automata.automaton import build_dfa
from cfsm.errors import UnsupportedRegexError
from cfsm.regex.parser import parse_regex

_ALPHABET = "ab/0"
# every string over the alphabet up to length 4 (no newline: `regex`'s `$` also matches before a
# final newline, ECMA's does not; cfsm follows ECMA)
_STRINGS = ["".join(p) for n in range(5) for p in itertools.product(_ALPHABET, repeat=n)]


def _check(pattern: str) -> int:
    """Compares both modes that parse with `regex`; returns how many did."""
    checked = 0
    for search in (True, False):
        try:
            tree = parse_regex(pattern, search=search)
        except UnsupportedRegexError:
            continue  # an anchor inside a group of a search pattern, or away from a group's end
        checked += 1
        dfa = build_dfa(tree)
        ref = regex.compile(pattern)
        for s in _STRINGS:
            want = (ref.search(s) if search else ref.fullmatch(s)) is not None
            assert dfa.fullmatch(s.encode()) == want, (pattern, search, s)
    return checked


@pytest.mark.parametrize("pattern", [
    "/^[0-9]{4}$/",  # JSONSchemaBench: a slash-delimited pattern; matches nothing
    "a^b", "a*^b", "(a|b)?^a", "a$b", "a$b*", "a$(b|/)?", "^a$|b^", "a|^0$", "$^", "^$", "a$$", "^^a",
    "a*^0$b?", "0$|a^b|^a", "(a$|b$)0*", "((a|b)$)", "(a$)?", "(^a)?b",
])
def test_mid_pattern_anchors_match_regex(pattern: str) -> None:
    assert _check(pattern) >= 1


def test_slash_pattern_matches_nothing() -> None:
    assert build_dfa(parse_regex("/^[0-9]{4}$/", search=True)).num_states == 0


@pytest.mark.parametrize("pattern", ["(?m)^a", "(?m:a$)", "a(?m)$"])
def test_multiline_anchors_refused(pattern: str) -> None:
    with pytest.raises(UnsupportedRegexError):
        parse_regex(pattern, search=True)


@pytest.mark.parametrize("pattern", ["(a|b$)0", "(a$)*", "(b$)+a", "(a$)?b", "a(^a|b)", "(^a)*", "(^a){2}"])
def test_anchor_in_group_away_from_its_end_refused(pattern: str) -> None:
    # NOTE: before, "(a|b$)0" (whole-string match) accepted "b0", "(^a)*" accepted "aa"
    with pytest.raises(UnsupportedRegexError):
        parse_regex(pattern)


_atoms = st.sampled_from(["a", "b", "/", "0", "[ab]", "a*", "b?", "(a|0)", "(?:b/)*", "^", "$", "(a|b$)", "(^a|b)",
                         "(a$)?", "(^a)*", "(^b)?", "(0$){1}", "(a|b$)?", "(a$|b$)", "((a|b)$)"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(_atoms, min_size=1, max_size=5), min_size=1, max_size=3))
def test_anchors_anywhere_match_regex(branches: list[list[str]]) -> None:
    _check("|".join("".join(b) for b in branches))
