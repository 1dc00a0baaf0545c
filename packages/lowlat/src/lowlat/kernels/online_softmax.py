"""Online softmax (flash attention's running max and sum) as Triton device functions, shared by lowlat's attention
kernels: the per-stage split-KV decode attention and its merges (``layer``), the verify-rows attention
(``rows_attn``) and the persistent kernel's attention and merge tasks (``persistent``).

Scores are in natural-log units (q.k * scale), so the exponentials are ``tl.exp`` and a split's log-sum-exp is
``m + log(l)`` (the partials' ``part_lse`` buffers hold these; every producer and consumer is here). A query row's
state is its running max ``m`` (-inf before any score) and running sum ``l`` of exp(score - m); the caller keeps the
weighted value sum ``acc`` and rescales it by the ``alpha`` a step returns. Masked scores are -inf: they weigh 0.
A split ends as a partial (acc / l, m + log l), or (0, -inf) for a row that saw no key; partials of one row merge by
their log-sum-exps. Reference: ``lowlat.reference`` (float64 softmax attention), through the kernels' tests.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["merge_partials", "softmax_step", "split_partial"]


@triton.jit
def softmax_step(m_i, l_i, s, GUARD: tl.constexpr):
    """Adds the scores ``s`` (rows, cols; masked ones -inf) to the rows' state (``m_i``, ``l_i``). Returns (m, l, p,
    alpha): the new state, the block's weights p = exp(s - m) and alpha = exp(m_i - m), by which the caller rescales
    its value sum before adding p @ v. GUARD: a row whose scores so far are all -inf keeps (m, l) = (-inf, 0) and
    gets p = alpha = 0 (its exponentials taken against 0 instead of -inf); without it such a row gets NaN, so callers
    whose every row has a key in its first block (decode rows) leave it off: the same values, two fewer operations
    per row and block (the decode attention at batch 1 on the H200 measured 3-5% slower with it, RESULTS.md)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def split_partial(acc, m_i, l_i, v_scale):
    """A split's partial (out, lse) of rows: acc * (v_scale / l) and m + log(l), or (0, -inf) for a row without keys
    (l == 0), which then weighs nothing in ``merge_partials``. ``v_scale``: an FP8 cache's value scale, else 1.0."""
    empty = l_i == 0.0
    safe_l = tl.where(empty, 1.0, l_i)
    out = acc * (v_scale / safe_l)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(safe_l))
    return out, lse


@triton.jit
def merge_partials(part, lse, AXIS: tl.constexpr):
    """Results from partials ``part`` and their log-sum-exps ``lse`` (``part``'s shape without its last axis, the
    head dim), merged over ``AXIS``, the splits axis (``lse``'s last): (S, D) with (S,) and AXIS 0 gives (D,);
    (G, S, D) with (G, S) and AXIS 1 gives (G, D). Splits with lse -inf weigh 0; at least one split has keys."""
    mx = tl.max(lse, AXIS, keep_dims=True)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - mx))
    w = tl.expand_dims(w, AXIS + 1)
    return tl.sum(w * part, AXIS) / tl.sum(w, AXIS)
