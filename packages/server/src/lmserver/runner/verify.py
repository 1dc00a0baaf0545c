"""Exact acceptance of draft tokens against the target model's rows.

A verify forward gives, for a request with drafts d1..dk after its last token, k + 1 rows of
logits: row j is the target's distribution of the token after d_j (row 0: after the last
token). The emitted tokens are t0..ta, where a drafts were accepted and t_a is the target's own
next token (the "bonus"), so every step emits at least one token.

- greedy: d_j is accepted while it equals row (j-1)'s argmax; t_a is row a's argmax. The output
  is token for token the output without speculation.
- sampling (temperature > 0): rejection sampling against a deterministic draft (the draft
  distribution q is a point mass on d_j): accept d_j with probability p_{j-1}(d_j); on the first
  rejection emit a sample of p_{j-1} with d_j removed (the residual (p - q)+, renormalized);
  when all are accepted emit a sample of p_k. Each emitted token is then distributed exactly as
  the target's (Leviathan et al. 2023, Chen et al. 2023). p is the request's filtered
  distribution (temperature, top-k, top-p, min-p: `sampler.filtered_probs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(targets: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The emitted tokens for `targets` (k + 1 argmax ids, row order) and `drafts` (k ids)."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target rows, got {len(targets)}")
    out = []
    for j, draft in enumerate(drafts):
        out.append(int(targets[j]))
        if targets[j] != draft:
            return out
    out.append(int(targets[-1]))
    return out


def accept_sampled(probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator) -> list[int]:
    """The emitted tokens for target distributions `probs` (k + 1, V) float rows (host or
    device) and deterministic `drafts`; draws uniforms from `generator` (CPU). Pure otherwise."""
    if probs.shape[0] != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target rows, got {probs.shape[0]}")
    rows = probs.detach().to("cpu", torch.float64)
    out: list[int] = []
    for j, draft in enumerate(drafts):
        p = rows[j]
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u < float(p[draft]):
            out.append(int(draft))
            continue
        residual = p.clone()
        residual[draft] = 0.0
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(rows[-1], generator))
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """A sample of the unnormalized float64 `weights` (V,), by the inverse CDF."""
    cdf = weights.cumsum(0)
    total = float(cdf[-1])
    if total <= 0.0:  # nothing left (p was a point mass on the rejected draft): cannot happen for u < p
        return int(weights.argmax())
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * total
    pick = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
    pick = min(pick, weights.shape[0] - 1)
    while weights[pick] <= 0.0 and pick > 0:  # rounding at the end of the CDF: the last kept token
        pick -= 1
    return pick
