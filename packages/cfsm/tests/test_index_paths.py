"""The Index's fast paths (chains of counted repeats, shared candidate splits, batched walks,
depth classes, JSON string states from the vocabulary's string tables) against its plain path
(trie descent per state), on random JSON Schemas and string-like regexes."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import cfsm
import cfsm.masks.index
import cfsm.masks.rows
import cfsm.masks.tiny
import cfsm.masks.walker
import cfsm.masks.walks
from cfsm import Vocabulary
from cfsm.automata.automaton import Dfa, build_dfa
from cfsm.masks.fragments import match_fragment
from cfsm.masks.index import build_index
from cfsm.masks.rows import or_bits
from cfsm.masks.templates import match_string_states
from cfsm.regex.formats import FORMAT_REGEXES
from cfsm.regex.parser import parse_regex
from cfsm.schema.json_schema import json_value_node, schema_to_node

_ALPHABET = list('abfnrtu0159"\\/{}[]:,.- ') + ["é", "€", "😀"]


def _json_vocab(seed: int, size: int) -> Vocabulary:
    rng = random.Random(seed)
    toks: set[bytes] = set()
    while len(toks) < size:
        text = "".join(rng.choice(_ALPHABET) for _ in range(rng.choice([1, 1, 2, 3, 4, 6, 9, 14, 20])))
        data = text.encode()
        if rng.random() < 0.05:  # partial UTF-8 pieces
            data = data[: rng.randint(1, len(data))]
        toks.add(data)
    return Vocabulary([b""] + sorted(toks), [0])


_LEAF = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 12)),
    st.builds(lambda a, b: {"type": "string", "minLength": a, "maxLength": a + b}, st.integers(0, 3), st.integers(0, 6)),
    st.just({"type": "string"}),
    st.just({"type": "string", "pattern": "^[^é]{0,6}$"}),  # a multi-byte character that does not step
    st.builds(lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w}, st.integers(-50, 50),
              st.integers(0, 2000)),
    st.just({"type": "boolean"}),
    st.just({"enum": ["alpha", "beta", 3]}),
    st.just({"type": "string", "format": "date"}),
    st.builds(lambda n: {"type": "array", "items": {"type": "integer"}, "maxItems": n}, st.integers(0, 3)),
)


def _objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def make(props: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
        names = [f"{prefix}{i}" for i in range(len(props))]
        return {"type": "object", "properties": dict(zip(names, props, strict=True)), "required": names,
                "additionalProperties": False}

    return st.builds(make, st.lists(children, min_size=1, max_size=3), st.sampled_from(["k", "ab", "u_"]))


_SCHEMAS = st.recursive(_LEAF, _objects, max_leaves=5).map(
    lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"]})

_VOCAB = _json_vocab(11, 1200)


_PLAIN = cfsm.IndexTuning(
    min_group_bytes=10**6,  # no chains (no counted-repeat lookups)
    walk_tiny=-1, walk_tiny_python=-1,  # no batched walks
    walk_broad=2.0,  # no whole-vocabulary walks: trie descent only
    share_depth=10**4,  # classes = equivalent states only
    string_tables=False, fragment_tables=False,  # no per-vocabulary string / format walks
    tiny_states=0)  # no all-states trie walk
# the all-states trie walk of small DFAs (`masks.tiny`) wherever it fits
_TINY = cfsm.IndexTuning(tiny_states=10**6, tiny_pairs=10**9)


def _plain_index(dfa: cfsm.automata.automaton.Dfa, vocab: Vocabulary) -> cfsm.Index:
    return build_index(dfa, vocab, tuning=_PLAIN)


def _fast_index(dfa: cfsm.automata.automaton.Dfa, vocab: Vocabulary, strings: bool = False) -> cfsm.Index:
    # thresholds scaled to the small vocabulary so that every fast path runs (as with 49k tokens)
    tuning = cfsm.IndexTuning(
        walk_tiny=60, walk_tiny_python=8, walk_batch_pairs=400, share_depth=6,
        walk_broad=0.3,  # escape states: not broad, as in a large vocabulary
        walk_long_chain_min=2,  # long tokens of string states by chain length
        walk_wide_first=4,  # second byte checked before expanding tokens
        string_tables=strings,
        classes_min_broad=0,  # walk classes always
        tiny_states=0)  # the general path
    return build_index(dfa, vocab, tuning=tuning)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=_SCHEMAS)
def test_fast_paths_give_the_plain_paths_masks(schema: dict[str, Any]) -> None:
    dfa = build_dfa(schema_to_node(schema))
    plain = _plain_index(dfa, _VOCAB)
    live = np.flatnonzero(plain.mask_row >= 0)
    fasts = (build_index(dfa, _VOCAB), _fast_index(dfa, _VOCAB),
             _fast_index(dfa, _VOCAB, strings=True), build_index(dfa, _VOCAB, tuning=_TINY))
    for fast in fasts:
        assert np.array_equal(fast.mask_row >= 0, plain.mask_row >= 0)
        assert np.array_equal(fast.masks[fast.mask_row[live]], plain.masks[plain.mask_row[live]])


def test_counted_string_states_use_the_chain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # guard for the property above: the schemas' string states do take the chain lookup here
    used: list[bool] = []
    real = cfsm.masks.walker.Walker._inside_group

    def spy(self, outside, utf8):  # type: ignore[no-untyped-def]
        used.append(utf8)
        return real(self, outside, utf8)

    monkeypatch.setattr(cfsm.masks.walker.Walker, "_inside_group", spy)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 9}}, "required": ["a"]}
    dfa = build_dfa(schema_to_node(schema))
    fast = _fast_index(dfa, _VOCAB)
    assert len(used) >= 5 and any(used)  # multi-byte characters stepped along the chain too
    plain = _plain_index(dfa, _VOCAB)
    live = np.flatnonzero(fast.mask_row >= 0)
    assert np.array_equal(fast.masks[fast.mask_row[live]], plain.masks[plain.mask_row[live]])


def test_two_byte_starts_hold_exactly_the_tokens_of_each_prefix() -> None:
    tables = _VOCAB.trie_tables
    starts = tables.two_byte_starts
    for i, tok in enumerate(tables.sorted_tokens):
        a = tok[0]
        if len(tok) == 1:
            assert starts[a, 0] <= i < starts[a, 1]
        else:
            assert starts[a, tok[1] + 1] <= i < starts[a, tok[1] + 2]
    # the ranges of one first byte tile its tokens, in order
    assert (np.diff(starts, axis=1) >= 0).all()
    assert np.array_equal(starts[:, 0], tables.first_byte_starts[:-1])
    assert np.array_equal(starts[:, 257], tables.first_byte_starts[1:])


# --- JSON string states from the vocabulary's string tables (cfsm.masks.templates) ---

_SVOCAB = _json_vocab(23, 900)
_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u00[01][0-9a-fA-F])'


def _both(dfa: Dfa, vocab: Vocabulary) -> tuple[cfsm.Index, cfsm.Index]:
    generic = build_index(dfa, vocab, tuning=cfsm.IndexTuning(string_tables=False, fragment_tables=False, tiny_states=0))
    return generic, build_index(dfa, vocab, tuning=cfsm.IndexTuning(tiny_states=0))


def _assert_same_masks(a: cfsm.Index, b: cfsm.Index) -> None:
    assert np.array_equal(a.mask_row >= 0, b.mask_row >= 0)
    live = np.flatnonzero(a.mask_row >= 0)
    assert np.array_equal(a.masks[a.mask_row[live]], b.masks[b.mask_row[live]])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=_SCHEMAS)
def test_string_tables_give_the_generic_masks_on_random_schemas(schema: dict[str, Any]) -> None:
    dfa = build_dfa(schema_to_node(schema))
    _assert_same_masks(*_both(dfa, _SVOCAB))


# JSON-string-like regexes: the exact character language with counted bounds, and near misses
# (one more or one fewer byte somewhere) that must not be taken for it
_BODIES = st.sampled_from([
    _CHAR, r'([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})', r'([^"\\\x00-\x1e]|\\["\\/bfnrt]|\\u00[01][0-9a-fA-F])',
    r'([^"\\\x00-\x1f]|\\["\\/bfnr]|\\u00[01][0-9a-fA-F])', r'([^"\\\x00-\x1f\x7f]|\\["\\/bfnrt]|\\u00[01][0-9a-fA-F])',
    r'([^"\\\x00-\x1fé]|\\["\\/bfnrt]|\\u00[01][0-9a-fA-F])', r'([^"\\\x00-\x1f]|\\["\\/bfnrt])'])
_BOUNDS = st.sampled_from(["*", "+", "{0,3}", "{2,5}", "{4}", "{1,}", "{0,20}", "{3,9}"])
_AFTER = st.sampled_from(["", "x", ',"k":1', "(,|})", "a*", r'"\w{0,3}', ":[0-9]+"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=_BODIES, bounds=_BOUNDS, after=_AFTER, twice=st.booleans())
def test_string_tables_on_string_like_regexes(body: str, bounds: str, after: str, twice: bool) -> None:
    one = f'"{body}{bounds}"{after}'
    pattern = f"{one}(;{one})?" if twice else one
    dfa = build_dfa(parse_regex(pattern))
    generic, tabled = _both(dfa, _SVOCAB)
    _assert_same_masks(generic, tabled)
    m = match_string_states(dfa, _SVOCAB.string_tables)
    # near misses are never taken for JSON string text with a character left (a state allowing
    # only the closing quote, or a pending character before it, may be matched in any grammar)
    assert ((m.t == _SVOCAB.string_tables.text) & (m.rem >= 1)).any() == (body == _CHAR)


def test_string_states_are_matched_with_their_bounds() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 2, "maxLength": 5},
                                               "b": {"type": "string"}}, "required": ["a", "b"]}
    dfa = build_dfa(schema_to_node(schema))
    m = match_string_states(dfa, _SVOCAB.string_tables)
    text = _SVOCAB.string_tables.text
    q = dfa.walk(dfa.start, b'{"a":"')
    assert (m.t[q], m.rem[q], m.need[q]) == (text, 5, 2)
    q2 = dfa.walk(q, "é\\n".encode())
    assert (m.t[q2], m.rem[q2], m.need[q2]) == (text, 3, 0)
    assert m.t[dfa.walk(q2, b"\\")] != text and m.t[dfa.walk(q2, b"\\")] >= 0  # an escape pending
    assert int(m.cont[q2]) == dfa.walk(q2, b'"')
    qb = dfa.walk(dfa.start, b'{"a":"xy","b":"')
    assert m.t[qb] == text and m.rem[qb] >= 1 << 40  # unbounded


def test_free_json_string_states_use_the_tables() -> None:
    dfa = build_dfa(json_value_node(cfsm.CfsmConfig(json_depth=2)))
    assert (match_string_states(dfa, _SVOCAB.string_tables).t >= 0).sum() > 10
    _assert_same_masks(*_both(dfa, _SVOCAB))


def _bench_grammars() -> dict[str, tuple[str, Any, str]] | None:
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "cfsm" / "grammars.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("cfsm_bench_grammars", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.GRAMMARS)


def test_benchmark_grammars_on_smollm2_give_the_generic_masks(smollm2_tokenizer: Any) -> None:
    from cfsm.hf import vocabulary_from_hf

    grammars = _bench_grammars()
    if grammars is None:
        pytest.skip("benchmarks/cfsm is not in this checkout")
    vocab = vocabulary_from_hf(smollm2_tokenizer)
    for kind, grammar, _ in grammars.values():
        if kind == "regex":
            node = parse_regex(grammar)
        elif kind == "schema":
            node = schema_to_node(grammar)
        else:
            node = json_value_node(cfsm.CfsmConfig())
        _assert_same_masks(*_both(build_dfa(node), vocab))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10), min_size=10, max_size=10), st.lists(st.booleans(), min_size=10, max_size=10))
def test_chain_ends_follow_the_chain_to_its_first_terminal(a: list[int], terminal: list[bool]) -> None:
    from cfsm.masks.templates import _chain_ends

    end, dist = _chain_ends(np.asarray(a, dtype=np.int64), np.asarray(terminal))
    for i in range(len(a)):
        cur, steps = i, 0
        while cur < len(a) and not terminal[cur] and steps <= len(a):
            cur, steps = a[cur], steps + 1
        if cur < len(a) and terminal[cur]:
            assert (end[i], dist[i]) == (cur, steps)
        else:  # leaves the candidates (index len(a)) or cycles without a terminal
            assert end[i] == -1


def test_long_counted_strings_are_matched_and_too_many_passes_fall_back() -> None:
    import cfsm.masks.templates

    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 300}},
              "required": ["a"]}
    dfa = build_dfa(schema_to_node(schema))
    m = match_string_states(dfa, _SVOCAB.string_tables)
    q = dfa.walk(dfa.start, b'{"a":"')
    assert (m.rem[q], m.need[q]) == (300, 3)
    assert int((m.t == _SVOCAB.string_tables.text).sum()) >= 300
    generic, tabled = _both(dfa, _SVOCAB)
    _assert_same_masks(generic, tabled)
    assert (match_string_states(dfa, _SVOCAB.string_tables, max_passes=0).t < 0).all()
    _assert_same_masks(generic, build_index(dfa, _SVOCAB, tuning=cfsm.IndexTuning(string_passes=0, tiny_states=0)))


def _proposals(dfa: Dfa) -> tuple[np.ndarray, ...]:
    """The (t, rem, need, cont) that `match_string_states` hands to `_verify`."""
    import cfsm.masks.templates

    got: list[tuple[np.ndarray, ...]] = []
    real = cfsm.masks.templates._verify

    def spy(dfa_: Dfa, st_: Any, t: np.ndarray, rem: np.ndarray, need: np.ndarray, cont: np.ndarray,
            *args: Any) -> None:
        got.append((t.copy(), rem.copy(), need.copy(), cont.copy()))
        real(dfa_, st_, t, rem, need, cont, *args)

    cfsm.masks.templates._verify = spy
    try:
        match_string_states(dfa, _SVOCAB.string_tables)
    finally:
        cfsm.masks.templates._verify = real
    return got[0] if got else ()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_SCHEMAS, seed=st.integers(0, 2**32 - 1), field=st.integers(0, 4), flips=st.integers(0, 3))
def test_one_check_of_all_string_states_agrees_with_the_passes(schema: dict[str, Any], seed: int, field: int,
                                                              flips: int) -> None:
    """`_all_pass` (all proposed states checked at once) says True exactly when the passes of
    `_verify` would unmark nothing, also on proposals made wrong on purpose."""
    import cfsm.masks.templates
    from cfsm.automata.json_automata import INF, joint_reps
    from cfsm.masks.templates import _all_pass

    dfa = build_dfa(schema_to_node(schema))
    props = _proposals(dfa)
    if not props:
        return
    t, rem, need, cont = (a.copy() for a in props)
    rng = np.random.default_rng(seed)
    marked = np.flatnonzero(t >= 0)
    for q in rng.choice(marked, size=min(flips, len(marked)), replace=False).tolist():
        if field == 0:
            t[q] = (t[q] + 1) % _SVOCAB.string_tables.num_t
        elif field == 1:
            rem[q] = max(rem[q] - 1, 0) if rem[q] < INF else 3
        elif field == 2:
            need[q] += 1
        elif field == 3:
            cont[q] = dfa.dead
        else:
            t[int(rng.integers(0, dfa.num_states))] = int(rng.integers(0, _SVOCAB.string_tables.num_t))
    stt = _SVOCAB.string_tables
    _, byte_class = dfa.byte_classes
    reps = joint_reps(byte_class, stt.byte_class)
    table = np.take(dfa.class_table, byte_class[reps], axis=1)
    t[dfa.dead] = -1
    before = t.copy()
    said = _all_pass(dfa, stt, stt.code[:, reps], table, t, rem, need, cont, stt.byte_class[reps], t >= 0)
    assert np.array_equal(t, before)  # pure
    cfsm.masks.templates._verify(dfa, stt, t, rem, need, cont, one_check_max=-1)  # the passes only
    event(f"all pass: {said}")
    assert said == bool(np.array_equal(t, before))


# --- `format` strings (email, uri) from the vocabulary's fragment tables (cfsm.masks.fragments) ---

_FALPHABET = list('ab.-@:/?#%"\\,{}[]01 _') + ["é", "a@b", "x.y", '",', '"}', "://", "%2"]


def _format_vocab(seed: int, size: int) -> Vocabulary:
    rng = random.Random(seed)
    toks: set[bytes] = set()
    while len(toks) < size:
        toks.add("".join(rng.choice(_FALPHABET) for _ in range(rng.choice([1, 1, 2, 3, 4, 6, 9]))).encode())
    return Vocabulary([b""] + sorted(toks), [0])


_FVOCAB = _format_vocab(5, 900)
_FORMAT_LEAF = st.one_of(
    st.sampled_from([{"type": "string", "format": f} for f in ("email", "uri", "date", "ipv4")]),
    st.just({"type": "string", "format": "email", "maxLength": 6}),  # an intersection: not F
    st.just({"type": "string", "format": "uri", "pattern": "b"}),
    st.just({"anyOf": [{"type": "string", "format": "email"}, {"type": "string", "format": "uri"}]}),
    st.just({"anyOf": [{"type": "string", "format": "email"}, {"type": "string", "maxLength": 3}]}),
    st.just({"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 3}),
    st.just({"type": "string"}),
    st.just({"type": "integer"}),
)
_FORMAT_SCHEMAS = st.recursive(_FORMAT_LEAF, _objects, max_leaves=4)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=_FORMAT_SCHEMAS)
def test_fragment_tables_give_the_generic_masks_on_random_schemas(schema: dict[str, Any]) -> None:
    dfa = build_dfa(schema_to_node(schema))
    _assert_same_masks(*_both(dfa, _FVOCAB))


_EMAIL = FORMAT_REGEXES["email"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=st.sampled_from([_EMAIL, _EMAIL.replace("0-9]", "0-8]"), _EMAIL.replace("+@", "*@"), _EMAIL + "-?",
                             FORMAT_REGEXES["uri"], FORMAT_REGEXES["uri"].replace("%", "&")]),
       after=st.sampled_from(["", "x", ',"k":1', "(,|})", '"', "@a*"]), twice=st.booleans())
def test_fragment_tables_on_format_like_regexes(body: str, after: str, twice: bool) -> None:
    one = f'"{body}"{after}'
    pattern = f"{one}(;{one})?" if twice else one
    dfa = build_dfa(parse_regex(pattern))
    _assert_same_masks(*_both(dfa, _FVOCAB))
    start = dfa.walk(dfa.start, b'"')
    matched = [t.name for t in _FVOCAB.fragment_tables if match_fragment(dfa, t).f[start] >= 0]
    # the exact format bodies are recognized (with any continuation), near misses never
    assert matched == (["email"] if body == _EMAIL else ["uri"] if body == FORMAT_REGEXES["uri"] else [])


def test_email_states_of_a_schema_use_the_fragment_tables() -> None:
    schema = {"type": "object", "properties": {"e": {"type": "string", "format": "email"}, "n": {"type": "integer"}},
              "required": ["e", "n"]}
    dfa = build_dfa(schema_to_node(schema))
    (email,) = [t for t in _FVOCAB.fragment_tables if t.name == "email"]
    m = match_fragment(dfa, email)
    q = dfa.walk(dfa.start, b'{"e":"')
    assert m.f[q] == email.start and int(m.cont[q]) == dfa.walk(q, b'a@b.c"')
    assert (m.f >= 0).sum() == email.num_f


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, 32 * 40 - 1), max_size=600), st.integers(0, 2**32 - 1))
def test_or_bits_sets_exactly_the_given_token_bits(tids: set[int], start: int) -> None:
    row = np.full(40, start, dtype=np.uint32)
    or_bits(row, np.asarray(sorted(tids), dtype=np.int64))  # both paths: at most and over _PACK_MIN ids
    want = [start | sum(1 << (t & 31) for t in tids if t >> 5 == w) for w in range(40)]
    assert row.tolist() == want


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sets=st.lists(st.lists(st.integers(0, 32 * 5 - 1), max_size=40), min_size=0, max_size=9),
       base_at=st.lists(st.integers(-1, 2), min_size=9, max_size=9), chunk_words=st.integers(1, 12))
def test_pack_rows_equal_rows_packed_one_by_one(sets: list[list[int]], base_at: list[int], chunk_words: int) -> None:
    words = 5
    base = np.random.default_rng(len(sets)).integers(0, 2**32, size=(3, words), dtype=np.uint32)
    base_idx = np.asarray(base_at[: len(sets)], dtype=np.int64)
    pair_g = np.asarray([g for g, s in enumerate(sets) for _ in s], dtype=np.int64)
    pair_t = np.asarray([t for s in sets for t in s], dtype=np.int64)  # repeated ids included
    got: list[bytes] = []
    want: list[bytes] = []

    def intern(row: np.ndarray) -> int:
        got.append(row.tobytes())
        return len(got) - 1

    # chunks of one row and more
    ids = cfsm.masks.rows.pack_rows(len(sets), pair_g, pair_t, words, intern, base, base_idx, chunk_words=chunk_words)
    for g, s in enumerate(sets):
        row = base[base_idx[g]].copy() if base_idx[g] >= 0 else np.zeros(words, dtype=np.uint32)
        or_bits(row, np.asarray(sorted(set(s)), dtype=np.int64))
        want.append(row.tobytes())
    assert ids.tolist() == list(range(len(sets))) and got == want


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(max_size=5), min_size=1, max_size=8), st.sampled_from(['"a{0,3}",?[xy]*', "[a-c]+x?", "é|a*"]))
def test_live_suffixes_equal_one_walk_per_pair(suffixes: list[bytes], pattern: str) -> None:
    from cfsm.masks.templates import live_suffixes, suffix_table

    dfa = build_dfa(parse_regex(pattern))
    conts = np.arange(dfa.num_states + 1, dtype=np.int64)  # the dead state too
    live = live_suffixes(dfa, conts, suffix_table(suffixes))
    want = [[dfa.walk(int(c), x) != dfa.dead for x in suffixes] for c in conts]
    assert live.tolist() == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.sampled_from([-1, 0, 1, 2, 7, 255, 256, 300, 65535, 65536, 70000])),
                min_size=1, max_size=60))
def test_string_row_groups_are_the_byte_row_groups(pairs: list[tuple[int, int]]) -> None:
    """`templates._by_state_and_cut` groups (T state, cut) pairs in the order and with the first
    members that `unique_rows` gives on their byte rows (the order rows are interned in)."""
    from cfsm.automata.automaton import unique_rows
    from cfsm.masks.templates import _by_state_and_cut

    s = np.array([p[0] for p in pairs], dtype=np.int64)
    c = np.array([p[1] for p in pairs], dtype=np.int64)
    key = np.hstack([s.astype(">i8")[:, None].view(np.uint8), c[:, None].view(np.uint8)])
    f1, i1 = unique_rows(key)
    f2, i2 = _by_state_and_cut(s, c)
    assert np.array_equal(f1, f2) and np.array_equal(i1, i2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.lists(st.binary(min_size=0, max_size=6), min_size=1, max_size=12),
       st.sampled_from([r'"[a-z]{0,3}",?', r"[0-9]+(\.[0-9]*)?[,}]*", r"(ab|a\x00)*b?"]))
def test_live_suffixes_against_one_walk_per_pair(seed: int, suffixes: list[bytes], pattern: str) -> None:
    """`live_suffixes` (suffixes walked by decreasing length, a leading slice per depth) equals
    walking each (continuation, suffix) pair through the DFA alone."""
    from cfsm.masks.templates import live_suffixes, suffix_table

    dfa = build_dfa(parse_regex(pattern))
    rng = random.Random(seed)
    conts = np.asarray(sorted({rng.randrange(dfa.num_states + 1) for _ in range(4)}), dtype=np.int64)
    cols = suffix_table(suffixes)
    got = live_suffixes(dfa, conts, cols)
    want = np.array([[dfa.walk(int(c), x) != dfa.dead for x in suffixes] for c in conts.tolist()], dtype=bool)
    assert np.array_equal(got, want)


# --- the all-states trie walk of small DFAs (cfsm.masks.tiny) ---

_PIECES = ["a", "b", "[0-9]", "[a-f]", r"\.", "é", "(ab|c)", "[^a]", "x?", "[0-5]{1,3}", "(a|bc)*", '"', "[ -~]{0,4}"]


def _walked_masks(dfa: Dfa, vocab: Vocabulary) -> list[bytes]:
    """The oracle: per state, every token's bytes walked through the DFA (EOS where it accepts)."""
    out = []
    for s in range(dfa.num_states):
        bits = np.zeros(vocab.mask_words * 32, dtype=bool)
        for t, tok in enumerate(vocab.tokens):
            bits[t] = bool(tok) and t not in vocab.special_token_ids and dfa.walk(s, tok) != dfa.dead
        bits[list(vocab.eos_token_ids)] = bool(dfa.accepting[s])
        out.append(np.packbits(bits, bitorder="little").tobytes())
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=6), budget=st.sampled_from([0, 40, 10**9]))
def test_the_tiny_walk_gives_every_states_walked_tokens(pieces: list[str], budget: int) -> None:
    dfa = build_dfa(parse_regex("".join(pieces)))
    got = cfsm.masks.tiny.tiny_rows(dfa, _VOCAB, budget)
    if got is None:  # only a budget refuses; the general path then
        assert budget < 10**9
        event("over the budget")
        index = build_index(dfa, _VOCAB, tuning=cfsm.IndexTuning(tiny_pairs=budget))
    else:
        index = cfsm.Index(vocab=_VOCAB, dfa=dfa, masks=got[0], mask_row=got[1])
        assert len({row.tobytes() for row in got[0]}) == len(got[0])  # equal masks share a row
        assert got[1][dfa.num_states] == -1 and (got[1][: dfa.num_states] >= 0).all()
    assert [index.mask(s).tobytes() for s in range(dfa.num_states)] == _walked_masks(dfa, _VOCAB)


def test_small_regexes_take_the_tiny_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    # guard for the property above: a small regex's default compile is the tiny walk's
    taken: list[bool] = []
    real = cfsm.masks.index.tiny_rows

    def spy(dfa: Dfa, vocab: Vocabulary, max_pairs: int) -> Any:
        out = real(dfa, vocab, max_pairs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(cfsm.masks.index, "tiny_rows", spy)
    index = cfsm.compile_regex(r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])", _VOCAB)
    assert taken == [True]
    plain = _plain_index(index.dfa, _VOCAB)
    _assert_same_masks(plain, index)


def test_deep_walks_take_the_general_path() -> None:
    # a state looping on a byte of long run tokens (whitespace) and a walk past the level cap: the
    # general path, with the same masks
    vocab = Vocabulary([b"", b" " * 12, b" ", b"a", b"ab", b"a" * 30, b"b"], [0])
    cases = [("a *b?", False), ("a {0,3}b?", True), ("a{30}b?", False), ("a{3}b?", True)]
    for pattern, tiny in cases:
        dfa = build_dfa(parse_regex(pattern))
        assert (cfsm.masks.tiny.tiny_rows(dfa, vocab, 10**9) is not None) == tiny, pattern
        index = build_index(dfa, vocab)
        assert [index.mask(s).tobytes() for s in range(dfa.num_states)] == _walked_masks(dfa, vocab)
