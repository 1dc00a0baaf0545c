"""Sampling: a fused Triton softmax + top-k/top-p/min-p filter, then an exact draw in torch.

Choice (documented in kernels/README.md): the kernel turns logits into the filtered,
renormalized distribution without sorting the vocabulary. Each filter is a probability
threshold: min-p's is `min_p * max_prob`; top-k's is the k-th largest probability; top-p's is
the probability of the token that makes the sorted mass reach `top_p`. Both searched
thresholds are found exactly by a multi-pivot bisection over the float32 bit patterns (positive
floats sort like their bits): each pass over the row tests `NUM_PIVOTS` candidates at once, so
about eight passes settle 31 bits. The kept set is `p >= max(thresholds)`, which is the sort
based reference's set except that tokens tied with the threshold are all kept.

The draw is `argmax(probs / Exponential(1))` (the exponential race, equivalent to sampling
from `probs`), done with torch's generator: reproducible under `torch.manual_seed`, free of
host syncs and capturable in a CUDA graph, unlike an in-kernel RNG with its own seed plumbing.
Reference: `reference.top_k_top_p_min_p_probs_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError, check_last_dim_contiguous

__all__ = ["sample_from_probs", "top_k_top_p_min_p_probs"]


@triton.jit
def _mass_or_count_at(row_ptr, vocab, cand, IS_MASS: tl.constexpr, NUM_PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
    """For each candidate threshold (float32 bits), the count (or mass) of probs >= it."""
    thresholds = cand.to(tl.float32, bitcast=True)  # (NUM_PIVOTS,)
    total = tl.zeros([NUM_PIVOTS], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p = tl.load(row_ptr + offs, mask=offs < vocab, other=-1.0)
        hit = p[None, :] >= thresholds[:, None]  # (NUM_PIVOTS, BLOCK)
        if IS_MASS:
            total += tl.sum(tl.where(hit, p[None, :], 0.0), 1)
        else:
            total += tl.sum(hit.to(tl.float32), 1)
    return total


@triton.jit
def _search(row_ptr, vocab, lo, hi, target, IS_MASS: tl.constexpr, NUM_PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
    """Largest float32 bit pattern b in [lo, hi) with f(b) >= target, given f(lo) >= target
    and f(hi) < target, where f is the count (or mass) of probs >= float(b)."""
    pivots = tl.arange(0, NUM_PIVOTS)
    while hi - lo > 1:
        step = tl.maximum((hi - lo) // (NUM_PIVOTS + 1), 1)
        cand = tl.minimum(lo + step * (pivots + 1), hi - 1)  # (NUM_PIVOTS,) increasing
        ok = _mass_or_count_at(row_ptr, vocab, cand, IS_MASS, NUM_PIVOTS, BLOCK) >= target
        lo = tl.maximum(lo, tl.max(tl.where(ok, cand, lo), 0))
        hi = tl.minimum(hi, tl.min(tl.where(ok, hi, cand), 0))
    return lo


@triton.jit
def _filter_kernel(
    logits_ptr, out_ptr, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
    stride_l, stride_o, vocab,
    NUM_PIVOTS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_l
    out_row = out_ptr + row * stride_o
    inv_t = 1.0 / tl.load(temperatures_ptr + row).to(tl.float32)
    top_k = tl.load(top_ks_ptr + row).to(tl.int32)
    top_p = tl.load(top_ps_ptr + row).to(tl.float32)
    min_p = tl.load(min_ps_ptr + row).to(tl.float32)

    # Softmax statistics (online max and sum), then the probabilities into `out`.
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(logits_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, x)
        s = s * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    row_max = tl.max(m, 0)
    z = tl.sum(s * tl.exp(m - row_max), 0)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(logits_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
        tl.store(out_row + offs, tl.exp(x - row_max) / z, mask=offs < vocab)

    # Thresholds as float32 bit patterns; the most probable token always stays.
    p_max = 1.0 / z
    hi = p_max.to(tl.int32, bitcast=True) + 1
    lo = (min_p * p_max).to(tl.int32, bitcast=True)
    if (top_k > 0) & (top_k < vocab):
        count_lo = tl.sum(_mass_or_count_at(out_row, vocab, tl.full([NUM_PIVOTS], 0, tl.int32) + lo, False, NUM_PIVOTS, BLOCK), 0) / NUM_PIVOTS
        if count_lo >= top_k.to(tl.float32):
            lo = _search(out_row, vocab, lo, hi, top_k.to(tl.float32), False, NUM_PIVOTS, BLOCK)
    if top_p < 1.0:
        mass_lo = tl.sum(_mass_or_count_at(out_row, vocab, tl.full([NUM_PIVOTS], 0, tl.int32) + lo, True, NUM_PIVOTS, BLOCK), 0) / NUM_PIVOTS
        if mass_lo >= top_p:
            lo = _search(out_row, vocab, lo, hi, top_p, True, NUM_PIVOTS, BLOCK)
    threshold = lo.to(tl.float32, bitcast=True)

    kept = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p = tl.load(out_row + offs, mask=offs < vocab, other=0.0)
        kept += tl.where(p >= threshold, p, 0.0)
    inv_kept = 1.0 / tl.sum(kept, 0)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p = tl.load(out_row + offs, mask=offs < vocab, other=0.0)
        tl.store(out_row + offs, tl.where(p >= threshold, p * inv_kept, 0.0), mask=offs < vocab)


def top_k_top_p_min_p_probs(
    logits: torch.Tensor,  # (bs, vocab)
    temperatures: torch.Tensor,  # (bs,) > 0 (greedy rows take argmax instead)
    top_ks: torch.Tensor,  # (bs,) int; <= 0 or >= vocab disables
    top_ps: torch.Tensor,  # (bs,) in (0, 1]; 1 disables
    min_ps: torch.Tensor,  # (bs,) in [0, 1); 0 disables
    out: torch.Tensor | None = None,  # (bs, vocab) float32
    block: int = 1024,
    num_pivots: int = 16,
) -> torch.Tensor:
    """The filtered, renormalized sampling distribution of each row; returns `out`.

    Mutates `out` only (allocated when None). Per-row parameters stay on the device: no sync.
    """
    if logits.dim() != 2:
        raise KernelInputError(f"expected logits (bs, vocab), got {tuple(logits.shape)}")
    bs, vocab = logits.shape
    for name, t in (("temperatures", temperatures), ("top_ks", top_ks), ("top_ps", top_ps), ("min_ps", min_ps)):
        if t.shape != (bs,) or t.device != logits.device:
            raise KernelInputError(f"{name} must be ({bs},) on {logits.device}, got {tuple(t.shape)} on {t.device}")
    if out is None:
        out = torch.empty(bs, vocab, dtype=torch.float32, device=logits.device)
    elif out.shape != (bs, vocab) or out.dtype != torch.float32:
        raise KernelInputError(f"out must be float32 ({bs}, {vocab}), got {out.dtype} {tuple(out.shape)}")
    check_last_dim_contiguous(logits=logits, out=out)
    if bs:
        _filter_kernel[(bs,)](
            logits, out, temperatures, top_ks, top_ps, min_ps,
            logits.stride(0), out.stride(0), vocab,
            NUM_PIVOTS=num_pivots, BLOCK=block, num_warps=8,
        )
    return out


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of probs (bs, vocab), drawn exactly from each row's distribution by
    the exponential race. Returns (bs,) int64; mutates nothing (draws from `generator`)."""
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.float() / noise).argmax(dim=-1)
