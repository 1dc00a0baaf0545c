"""Online softmax (flash attention's running max and sum), shared by the attention kernels
(`decode_attention`, `extend_attention`, `cascade_decode`) as Triton device functions.

Scores are in log2 units (q.k * scale * log2(e)), so every exponential is `exp2`. A row's state
is its running max `m` (-inf before any score) and its running sum `l` of exp2(score - m); the
caller keeps the weighted value sum `acc` and rescales it by the `alpha` a step returns. A split
of the keys ends as a partial (acc / l, its log-sum-exp m + log2 l); partials of one row merge by
their log-sum-exps. Masked scores are -inf: they weigh exp2(-inf) = 0. Reference:
`reference.decode_attention_ref` / `extend_attention_ref` (float64 softmax), through the kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["merge_partials", "online_softmax_step", "split_partial"]


@triton.jit
def online_softmax_step(m_i, l_i, qk):
    """Adds the scores `qk` (rows, cols) to the rows' state (`m_i`, `l_i`). Returns (m, l, p,
    alpha): the new state, the block's weights p = exp2(qk - m) and alpha = exp2(m_i - m), by
    which the caller rescales its value sum before adding p @ v. A row whose scores so far are all
    -inf gets NaN weights (exp2(-inf - -inf)): callers give every row a finite score in its first
    block or mask the row's result out."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def split_partial(acc, m_i, l_i, has_work):
    """A split's partial (out, lse): acc / l and m + log2(l), or (0, -inf) for a split without
    keys (`has_work` false), which then weighs nothing in `merge_partials`."""
    safe_l = tl.where(has_work, l_i, 1.0)
    out = tl.where(has_work, acc / safe_l[:, None], 0.0)
    lse = tl.where(has_work, m_i + tl.log2(safe_l), float("-inf"))
    return out, lse


@triton.jit
def merge_partials(part, lse):
    """One row's result from its partials `part` (splits, dim) and their log-sum-exps `lse`
    (splits,); masked-out splits carry lse -inf (weight 0). At least one split has keys."""
    w = tl.exp2(lse - tl.max(lse, 0))
    return tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
