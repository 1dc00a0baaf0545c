"""The shortcuts of `cfsm.grammar.index`'s vocabulary walks give the keys and masks of the plain
walk: tokens skipped by their first byte, few-token walks one token at a time, DFAs shared by
inlined parts. Each is switched off in a second index over the same network, which must agree
key by key and mask by mask along random members of the grammar (and the masks agree with
what `advance` accepts, the slow way)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cfsm
from cfsm.grammar import GrammarIndex, Pda, build_pda, inline_rules, parse_ebnf
from cfsm.grammar import index as grammar_index
from cfsm.grammar import pda as grammar_pda
from cfsm.grammar.testing import JSON_GBNF, byte_vocab, draw_member, greedy_tokens
from cfsm.guide import GrammarGuide
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


SQL = r'''
root     ::= select ";"
select   ::= "SELECT " ("DISTINCT ")? columns " FROM " tables where? group? order? limit?
columns  ::= "*" | column (", " column)*
column   ::= expr (" AS " ident)?
tables   ::= table (", " table | " JOIN " table " ON " cond)*
table    ::= ident (" " ident)? | "(" select ")" " " ident
where    ::= " WHERE " cond
group    ::= " GROUP BY " expr (", " expr)*
order    ::= " ORDER BY " expr (" ASC" | " DESC")? (", " expr (" ASC" | " DESC")?)*
limit    ::= " LIMIT " [0-9]+
cond     ::= pred ((" AND " | " OR ") pred)*
pred     ::= expr (" = " | " <> " | " < " | " > " | " <= " | " >= ") expr | expr " IN (" select ")" | "(" cond ")" | "NOT " pred
expr     ::= term ((" + " | " - " | " * " | " / ") term)*
term     ::= ident ("." ident)? | [0-9]+ | "'" [^'\n]* "'" | func "(" ("*" | expr) ")" | "(" expr ")"
func     ::= "COUNT" | "SUM" | "AVG" | "MIN" | "MAX"
ident    ::= [a-z_] [a-z0-9_]{0,30}
'''

GRAMMARS = {"c-like": C_LIKE, "json": JSON_GBNF}
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


def _unshared_init(self: grammar_pda._Nfa, names: dict[str, int], memo: dict[int, bool], dfas: object = None,
                   limits: object = None) -> None:
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



def _same_walks(shared: GrammarIndex, plain: GrammarIndex) -> None:
    """Every key either index has, computed by the other (on first use if need be), is the same."""
    for a, b in ((shared, plain), (plain, shared)):
        for key in list(a._keys):
            info, other = a._keys[key], b._key(key)
            assert np.array_equal(info.row, other.row), key
            assert np.array_equal(info.esc_rank, other.esc_rank) and np.array_equal(info.esc_at, other.esc_at), key


def _same_settled(shared: GrammarIndex, plain: GrammarIndex) -> None:
    """The compile settled for the shared index every escape set it settled without sharing (so
    first-use masks need no more walks), each once per class of returns."""
    for ret, digest in plain._settled:
        assert (shared._rep[ret], digest) in shared._settled, (ret, shared._rep[ret])


def _plain_index(pda: Pda, vocab: cfsm.Vocabulary) -> GrammarIndex:
    """The index of `pda` with every state walking on its own (no shared walks)."""
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(grammar_index, "walk_representatives",
                   lambda pda, follow, leads=None: np.arange(pda.num_states, dtype=np.int32))
        return GrammarIndex(pda, vocab)
    finally:
        mp.undo()


@pytest.mark.parametrize("name", sorted(GRAMMARS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_shared_walks_give_the_plain_keys_and_masks(name: str, vocab: cfsm.Vocabulary, seed: int) -> None:
    """States no byte string tells apart share one walk: every key and every mask along random
    members is that of an index where each state walks alone (and what `advance` accepts)."""
    shared = _index(name, vocab)
    assert len(set(shared._rep)) < shared.pda.num_states  # the grammar has states to share
    plain = _plain_index(shared.pda, vocab)
    _same_settled(shared, plain)
    _same_walks(shared, plain)
    grammar = parse_ebnf(GRAMMARS[name])
    rng = random.Random(seed)
    for k in range(3):
        member = draw_member(grammar, rng, max_depth=6)
        assert _masks_along(shared, vocab, member, slow=k == 0) == _masks_along(plain, vocab, member, slow=False)
    _same_walks(shared, plain)


@st.composite
def _random_grammars(draw: st.DrawFn) -> str:
    """A small random GBNF grammar over a, b, c (references anywhere), with repeated parts so
    that some states share walks."""
    names = ["root"] + [f"r{i}" for i in range(1, draw(st.integers(1, 4)))]
    parts = ['"ab"', '"c"', "[ab]", "[^a]", '"a"']

    def item(depth: int) -> str:
        kind = draw(st.sampled_from(["part", "part", "ref", "group"] if depth < 2 else ["part", "ref"]))
        if kind == "part":
            text = draw(st.sampled_from(parts))
        elif kind == "ref":
            text = draw(st.sampled_from(names))
        else:
            text = "(" + alternatives(depth + 1) + ")"
        return text + draw(st.sampled_from(["", "", "*", "+", "?", "{0,2}", "{1,3}"]))

    def alternatives(depth: int) -> str:
        return " | ".join(" ".join(item(depth) for _ in range(draw(st.integers(0, 3)))) or '""'
                          for _ in range(draw(st.integers(1, 3))))

    return "\n".join(f"{name} ::= {alternatives(0)}" for name in names)


# NOTE: derandomized (the same examples every run, no example database): a random draw can build a DFA toward
# its 200,000-state limit for minutes, so a drawn grammar must not decide whether CI passes
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(text=_random_grammars(), seed=st.integers(0, 2**32 - 1))
def test_random_grammars_share_walks_exactly(text: str, seed: int) -> None:
    """On random grammars the masks with shared walks are those without, along random members
    and along random strings (multi-byte tokens that cross rule ends included)."""
    vocab = byte_vocab(["ab", "ba", "abc", "ca", "aa", "cc", "bab", "cab"])
    try:
        pda = build_pda(inline_rules(parse_ebnf(text)))
        shared = GrammarIndex(pda, vocab)
    except cfsm.GrammarError:
        return  # NOTE: left-recursive, empty or too ambiguous: refused alike either way
    plain = _plain_index(pda, vocab)
    _same_settled(shared, plain)
    _same_walks(shared, plain)
    grammar = parse_ebnf(text)
    rng = random.Random(seed)
    texts = []
    for _ in range(3):
        try:
            texts.append(draw_member(grammar, rng, max_depth=5))
        except RecursionError:  # NOTE: a rule that only recurses (trimmed by the compile)
            break
    texts += ["".join(rng.choice("abc") for _ in range(rng.randrange(8))) for _ in range(3)]
    for s in texts:
        a, b = GrammarGuide(shared), GrammarGuide(plain)
        for tid in greedy_tokens(vocab, s.encode()):
            allowed = a.allowed_token_ids().tolist()
            assert allowed == b.allowed_token_ids().tolist(), (text, s)
            if tid not in allowed:
                break
            try:
                a.advance(tid)
                b.advance(tid)
            except cfsm.RejectedTokenError:
                # NOTE: only past MAX_STACKS parses may a mask allow a token that advance refuses
                assert shared.num_overflows or plain.num_overflows, (text, s)
                return
        if shared.num_overflows or plain.num_overflows:
            return
        assert a.can_stop() == b.can_stop()


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_lazy_keys_give_the_compiled_masks(name: str, vocab: cfsm.Vocabulary) -> None:
    """Past `lazy_positions` the compile walks only what the start needs; every later key is
    walked on first use, and the masks along random members are those of the eager compile."""
    from cfsm.grammar import compile_grammar

    grammar = parse_ebnf(GRAMMARS[name])
    eager = compile_grammar(grammar, vocab)
    lazy = compile_grammar(grammar, vocab, lazy_positions=1)
    assert len(lazy._keys) < len(eager._keys) and not lazy._settled
    rng = random.Random(5)
    for k in range(3):
        member = draw_member(grammar, rng, max_depth=6)
        assert _masks_along(lazy, vocab, member, slow=k == 0) == _masks_along(eager, vocab, member, slow=False)


def test_shared_returns_keep_every_compiled_settlement() -> None:
    """SQL's rules return to states that share walks across rules: what a shared settlement leaves
    uncertain is still settled below each return's own rule at compile time (as without sharing)."""
    vocab = byte_vocab(PIECES + [" FROM ", "SELECT ", " AS ", ", ", ") ", "))", " = ", "'a'", "a.", ".b", "1)", "x,"])
    pda = build_pda(inline_rules(parse_ebnf(SQL)))
    shared = GrammarIndex(pda, vocab)
    assert len(set(shared._rep)) < pda.num_states
    _same_settled(shared, _plain_index(pda, vocab))


def _walk_sets(index: GrammarIndex, sid: int, walk: tuple[np.ndarray, np.ndarray, np.ndarray]
               ) -> tuple[set[int], set[tuple[int, int]]]:
    acc, esc_rank, esc_at = walk
    assert len(set(acc.tolist())) == len(acc)
    return set(acc.tolist()), set(zip(esc_rank.tolist(), esc_at.tolist(), strict=True))


def _check_trie_walks(index: GrammarIndex) -> None:
    """Every one-frame key walked over the trie (alone and batched) against the token-at-a-time
    walk of the whole vocabulary (`_walk_scalar`)."""
    ranks = np.arange(len(index.vocab.trie_tables.by_length), dtype=np.int64)
    states = np.flatnonzero(index.pda.has_bytes).tolist()
    sids = [index._intern(index._close([(s,)])) for s in states]
    a_key, a_pos, e_key, e_pos, e_at = index._walk_trie_many(sids)
    rank = index.vocab.trie_levels.rank
    for k, sid in enumerate(sids):
        want = _walk_sets(index, sid, index._walk_scalar(sid, ranks, np.zeros(len(ranks), dtype=np.int32)))
        assert _walk_sets(index, sid, index._walk_trie(sid)) == want
        acc = set(rank[a_pos[a_key == k]].tolist())
        esc = {(r, d) for r, d in zip(rank[e_pos[e_key == k]].tolist(), e_at[e_key == k].tolist(), strict=True)
               if r not in acc}
        assert (acc, esc) == want


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_trie_walks_equal_token_walks(name: str, vocab: cfsm.Vocabulary) -> None:
    _check_trie_walks(_index(name, vocab))


_batched_settle = GrammarIndex._settle_many


def _plain_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Configurations stepped one byte at a time (no `_fill_pairs`), settlements walked one
    return at a time."""
    monkeypatch.setattr(GrammarIndex, "_fill_pairs", lambda self, wanted: None)
    monkeypatch.setattr(GrammarIndex, "_settle_many",
                        lambda self, rets, prev: [_batched_settle(self, [r], prev)[0] for r in rets])


def _same_keys_filled(fast: GrammarIndex, plain: GrammarIndex) -> None:
    """`_same_infos` of the one-frame keys; keys the fast compile walked that the plain one never
    asked for (return states whose settlements no escape reached) taken from the plain index
    one at a time first."""
    for key in set(fast._keys) - set(plain._keys):
        assert len(key) == 1, key
        plain._key(key)
    _same_infos(fast._keys, plain._keys)


def _same_tail_walks(pda: Pda, vocab: cfsm.Vocabulary, index: GrammarIndex) -> None:
    """Indexes whose trie walks go level by level as arrays to the end, or node by node from the
    second level on (`_walk_tail`), have the keys and settlements of `index`."""
    for tail in (0, 1 << 30):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(grammar_index, "_TAIL_NODES", tail)
            other = GrammarIndex(pda, vocab)
        _same_infos(other._keys, index._keys)
        _same_infos(other._settled, index._settled)


def _same_infos(a: dict[object, object], b: dict[object, object]) -> None:
    assert set(a) == set(b)
    for key, info in a.items():
        other = b[key]
        for field in ("row", "uncertain", "late", "esc_rank", "esc_at"):
            assert np.array_equal(getattr(info, field), getattr(other, field)), (key, field)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(text=_random_grammars(), seed=st.integers(0, 2**32 - 1))
@example(text='root ::= "a"{0,2} | "ab" | (r1 "c"? (r1+ root{1,3} "c"{1,3} | "" | ""){1,3})+ root{0,2} [ab]\n'
              'r1 ::= [ab] "c" "ab"+ | [^a] ([^a] | "ab"{0,2})+ root', seed=3)  # NOTE: walks pass MAX_STACKS
def test_random_grammars_batched_walks_and_row_fills_are_exact(text: str, seed: int) -> None:
    """On random grammars: trie walks (alone and batched) equal token-at-a-time walks, and an
    index whose configurations are stepped byte by byte (no row fills, one-frame and counted-chain
    keys walked one at a time) has the same keys, settlements and masks along random strings."""
    vocab = byte_vocab(["ab", "ba", "abc", "ca", "aa", "cc", "bab", "cab"])
    try:
        pda = build_pda(inline_rules(parse_ebnf(text)))
        fast = GrammarIndex(pda, vocab)
    except cfsm.GrammarError:
        return
    mp = pytest.MonkeyPatch()
    try:
        _plain_steps(mp)
        mp.setattr(GrammarIndex, "_one_frame_keys", lambda self, states: None)
        mp.setattr(GrammarIndex, "_chain_keys", lambda self, states: None)
        try:
            plain = GrammarIndex(pda, vocab)
        except cfsm.GrammarError:
            pytest.fail("the byte-by-byte index refused a grammar the row fills compiled")
    finally:
        mp.undo()
    _check_trie_walks(fast)
    _same_keys_filled(fast, plain)
    _same_infos(fast._settled, plain._settled)
    with pytest.MonkeyPatch.context() as mp:
        # NOTE: escapes before a first byte sorted, never read off the first column (`_first_escapes`)
        mp.setattr(grammar_index, "_FIRST_BY_COLUMN", 0)
        sorting = GrammarIndex(pda, vocab)
    _same_infos(sorting._keys, fast._keys)
    _same_infos(sorting._settled, fast._settled)
    _same_tail_walks(pda, vocab, fast)
    with pytest.MonkeyPatch.context() as mp:
        # NOTE: every pair of a configuration hashed alike: `_fill_pairs`'s exact check splits the groups
        mp.setattr(grammar_index, "_HASH_WEIGHTS", np.zeros_like(grammar_index._HASH_WEIGHTS))
        colliding = GrammarIndex(pda, vocab)
    _same_infos(colliding._keys, fast._keys)
    _same_infos(colliding._settled, fast._settled)
    for sid in range(1, colliding.num_configurations + 1):  # the filled table against byte-by-byte steps
        other = plain._ids.get(colliding.stacks(sid))
        for b in (97, 98, 99) if other is not None else ():
            assert colliding.stacks(colliding._step(sid, b)) == plain.stacks(plain._step(other, b)), (text, sid, b)
    rng = random.Random(seed)
    for _ in range(4):
        s = "".join(rng.choice("abc") for _ in range(rng.randrange(8)))
        a, b = GrammarGuide(fast), GrammarGuide(plain)
        for tid in greedy_tokens(vocab, s.encode()):
            allowed = a.allowed_token_ids().tolist()
            assert allowed == b.allowed_token_ids().tolist(), (text, s)
            if tid not in allowed:
                break
            nxt = [index.walk(g.state, vocab.tokens[tid]) for index, g in ((fast, a), (plain, b))]
            if not all(nxt):
                # NOTE: a walk past MAX_STACKS parses is refused (documented: the request stops as
                # stuck), though the masks, made from one stack at a time, allow the token
                assert not any(nxt) and fast.num_overflows and plain.num_overflows, (text, s)
                break
            a.advance(tid)
            b.advance(tid)
        assert a.can_stop() == b.can_stop()


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_row_fills_give_the_byte_by_byte_masks(name: str, vocab: cfsm.Vocabulary) -> None:
    """Configurations stepped a row at a time and keys walked in batches give the keys,
    settlements and masks (along random members, checked against `advance`) of byte-by-byte
    steps and keys walked one at a time."""
    fast = _index(name, vocab)
    mp = pytest.MonkeyPatch()
    try:
        _plain_steps(mp)
        mp.setattr(GrammarIndex, "_one_frame_keys", lambda self, states: None)
        mp.setattr(GrammarIndex, "_chain_keys", lambda self, states: None)
        plain = _index(name, vocab)
        grammar = parse_ebnf(GRAMMARS[name])
        rng = random.Random(7)
        for k in range(3):
            member = draw_member(grammar, rng, max_depth=6)
            assert _masks_along(fast, vocab, member, slow=k == 0) == _masks_along(plain, vocab, member, slow=False)
    finally:
        mp.undo()
    _same_keys_filled(fast, plain)
    _same_infos(fast._settled, plain._settled)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.binary(min_size=1, max_size=6).map(lambda b: bytes(x % 4 + 97 for x in b)),
                       min_size=1, max_size=40))
def test_trie_levels_are_the_token_trie(tokens: list[bytes]) -> None:
    """`Vocabulary.trie_levels` against the prefixes of the tokens (repeated tokens included)."""
    vocab = cfsm.Vocabulary([b"", *tokens], eos_token_ids=[0])
    tables, levels = vocab.trie_tables, vocab.trie_levels
    toks = tables.sorted_tokens
    assert len(levels.byte) == max(len(t) for t in tokens)
    for d in range(len(levels.byte)):
        prefixes = sorted({t[:d + 1] for t in toks if len(t) > d})
        assert len(levels.byte[d]) == len(prefixes)
        for k, p in enumerate(prefixes):
            lo, hi = int(levels.tok_lo[d][k]), int(levels.tok_hi[d][k])
            assert levels.byte[d][k] == p[-1]
            assert [i for i, t in enumerate(toks) if t.startswith(p)] == list(range(lo, hi))
            assert int(levels.end_count[d][k]) == sum(t == p for t in toks)
            assert all(t == p for t in toks[lo:lo + int(levels.end_count[d][k])])
            if d + 1 < len(levels.byte):
                kids = [q for q in sorted({t[:d + 2] for t in toks if len(t) > d + 1}) if q.startswith(p)]
                lo_c, hi_c = int(levels.child_lo[d][k]), int(levels.child_hi[d][k])
                assert hi_c - lo_c == len(kids)
                assert all(levels.byte[d + 1][c] == q[-1] for c, q in zip(range(lo_c, hi_c), kids, strict=True))
    assert np.array_equal(levels.rank[tables.by_length], np.arange(len(toks)))


def _naive_below(toks: tuple[bytes, ...], prefix: bytes) -> set[int]:
    return {b for t in toks if t.startswith(prefix) for b in t[len(prefix):]}


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.binary(min_size=1, max_size=6).map(lambda b: bytes(x % 5 * 55 + 2 for x in b)),
                       min_size=1, max_size=40))
def test_trie_levels_below_are_the_bytes_under_each_prefix(tokens: list[bytes]) -> None:
    """`TrieLevels.below` against the bytes past each prefix of the tokens that have it."""
    vocab = cfsm.Vocabulary([b"", *tokens], eos_token_ids=[0])
    toks, levels = vocab.trie_tables.sorted_tokens, vocab.trie_levels
    for d in range(len(levels.byte)):
        prefixes = sorted({t[:d + 1] for t in toks if len(t) > d})
        assert levels.below[d].shape == (len(prefixes), 4)
        for k, p in enumerate(prefixes):
            words = [int(w) for w in levels.below[d][k]]
            got = {b for b in range(256) if (words[b >> 6] >> (b & 63)) & 1}
            assert got == _naive_below(toks, p), (d, p)


# string-like grammars: self-loops on most bytes (string bodies), escapes, rule ends inside loops
_LOOP_PARTS = ['"\\"" [^"\\\\]* "\\""', '[^"]*', '[^a]*', '[a-c]+', '"a"', '"\\\\" [ab"]', '[^"\\\\\\x00-\\x1F]*',
               '[^\\n]*', '"é"']
_LOOP_BYTES = [b"a", b"b", b"c", b'"', b"\\", b"\n", "é".encode(), b"x", b" ", b"<", b">"]


@st.composite
def _loop_grammars(draw: st.DrawFn) -> str:
    """A random GBNF grammar of string-like parts (loops on most bytes) that call each other;
    every rule recurses (`"<" rule ">"`), so none is inlined: configurations of several stacks
    whose tops loop on different bytes."""
    names = ["root"] + [f"r{i}" for i in range(1, draw(st.integers(1, 3)))]

    def item() -> str:
        if draw(st.integers(0, 3)) == 0:
            return draw(st.sampled_from(names)) + draw(st.sampled_from(["", "?", "*"]))
        return "(" + draw(st.sampled_from(_LOOP_PARTS)) + ")" + draw(st.sampled_from(["", "", "?", "{0,2}"]))

    def alternatives() -> str:
        return " | ".join(" ".join(item() for _ in range(draw(st.integers(1, 3))))
                          for _ in range(draw(st.integers(1, 2))))

    return "\n".join(f'{name} ::= {alternatives()} | "<" {name} ">"' for name in names)


def _uncut_walk(index: GrammarIndex, sids: list[int]) -> tuple[np.ndarray, ...]:
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(grammar_index, "_LOOP_CUT", False)
        return index._walk_trie_many(sids)
    finally:
        mp.undo()


def _walk_set(walk: tuple[np.ndarray, ...]) -> tuple[set[tuple[int, int]], set[tuple[int, int, int]]]:
    a_key, a_pos, e_key, e_pos, e_at = (x.tolist() for x in walk)
    acc = list(zip(a_key, a_pos, strict=True))
    assert len(set(acc)) == len(acc)  # every accepted token once
    accepted = set(acc)
    # NOTE: the escapes of accepted tokens count for nothing (a cut subtree does not list them)
    return accepted, {e for e in zip(e_key, e_pos, e_at, strict=True) if e[:2] not in accepted}


# NOTE: derandomized, as the other random-grammar tests (a draw must not decide whether CI passes)
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(text=_loop_grammars(), tokens=st.lists(st.lists(st.sampled_from(_LOOP_BYTES), min_size=2, max_size=7)
                                              .map(b"".join), min_size=1, max_size=60),
       seed=st.integers(0, 2**32 - 1))
def test_loop_cut_walks_equal_plain_trie_walks(text: str, tokens: list[bytes], seed: int) -> None:
    """Trie walks that accept a subtree whole where its bytes loop the configuration (`_LOOP_CUT`)
    against the plain trie walk and the token-at-a-time walk, for every one-frame key and for
    configurations reached along random strings (deep stacks, rule ends inside loops); and an
    index compiled without the cut has the same keys, settlements and masks."""
    vocab = cfsm.Vocabulary([bytes([b]) for b in range(256)] + tokens + [b""], eos_token_ids=[256 + len(tokens)])
    try:
        pda = build_pda(inline_rules(parse_ebnf(text)))
        fast = GrammarIndex(pda, vocab)
    except cfsm.GrammarError:
        return
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(grammar_index, "_LOOP_CUT", False)
        plain = GrammarIndex(pda, vocab)
    finally:
        mp.undo()
    _same_infos(fast._keys, plain._keys)
    _same_infos(fast._settled, plain._settled)
    _same_tail_walks(pda, vocab, fast)
    _check_trie_walks(fast)
    _check_loop_bytes(fast)
    rng = random.Random(seed)
    alphabet = [b.decode() for b in _LOOP_BYTES]
    sids = set(range(1, fast.num_configurations + 1))
    for _ in range(4):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(10)))
        a, b = GrammarGuide(fast), GrammarGuide(plain)
        for tid in greedy_tokens(vocab, s.encode()):
            allowed = a.allowed_token_ids().tolist()
            assert allowed == b.allowed_token_ids().tolist(), (text, s)
            if tid not in allowed:
                break
            a.advance(tid)
            b.advance(tid)
        assert a.can_stop() == b.can_stop()
    # every configuration seen so far (multi-stack ones included) walked as a key, both ways
    sids = sorted(set(range(1, fast.num_configurations + 1)) | sids)
    assert _walk_set(fast._walk_trie_many(sids)) == _walk_set(_uncut_walk(fast, sids))


def _check_loop_bytes(index: GrammarIndex) -> None:
    """Every loop byte `_loop_flags` found steps its configuration to itself (the closure of the
    moved stacks, by hand)."""
    trans = index.pda.trans
    for sid in np.flatnonzero(index._loop_known[:index.num_configurations + 1]).tolist():
        for b in np.flatnonzero(np.unpackbits(index._loop[sid].view(np.uint8), bitorder="little")).tolist():
            moved = [(*st[:-1], int(trans[st[-1], b])) for st in index.stacks(sid) if trans[st[-1], b] >= 0]
            assert index._close(moved) == index.stacks(sid), (sid, b)


def test_survivor_loops_are_exact() -> None:
    """A byte that some stacks loop on and the others die on is a loop byte only where the
    survivors close back to the configuration: not a letter that one of two open alternatives
    reads (the other is gone for good), but a space between free JSON values (the value's start
    comes back through its call: SmolLM2's runs of up to 80 spaces, accepted at the top)."""
    text = 'root ::= a | b | "<" root ">"\na ::= "x" [a-m]* "." | "<" a ">"\nb ::= "x" [n-z]* "." | "<" b ">"'
    vocab = byte_vocab(["x", "c", "n", ".", "cc", "nn", "xc", "cn", "xcn.", "ccc.", "<x", "cccc", "nc."])
    pda = build_pda(inline_rules(parse_ebnf(text)))
    fast = GrammarIndex(pda, vocab)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grammar_index, "_LOOP_CUT", False)
        plain = GrammarIndex(pda, vocab)
    _same_infos(fast._keys, plain._keys)
    _same_infos(fast._settled, plain._settled)
    _check_loop_bytes(fast)
    for s in (b"xcn.", b"xcc.", b"xnn.", b"<xc.>", b"xnc."):
        a, b = fast.walk(fast.start, s), plain.walk(plain.start, s)
        assert (fast.stacks(a), fast.can_end(a)) == (plain.stacks(b), plain.can_end(b)), s
    spaces = byte_vocab(["[", "]", " ", "  ", "    ", "        ", "1", " 1", "  [", "\n  "])
    free = cfsm.compile_json_object(spaces, object_only=False)
    assert isinstance(free, GrammarIndex)
    _check_loop_bytes(free)
    survivors = [sid for sid in range(1, free.num_configurations + 1) if free._loop_known[sid]
                 and len({st[-1] for st in free.stacks(sid)}) > 1 and free._has_loop[sid]]
    assert survivors  # NOTE: whitespace between values: the loop a stack-by-stack check misses


_CHAIN_PARTS = ['[ \\t]{0,3}', '[ \\t]{0,2}', '[ab]{1,3}', '" "', '"a"', '[ x]', '"<"', '"x"{0,2}']
_CHAIN_BYTES = [b" ", b" ", b"\t", b"a", b"b", b"x", b"<", b">"]


@st.composite
def _chain_grammars(draw: st.DrawFn) -> str:
    """A random GBNF grammar of counted runs (counted chains) that call each other and end rules
    inside or after runs; every alternative starts with a byte (no left recursion), every rule
    has one without references (a language) and recurses (`"<" rule ">"`: none is inlined)."""
    names = ["root"] + [f"r{i}" for i in range(1, draw(st.integers(1, 3)))]
    leads = ['"a"', '" "', '[ x]', '[ab]{1,3}', '"x"']

    def item(refs: bool) -> str:
        if refs and draw(st.integers(0, 2)) == 0:
            # NOTE: no starred references: a nullable rule repeated multiplies the parses
            # a rule followed by a run byte: chain states at its end may escape on run bytes
            return draw(st.sampled_from(names)) + draw(st.sampled_from(["", "?", ' " "', ' [ \\t]']))
        return draw(st.sampled_from(_CHAIN_PARTS))

    def alternative(refs: bool) -> str:
        return " ".join([draw(st.sampled_from(leads))] + [item(refs) for _ in range(draw(st.integers(0, 3)))])

    return "\n".join(f'{name} ::= {alternative(False)} | {alternative(True)} | "<" {name} ">"' for name in names)


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(text=_chain_grammars(), tokens=st.lists(st.lists(st.sampled_from(_CHAIN_BYTES), min_size=2, max_size=7)
                                               .map(b"".join), min_size=1, max_size=40),
       seed=st.integers(0, 2**32 - 1))
def test_derived_chain_keys_equal_walked_ones(text: str, tokens: list[bytes], seed: int) -> None:
    """Counted-chain keys derived without a walk (`_CHAIN_DERIVE`: tokens whose leading run
    passes the chain's end die there, escaping where the head does) against chain keys whose long
    tokens are walked, and against an index with no counted chains at all (every key a plain
    walk): same keys, settlements and masks along random strings."""
    # NOTE: runs longer than the chains, some followed by other bytes
    runs = [b"   ", b"    ", b" \t ", b"\t\t\t\t", b"  a", b"   x", b" <", b"  >"]
    tokens = sorted(set(tokens) | set(runs))
    vocab = cfsm.Vocabulary([bytes([b]) for b in range(256)] + tokens + [b""], eos_token_ids=[256 + len(tokens)])
    try:
        pda = build_pda(inline_rules(parse_ebnf(text)))
        fast = GrammarIndex(pda, vocab)
    except cfsm.GrammarError:
        return
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(grammar_index, "_CHAIN_DERIVE", False)
        walked = GrammarIndex(pda, vocab)
        mp.setattr(grammar_index, "_counted_chains", lambda pda: {})
        plain = GrammarIndex(pda, vocab)
    finally:
        mp.undo()
    for other in (walked, plain):
        _same_infos(fast._keys, other._keys)
        _same_infos(fast._settled, other._settled)
    rng = random.Random(seed)
    alphabet = [b.decode() for b in _CHAIN_BYTES]
    for _ in range(4):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
        a, b = GrammarGuide(fast), GrammarGuide(plain)
        for tid in greedy_tokens(vocab, s.encode()):
            allowed = a.allowed_token_ids().tolist()
            assert allowed == b.allowed_token_ids().tolist(), (text, s)
            if tid not in allowed:
                break
            a.advance(tid)
            b.advance(tid)
        assert a.can_stop() == b.can_stop()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_byte_leads_are_the_least_byte_with_an_equal_column(states: int, values: int, seed: int) -> None:
    """`_byte_leads`: each byte's lead is the least byte whose column of the table equals its own
    (checked against a dictionary of the columns), the table the batched steps copy entries by."""
    rng = np.random.default_rng(seed)
    trans = rng.integers(-1, values, size=(states, 256)).astype(np.int32)
    if seed % 2:
        trans[:, rng.integers(0, 256, size=64)] = trans[:, rng.integers(0, 256, size=64)]  # NOTE: more equal columns
    least: dict[bytes, int] = {}
    want = [least.setdefault(trans[:, b].tobytes(), b) for b in range(256)]
    assert grammar_index._byte_leads(trans).tolist() == want
