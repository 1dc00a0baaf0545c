"""Token-level Index and Guide against a naive oracle (walk every token through the DFA)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cfsm
from cfsm import CfsmConfig, Compiler, Guide, RejectedTokenError, Vocabulary, VocabularyError
from cfsm.masks.compressed import utf8_prefix
from cfsm.testing import char_vocab, tiny_vocab

PATTERNS = [
    r"[a-z]+@[a-z]+\.(com|org)",
    r'\{"name":"[^"\\]{0,8}","age":(0|[1-9][0-9]?)\}',
    r"(true|false|null)",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    r"é+€?😀{1,2}|[^a-z]{2,3}",
    r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
]


def _random_vocab(seed: int, size: int) -> Vocabulary:
    rng = random.Random(seed)
    alphabet = list('abcdez019.-"\\{}:,@ ') + ["é", "€", "😀"]
    toks: set[bytes] = set()
    while len(toks) < size:
        text = "".join(rng.choice(alphabet) for _ in range(rng.choice([1, 1, 2, 3, 4, 6, 9])))
        data = text.encode()
        if rng.random() < 0.1:  # partial UTF-8 pieces, as byte-level BPE has them
            data = data[: rng.randint(1, len(data))]
        toks.add(data)
    tokens = [b""] + sorted(toks) + [b"a", b""]  # duplicates and a control token
    return Vocabulary(tokens, [0], special_token_ids=[len(tokens) - 1], size=len(tokens) + 5)


def _check_index_against_oracle(index: cfsm.Index) -> None:
    vocab, dfa = index.vocab, index.dfa
    reachable = {dfa.start}
    frontier = [dfa.start]
    while frontier:
        s = frontier.pop()
        for t, tok in enumerate(vocab.tokens):
            if not tok or t in vocab.special_token_ids:
                continue
            nxt = dfa.walk(s, tok)
            if nxt != dfa.dead and nxt not in reachable:
                reachable.add(nxt)
                frontier.append(nxt)
    with_masks = {int(s) for s in np.flatnonzero(index.mask_row >= 0)}
    assert reachable <= with_masks and dfa.dead not in with_masks
    for s in with_masks:
        mask = index.mask(s)
        for t in range(vocab.size):
            tok = vocab.token_bytes(t)
            expected = dfa.walk(s, tok) if tok else dfa.dead
            bit = bool((int(mask[t // 32]) >> (t % 32)) & 1)
            if t in vocab.eos_token_ids:
                assert bit == bool(dfa.accepting[s])
                continue
            assert bit == (expected != dfa.dead), (s, t, tok)
            assert index.next_state(s, t) == expected


@pytest.mark.parametrize("pattern", PATTERNS)
def test_index_matches_naive_walk_on_tiny_vocab(pattern: str) -> None:
    _check_index_against_oracle(cfsm.compile_regex(pattern, tiny_vocab()))


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("share_depth", [16, 2])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_index_matches_naive_walk_on_a_random_vocab(pattern: str, share_depth: int, tiny: bool) -> None:
    # large enough that the trie descent, the range walk and the whole-vocabulary walk all run;
    # a share depth of 2 makes most tokens "long" (walked per state, not shared per class)
    import cfsm.masks.index
    import cfsm.masks.walker

    # tiny: every state walks the trie at once (`masks.tiny`), else the general path
    tuning = cfsm.IndexTuning(share_depth=share_depth, tiny_states=10**6 if tiny else 0, tiny_pairs=10**9)
    config = cfsm.CfsmConfig(tuning=tuning)
    _check_index_against_oracle(cfsm.compile_regex(pattern, _random_vocab(len(pattern), 1500), config))


def test_states_with_equal_masks_share_rows() -> None:
    index = cfsm.compile_regex("(ab|cd)*", char_vocab("abcd"))
    rows = {index.mask(s).tobytes(): int(index.mask_row[s]) for s in np.flatnonzero(index.mask_row >= 0)}
    assert len(rows) == index.masks.shape[0]
    assert index.masks.shape[1] == 1 and index.masks.dtype == np.int32


def _encoder(vocab: Vocabulary):  # greedy longest-match tokenizer: a stand-in for a real one
    from cfsm.masks.compressed import _greedy_tokens

    return lambda text: _greedy_tokens(text.encode(), vocab)


_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 10**6), jump=st.booleans())
def test_every_allowed_path_is_a_prefix_and_completions_fullmatch(pattern: str, seed: int, jump: bool) -> None:
    vocab = tiny_vocab()
    index = cfsm.compile_regex(pattern, vocab)
    rng = random.Random(seed)
    guide = Guide(index)
    tokens: list[int] = []
    mask = np.zeros((1, vocab.mask_words), dtype=np.int32)
    for _ in range(40):
        if jump and rng.random() < 0.5:
            forced = guide.jump_forward()
            if forced:
                text = utf8_prefix(vocab.decode(tokens))
                # the forced text is the only continuation: anything else is no prefix of a match
                assert not regex.fullmatch(pattern, text)
                assert regex.fullmatch(pattern, text + forced, partial=True)
                for c in "az0.\"é{":
                    if c != forced[0]:
                        assert not regex.fullmatch(pattern, text + c, partial=True), (text, c, forced)
                plan = cfsm.plan_jump_forward(tokens, forced, vocab, _encoder(vocab))
                guide.apply_jump(plan)
                tokens = tokens[: len(tokens) - plan.num_rollback] + list(plan.token_ids)
                assert vocab.decode(tokens).endswith(forced.encode())
        guide.fill_mask(mask, 0)
        allowed = guide.allowed_token_ids()
        bits = [t for t in range(vocab.size) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
        assert bits == allowed.tolist()
        if len(allowed) == 0:
            break
        t = int(rng.choice(allowed.tolist()))
        guide.advance(t)
        if t in vocab.eos_token_ids:
            assert regex.fullmatch(pattern, vocab.decode(tokens).decode())
            assert guide.is_finished()
            return
        tokens.append(t)
        text = utf8_prefix(vocab.decode(tokens))
        assert regex.fullmatch(pattern, text, partial=True), (pattern, text)


def test_guide_advance_rollback_copy_and_errors() -> None:
    vocab = char_vocab("ab")  # a=0, b=1, EOS=2
    index = cfsm.compile_regex("ab?", vocab)
    g = Guide(index)
    assert not g.can_stop() and not g.is_finished()
    with pytest.raises(RejectedTokenError, match="EOS before the grammar is complete"):
        g.advance(2)
    with pytest.raises(RejectedTokenError, match="token 1 is not allowed"):
        g.advance(1)
    g.advance(0)
    assert g.can_stop() and not g.is_finished()
    h = g.copy()
    h.advance(1)
    assert h.is_finished() and not g.is_finished()  # "ab" is complete and nothing can follow
    assert not h.eos_accepted  # finished by the grammar, not by EOS
    g.advance(2)
    assert g.is_finished() and g.eos_accepted
    mask = np.zeros((1, 1), dtype=np.int32)
    g.fill_mask(mask)
    assert int(mask[0, 0]) == 1 << 2  # only EOS after EOS
    with pytest.raises(RejectedTokenError, match="finished"):
        g.advance(0)
    light = g.copy(history=False)  # the same state and masks, no way back
    assert light.state == g.state and light.eos_accepted and light.num_tokens == 0
    light_mask = np.zeros((1, 1), dtype=np.int32)
    light.fill_mask(light_mask)
    assert int(light_mask[0, 0]) == int(mask[0, 0])
    with pytest.raises(ValueError, match="cannot roll back 1 tokens"):
        light.rollback(1)
    g.rollback(2)
    assert g.state == index.start and g.num_tokens == 0 and not g.eos_accepted
    with pytest.raises(ValueError, match="cannot roll back 1 tokens"):
        g.rollback(1)


def test_batch_fill_equals_per_guide_fill() -> None:
    vocab = tiny_vocab()
    index = cfsm.compile_regex(PATTERNS[1], vocab)
    guides = [Guide(index) for _ in range(3)]
    guides[1].advance(vocab.tokens.index(b'{"'))
    out = np.zeros((4, vocab.mask_words), dtype=np.int32)
    cfsm.fill_next_token_bitmasks(guides, out, rows=[3, 0, 1])
    ref = np.zeros_like(out)
    for g, r in zip(guides, [3, 0, 1], strict=True):
        g.fill_mask(ref, r)
    assert np.array_equal(out, ref) and out[1].any()


def test_jump_forward_returns_the_forced_string() -> None:
    vocab = tiny_vocab()
    index = cfsm.compile_regex(r'\{"name":"[a-z]+","age":[0-9]\}', vocab)
    g = Guide(index)
    assert g.jump_forward() == '{"name":"'
    plan = cfsm.plan_jump_forward([], '{"name":"', vocab, _encoder(vocab))
    g.apply_jump(plan)
    assert vocab.decode(list(plan.token_ids)) == b'{"name":"'
    g.advance(vocab.tokens.index(b"ab"))
    assert g.jump_forward() is None  # a letter or the closing quote
    g.advance(vocab.tokens.index(b'"'))
    assert g.jump_forward() == ',"age":'


def test_retokenization_rolls_back_to_the_canonical_split() -> None:
    vocab = tiny_vocab()
    # text so far "ab" as two tokens; forced "c": the tokenizer prefers "abc" as one token
    a, b = vocab.tokens.index(b"a"), vocab.tokens.index(b"b")
    plan = cfsm.plan_jump_forward([a, b], "c", vocab, _encoder(vocab))
    assert plan.num_rollback == 2 and plan.token_ids == (vocab.tokens.index(b"abc"),)


def test_vocabulary_validation() -> None:
    with pytest.raises(VocabularyError, match="at least one EOS"):
        Vocabulary([b"a"], [])
    with pytest.raises(VocabularyError, match="smaller than the number of tokens"):
        Vocabulary([b"a", b"b"], [0], size=1)
    with pytest.raises(VocabularyError, match="expected bytes"):
        Vocabulary(["a"], [0])  # type: ignore[list-item]
    assert Vocabulary([b"a"], [0]).fingerprint != Vocabulary([b"b"], [0]).fingerprint


def test_compiler_lru_and_disk_cache(tmp_path) -> None:
    vocab = tiny_vocab()
    comp = Compiler(vocab, CfsmConfig(cache_size=1, cache_dir=str(tmp_path)))
    a = comp.compile_regex("[0-9]+")
    assert comp.compile_regex("[0-9]+") is a and comp.hits == 1
    comp.compile_regex("[a-z]+")  # evicts the first from memory
    again = Compiler(vocab, CfsmConfig(cache_dir=str(tmp_path))).compile_regex("[0-9]+")
    assert again is not a
    for name in ("masks", "mask_row"):
        assert np.array_equal(getattr(a, name), getattr(again, name))
    assert len(list(tmp_path.iterdir())) == 2


def test_compiler_keys_schema_cache_by_config() -> None:
    vocab = tiny_vocab()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact = Compiler(vocab, CfsmConfig(whitespace="compact"))
    flexible = Compiler(vocab, CfsmConfig())  # the default
    a, b = compact.compile_json_schema(schema), flexible.compile_json_schema(schema)
    # the same schema as JSON text (other spacing) is the same cache entry
    assert compact.compile_json_schema(json.dumps(schema, indent=2)) is a and compact.hits == 1
    assert a is not b
    assert b.dfa.fullmatch(b'{ "a" : 1 }') and not a.dfa.fullmatch(b'{ "a" : 1 }')


def test_padded_logits_width_and_any_value_json() -> None:
    vocab = Vocabulary([b"", b"1", b"[", b"]", b","], [0], size=70)  # logits wider than the tokenizer
    index = cfsm.compile_json_object(vocab, CfsmConfig(json_depth=1), object_only=False)
    g = Guide(index)
    mask = np.zeros((1, vocab.mask_words), dtype=np.int32)
    g.fill_mask(mask)
    assert vocab.mask_words == 3 and g.allowed_token_ids().tolist() == [1, 2]
    assert not any((int(mask[0, t // 32]) >> (t % 32)) & 1 for t in range(5, 96))  # padding never allowed
    g.advance_many([2, 1, 4, 1, 3])
    assert g.can_stop()


def test_jump_forward_is_none_inside_a_utf8_character() -> None:
    vocab = Vocabulary([b"", b"\xc3", b"\xa9", "é".encode(), b"x"], [0])
    index = cfsm.compile_regex("éx", vocab)
    g = Guide(index)
    assert g.jump_forward() == "éx"
    g.advance(1)  # half of "é"
    assert g.jump_forward() is None  # the forced bytes start mid-character
    g.advance(2)
    assert g.jump_forward() == "x"


def test_escape_states_of_a_counted_string_share_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    # every counter value of a bounded JSON string has its own "after a backslash" state; they
    # share one candidate split (cached) and must still match the naive walk exactly
    import cfsm.masks.walker

    calls: list[int] = []
    real = cfsm.masks.walker.Walker._candidates

    def spy(self, allowed, chained, outside, utf8):  # type: ignore[no-untyped-def]
        calls.append(len(self._cand))
        return real(self, allowed, chained, outside, utf8)

    monkeypatch.setattr(cfsm.masks.walker.Walker, "_candidates", spy)
    # walk even small candidate sets this way; as in a large vocabulary: escapes are not broad
    config = cfsm.CfsmConfig(tuning=cfsm.IndexTuning(walk_tiny=4, walk_tiny_python=4, walk_broad=0.9,
                                                     tiny_states=0))
    rng = random.Random(7)
    alphabet = list('abfnrtu019"\\/ ') + ["é"]
    toks = {"".join(rng.choice(alphabet) for _ in range(rng.choice([1, 2, 3, 5]))).encode() for _ in range(900)}
    tokens = [b""] + sorted(toks)
    vocab = Vocabulary(tokens, [0])
    index = cfsm.compile_regex(r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}){0,9}"', vocab, config)
    _check_index_against_oracle(index)
    assert len(calls) >= 5 and max(calls) >= 1  # the split was reused by later counter values


@pytest.mark.parametrize("batch_pairs", [1, 97])
def test_few_candidate_states_walked_in_small_batches(batch_pairs: int) -> None:
    # batches cut between states (1 pair: one state per batch) give the naive walk's masks
    import cfsm.masks.walker

    config = cfsm.CfsmConfig(tuning=cfsm.IndexTuning(walk_batch_pairs=batch_pairs, tiny_states=0))
    _check_index_against_oracle(cfsm.compile_regex(PATTERNS[1], _random_vocab(3, 600), config))
