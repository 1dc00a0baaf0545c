"""The shortcuts of `cfsm.grammar.index`'s vocabulary walks give the keys and masks of the plain
walk: tokens skipped by their first byte, few-token walks one token at a time, DFAs shared by
inlined parts. Each is switched off in a second index over the same network, which must agree
key by key and mask by mask along random members of the grammar (and the masks agree with
what `advance` accepts, the slow way)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cfsm
from cfsm.grammar import GrammarGuide, GrammarIndex, build_pda, inline_rules, parse_ebnf
from cfsm.grammar import index as grammar_index
from cfsm.grammar import pda as grammar_pda
from cfsm.grammar.testing import byte_vocab, draw_member, greedy_tokens
from cfsm.testing import allowed_by_advance

C_LIKE = r'''
root     ::= ws stmt+
stmt     ::= decl | assign | ifstmt | block | retstmt
block    ::= "{" ws stmt* "}" ws
decl     ::= ("int" | "char") " " ws ident ws ("=" ws expr)? ";" ws
assign   ::= ident ws ("=" | "+=") ws expr ";" ws
ifstmt   ::= "if" ws "(" ws expr ")" ws stmt ("else" ws stmt)?
retstmt  ::= "return" ws expr? ";" ws
expr     ::= unary (binop ws unary)*
binop    ::= "+" | "-" | "*" | "==" | "<=" | "<" | "&&"
unary    ::= ("-" | "!")? primary
primary  ::= number ws | ident ws ( "(" ws ( expr ("," ws expr)* )? ")" ws )? | "(" ws expr ")" ws
ident    ::= [a-zA-Z_] [a-zA-Z0-9_]{0,5}
number   ::= [0-9]+ ("." [0-9]+)?
ws       ::= [ \t\n]*
'''

JSON = r'''
root   ::= value
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}"
array  ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ( [0-9] | [1-9] [0-9]{0,3} ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]{1,2} )?
ws     ::= [ \t\n]{0,3}
'''

GRAMMARS = {"c-like": C_LIKE, "json": JSON}
# tokens that cross rule ends (a return, then more bytes), as BPE vocabularies have them
PIECES = [") ", ");", "))", ")) ", " (", " x", " +", "x)", "1;", "1)", " 1", "int", "return", " =", "= ", "x ",
          "if (", "{\"", "\":", "\",", "\"}", "}]", "],", "]}", ", ", " \"", "12", "1.5", "true", "null", "\n}",
          "\n  ", "ab", "abc(", "x;", "});", "}\n"]


def _index(name: str, vocab: cfsm.Vocabulary) -> GrammarIndex:
    return GrammarIndex(build_pda(inline_rules(parse_ebnf(GRAMMARS[name]))), vocab)


def _same_keys(a: GrammarIndex, b: GrammarIndex) -> None:
    assert set(a._keys) == set(b._keys)
    for key, info in a._keys.items():
        other = b._keys[key]
        assert np.array_equal(info.row, other.row), key
        assert np.array_equal(info.uncertain, other.uncertain), key
        assert np.array_equal(info.late, other.late), key
        assert np.array_equal(info.esc_rank, other.esc_rank) and np.array_equal(info.esc_at, other.esc_at), key


def _masks_along(index: GrammarIndex, vocab: cfsm.Vocabulary, text: str, slow: bool) -> list[bytes]:
    guide = GrammarGuide(index)
    out = np.zeros((1, vocab.mask_words), dtype=np.int32)
    masks = []
    for tid in greedy_tokens(vocab, text.encode()):
        guide.fill_mask(out, 0)
        assert guide.has_tokens() and (int(out[0, tid >> 5]) >> (tid & 31)) & 1, text
        if slow:
            assert set(guide.allowed_token_ids().tolist()) == allowed_by_advance(guide, vocab.size), text
        masks.append(out.tobytes())
        guide.advance(tid)
    assert guide.can_stop(), text
    return masks


@pytest.fixture(scope="module")
def vocab() -> cfsm.Vocabulary:
    return byte_vocab(PIECES)


@pytest.mark.parametrize("name", sorted(GRAMMARS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_scalar_walks_equal_array_walks(name: str, vocab: cfsm.Vocabulary, seed: int) -> None:
    """Few-token walks one token at a time against the array walk of every subset."""
    scalar = _index(name, vocab)
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(grammar_index, "_SCALAR_WALK", -1)
        arrays = _index(name, vocab)
        _same_keys(scalar, arrays)
        grammar = parse_ebnf(GRAMMARS[name])
        rng = random.Random(seed)
        for k in range(3):
            member = draw_member(grammar, rng, max_depth=6)
            # the first-use keys of deep stacks come from both kinds of walks alike
            got = _masks_along(arrays, vocab, member, slow=False)
            mp.setattr(grammar_index, "_SCALAR_WALK", 64)
            assert _masks_along(scalar, vocab, member, slow=k == 0) == got
            mp.setattr(grammar_index, "_SCALAR_WALK", -1)
        _same_keys(scalar, arrays)
    finally:
        mp.undo()


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_first_byte_filter_is_exact(name: str, vocab: cfsm.Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    filtered = _index(name, vocab)
    monkeypatch.setattr(GrammarIndex, "_first_bytes", lambda self, sid: np.ones(256, dtype=bool))
    plain = _index(name, vocab)
    _same_keys(filtered, plain)


def test_shared_dfas_give_the_same_network(monkeypatch: pytest.MonkeyPatch) -> None:
    for text in GRAMMARS.values():
        grammar = inline_rules(parse_ebnf(text))
        shared = build_pda(grammar)
        monkeypatch.setattr(grammar_pda._Nfa, "__init__", _unshared_init)
        plain = build_pda(grammar)
        monkeypatch.undo()
        assert np.array_equal(shared.trans, plain.trans) and shared.calls == plain.calls
        assert np.array_equal(shared.accepting, plain.accepting)


_original_init = grammar_pda._Nfa.__init__


def _unshared_init(self: grammar_pda._Nfa, names: dict[str, int], memo: dict[int, bool], dfas: object = None) -> None:
    _original_init(self, names, memo, None)


@pytest.mark.parametrize("name", sorted(GRAMMARS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_compiled_settlements_leave_no_walk_for_first_use(name: str, vocab: cfsm.Vocabulary, seed: int) -> None:
    """What a compile worker sends (`payload`) settles every deep stack of random members without a
    vocabulary walk on the engine's side, and its masks are those `advance` accepts."""
    compiled = _index(name, vocab)
    engine_side = GrammarIndex.from_payload(compiled.payload(), vocab)

    def no_walk(*args: object) -> None:
        raise AssertionError("a vocabulary walk after the compile")

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(GrammarIndex, "_walk_tokens", no_walk)
        mp.setattr(GrammarIndex, "_walk_pairs", no_walk)
        grammar = parse_ebnf(GRAMMARS[name])
        rng = random.Random(seed)
        for k in range(3):
            member = draw_member(grammar, rng, max_depth=8)
            _masks_along(engine_side, vocab, member, slow=k == 0)
    finally:
        mp.undo()
