"""Draft sources and acceptance rules of speculative decoding, against naive models.

- NgramIndex.propose equals a brute-force search for the latest earlier occurrence of the
  longest suffix (hypothesis, incremental growth).
- accept_greedy is the longest prefix of drafts equal to the targets, plus one target token.
- accept_sampled emits sequences distributed exactly as the target's: speculative runs over a
  context-independent "model" (a fixed distribution per position) are compared with direct
  sampling by a chi-square test on the first two tokens and the third's marginal.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.runner.ngram import NgramIndex
from lmserver.runner.verify import accept_greedy, accept_sampled


def naive_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    n_tok = len(tokens)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = tokens[n_tok - n :]
        for start in range(n_tok - n - 1, -1, -1):  # occurrences ending at index <= n_tok - 2, latest first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : min(start + n + k, n_tok)]
    return []


@given(st.lists(st.integers(0, 4), min_size=0, max_size=60), st.integers(1, 3), st.integers(0, 3),
       st.integers(1, 6), st.lists(st.integers(1, 8), min_size=1, max_size=6))
@settings(max_examples=300, deadline=None)
def test_ngram_index_equals_brute_force(tokens: list[int], min_n: int, extra: int, k: int, cuts: list[int]) -> None:
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n)
    end = 0
    for cut in [*cuts, len(tokens)]:  # the same index, asked as the sequence grows
        end = min(len(tokens), end + cut)
        assert index.propose(tokens[:end], k) == naive_propose(tokens[:end], k, min_n, max_n)


def test_ngram_index_refuses_bad_sizes_and_shrinking() -> None:
    with pytest.raises(ValueError):
        NgramIndex(0, 2)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
    index = NgramIndex(1, 2)
    assert index.propose([1, 2, 3, 1, 2], 3) == [3, 1, 2]
    with pytest.raises(ValueError, match="shrank"):
        index.propose([1, 2], 3)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=8), st.data())
def test_accept_greedy_is_the_matching_prefix_plus_one(targets: list[int], data: st.DataObject) -> None:
    drafts = data.draw(st.lists(st.integers(0, 3), min_size=len(targets) - 1, max_size=len(targets) - 1))
    out = accept_greedy(targets, drafts)
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    assert out == targets[: a + 1]


def _chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (regularized upper gamma, series)."""
    s, z = df / 2.0, x / 2.0
    term = total = 1.0 / s
    for i in range(1, 500):
        term *= z / (s + i)
        total += term
    lower = math.exp(s * math.log(z) - z - math.lgamma(s)) * total
    return max(0.0, 1.0 - lower)


def _speculative_tokens(probs: torch.Tensor, drafts_of, gen: torch.Generator, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """n tokens of a run whose distribution at position i is probs[i], drafting with drafts_of(pos)."""
    out: list[int] = []
    while len(out) < n:
        pos = len(out)
        drafts = drafts_of(pos)[: probs.shape[0] - pos - 1]
        out.extend(accept_sampled(probs[pos : pos + len(drafts) + 1], drafts, gen))
    return out[:n]


@pytest.mark.parametrize("draft_kind", ["likely", "unlikely", "mixed"])
def test_accept_sampled_matches_the_target_distribution(draft_kind: str) -> None:
    torch.manual_seed(0)
    vocab, draws = 4, 12000
    probs = torch.softmax(torch.randn(6, vocab, dtype=torch.float64) * 1.5, dim=-1)
    best = probs.argmax(dim=-1).tolist()
    worst = probs.argmin(dim=-1).tolist()

    def drafts_of(pos: int) -> list[int]:
        picks = {"likely": best, "unlikely": worst, "mixed": [best[i] if i % 2 else worst[i] for i in range(6)]}
        return picks[draft_kind][pos + 1 : pos + 4]

    gen = torch.Generator().manual_seed(1)
    pairs: Counter[tuple[int, int]] = Counter()
    thirds: Counter[int] = Counter()
    accepted = 0
    for _ in range(draws):
        seq = _speculative_tokens(probs, drafts_of, gen, 3)
        pairs[(seq[0], seq[1])] += 1
        thirds[seq[2]] += 1
    p = probs.tolist()
    chi2 = sum((pairs[(a, b)] - draws * p[0][a] * p[1][b]) ** 2 / (draws * p[0][a] * p[1][b])
               for a in range(vocab) for b in range(vocab))
    assert _chi2_sf(chi2, vocab * vocab - 1) > 1e-3, chi2
    chi2_3 = sum((thirds[c] - draws * p[2][c]) ** 2 / (draws * p[2][c]) for c in range(vocab))
    assert _chi2_sf(chi2_3, vocab - 1) > 1e-3, chi2_3
    # and the test can fail: plain "take the draft" output is far from the target
    naive = Counter(drafts_of(-1)[0] for _ in range(draws))
    chi2_naive = sum((naive[c] - draws * p[0][c]) ** 2 / (draws * p[0][c]) for c in range(vocab))
    assert _chi2_sf(chi2_naive, vocab - 1) < 1e-6
    del accepted


def test_accept_sampled_point_masses_and_shapes() -> None:
    gen = torch.Generator().manual_seed(0)
    probs = torch.zeros(3, 5, dtype=torch.float64)
    probs[0, 2] = probs[1, 4] = probs[2, 1] = 1.0
    assert accept_sampled(probs, [2, 4], gen) == [2, 4, 1]  # certain drafts: always accepted, then the bonus
    assert accept_sampled(probs, [3, 4], gen) == [2]  # impossible draft: rejected, the residual is p's mass
    with pytest.raises(ValueError):
        accept_sampled(probs, [1], gen)
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


def test_metrics_mirror_the_acceptance_and_multimodal_stats() -> None:
    from lmserver.edge.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.update_core_stats({"spec_accept_length": 2.5, "spec_accept_rate": 0.375, "mm_radix_hit_rate": 0.8,
                               "mm_encoder_cache_hit_rate": 0.25})
    lines = set(metrics.render().decode().splitlines())
    for line in ("lmserver_spec_accept_length 2.5", "lmserver_spec_accept_rate 0.375",
                 "lmserver_mm_radix_hit_rate 0.8", "lmserver_mm_encoder_cache_hit_rate 0.25"):
        assert line in lines


@given(st.lists(st.integers(0, 5), max_size=8), st.lists(st.integers(0, 5), max_size=8),
       st.integers(-10, 20), st.integers(-10, 20), st.integers(1, 6))
def test_prompt_plus_output_view_equals_the_concatenation(a: list[int], b: list[int], i: int, j: int, k: int) -> None:
    from lmserver.engine.speculative import _Tokens

    view, full = _Tokens(a, b), a + b
    assert len(view) == len(full) and view[i:j] == full[i:j] and list(view) == full
    assert NgramIndex(1, 3).propose(view, k) == naive_propose(full, k, 1, 3)
