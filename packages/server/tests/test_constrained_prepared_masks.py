"""BatchMasker's two phases (`prepare` while the forward runs, `apply` at sampling) on the torch
path: a prepared mask is used only while every grammar is in the state it was filled from.

Oracles: each constrained row allows exactly the tokens its guide accepts at `apply` time
(`Guide.advance` on a copy, token by token), unconstrained rows are untouched, and the masked
logits equal the single-phase path (`apply` without `prepare`, the path before the split).
Between the phases the grammars move the ways the engine moves them (a sampled token, a
jump-forward, a rollback, another request in the row).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cfsm
from cfsm.testing import allowed_by_advance, tiny_vocab
from lmserver.engine.constrained import BatchMasker, ReqGrammar

VOCAB = tiny_vocab()  # 140 tokens: the last mask word is partial
PATTERNS = [r'\{"name":"[a-c]+","age":[0-9]{1,3}\}', r"(true|false|null)", r"ip 10\.[0-9]\.0\.[0-9]", r"[a-c]+x?"]
INDEXES = [cfsm.compile_regex(p, VOCAB) for p in PATTERNS]
EOS = set(VOCAB.eos_token_ids)
BYTE_TOKEN = {t: i for i, t in enumerate(VOCAB.tokens) if len(t) == 1 and i not in VOCAB.special_token_ids}


def _encode(text: str) -> list[int]:
    return [BYTE_TOKEN[bytes([b])] for b in text.encode()]




def _step(g: ReqGrammar, rng: random.Random) -> bool:
    """Accepts one random allowed non-EOS token; False when there is none."""
    choices = sorted(allowed_by_advance(g.guide, VOCAB.size) - EOS)
    if not choices:
        return False
    assert g.accept(rng.choice(choices))
    return True


def _grammar(pattern: int, walk: int, rng: random.Random) -> ReqGrammar:
    g = ReqGrammar(INDEXES[pattern], _encode)
    for _ in range(walk):
        if not _step(g, rng):
            break
    return g


def _move(g: ReqGrammar, how: str, rng: random.Random) -> ReqGrammar:
    """Moves `g` as the engine would between two samplings; returns the row's grammar after."""
    if how == "token":
        _step(g, rng)
    elif how == "rollback" and g.guide.num_tokens:
        g.guide.rollback(1)
    elif how == "jump":
        jump = g.plan_jump([], 64)  # no sampled tokens to merge with: the forced text's tokens
        if jump is not None:
            g.apply_jump(jump)
    elif how == "other_request":  # a different request in this row, in the same state
        other = ReqGrammar(g.index, _encode)
        other.guide = g.guide.copy()
        return other
    return g


def _check_rows(got: torch.Tensor, before: torch.Tensor, grammars: list[ReqGrammar | None]) -> None:
    for i, g in enumerate(grammars):
        if g is None:
            assert torch.equal(got[i], before[i])
            continue
        finite = set(torch.nonzero(torch.isfinite(got[i])).flatten().tolist())
        assert finite == allowed_by_advance(g.guide, VOCAB.size), (i, g.guide.state)
        kept = sorted(finite)
        assert torch.equal(got[i, kept], before[i, kept])


row_st = st.one_of(st.none(), st.tuples(st.integers(0, len(PATTERNS) - 1), st.integers(0, 6)))
move_st = st.sampled_from(["none", "none", "token", "rollback", "jump", "other_request"])


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(row_st, move_st), min_size=1, max_size=7), seed=st.integers(0, 2**16))
def test_prepared_mask_is_used_only_for_unchanged_states(rows: list[tuple[tuple[int, int] | None, str]],
                                                         seed: int) -> None:
    rng = random.Random(seed)
    grammars = [None if r is None else _grammar(r[0], r[1], rng) for r, _ in rows]
    masker = BatchMasker(VOCAB.size)
    masker.prepare(grammars, "cpu")
    assert masker.pending == any(g is not None for g in grammars)
    keys = [None if g is None else g.mask_key() for g in grammars]
    after = [None if g is None else _move(g, how, rng) for g, (_, how) in zip(grammars, rows, strict=True)]
    moved = sum(1 for k, g in zip(keys, after, strict=True)
                if g is not None and k is not None and (k[0] is not g.index or k[1:] != g.mask_key()[1:]))
    logits = torch.randn(len(rows), VOCAB.size, generator=torch.Generator().manual_seed(seed))
    got = masker.apply(logits.clone(), after)
    assert not masker.pending
    _check_rows(got, logits, after)
    assert torch.equal(got, BatchMasker(VOCAB.size).apply(logits.clone(), after))  # the single-phase path
    if any(g is not None for g in after):
        assert masker.num_stale_rows == moved
        assert masker.num_prepared_used == (1 if moved == 0 else 0)
        assert masker.num_masked_rows == sum(g is not None for g in after)


def test_prepare_then_apply_counts_and_a_jump_between_refills() -> None:
    rng = random.Random(0)
    g1, g2 = _grammar(0, 3, rng), _grammar(2, 0, rng)  # g2 at the start: "ip 10." is forced
    batch: list[ReqGrammar | None] = [g1, None, g2]
    masker = BatchMasker(VOCAB.size)
    logits = torch.randn(3, VOCAB.size, generator=torch.Generator().manual_seed(1))
    masker.prepare(batch, torch.device("cpu"))
    got = masker.apply(logits.clone(), batch)
    _check_rows(got, logits, batch)
    assert (masker.num_prepared_used, masker.num_stale_rows, masker.num_masked_rows) == (1, 0, 2)
    assert masker.prepare_time_s > 0 and masker.apply_time_s > 0
    assert masker.mask_time_s == masker.prepare_time_s + masker.apply_time_s
    # a jump-forward (the re-prefill of an extend) after the fill: the row is refilled at apply
    masker.prepare(batch, "cpu")
    before = g2.mask_key()
    jump = g2.plan_jump([], 64)
    assert jump is not None and jump.text.startswith("ip 10.")
    g2.apply_jump(jump)
    assert g2.mask_key() != before
    got = masker.apply(logits.clone(), batch)
    _check_rows(got, logits, batch)
    assert (masker.num_prepared_used, masker.num_stale_rows) == (1, 1)
    # another batch (rows added) than the prepared one: filled again, not counted as stale rows
    masker.prepare(batch, "cpu")
    bigger = [*batch, g1]
    got = masker.apply(torch.cat([logits, logits[:1]]).clone(), bigger)
    _check_rows(got, torch.cat([logits, logits[:1]]), bigger)
    assert (masker.num_prepared_used, masker.num_stale_rows) == (1, 1)
    # apply without prepare: the single-phase path
    got = masker.apply(logits.clone(), batch)
    _check_rows(got, logits, batch)
    assert masker.num_prepared_used == 1


def test_unconstrained_batch_prepares_nothing() -> None:
    masker = BatchMasker(VOCAB.size)
    masker.prepare([None, None], "cpu")
    assert not masker.pending
    logits = torch.randn(2, VOCAB.size)
    assert torch.equal(masker.apply(logits.clone(), [None, None]), logits)
    assert masker.num_masked_rows == 0
    with pytest.raises(ValueError, match="columns"):
        masker.apply(torch.zeros(1, VOCAB.size + 1), [_grammar(1, 0, random.Random(0))])


@pytest.mark.gpu
def test_prepared_cuda_mask_equals_cpu_mask() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng = random.Random(3)
    gpu_masker = BatchMasker(VOCAB.size)
    constrained = 0
    for step in range(6):  # reuses the pinned and device buffers across steps, batch sizes vary
        batch = [None if rng.random() < 0.3 else _grammar(rng.randrange(len(PATTERNS)), rng.randrange(5), rng)
                 for _ in range(1 + step % 4)]
        logits = torch.randn(len(batch), VOCAB.size, generator=torch.Generator().manual_seed(step))
        ref = BatchMasker(VOCAB.size).apply(logits.clone(), batch)
        constrained += any(g is not None for g in batch)
        gpu_masker.prepare(batch, "cuda")
        got = gpu_masker.apply(logits.cuda(), batch).cpu()
        assert torch.equal(got, ref), step
    assert gpu_masker.num_stale_rows == 0
    assert gpu_masker.num_prepared_used == constrained  # every step used its prepared mask
