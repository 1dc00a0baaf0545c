"""Sampling: Triton softmax + top-k/top-p/min-p filter over row chunks, then an exact draw in torch.

Choice (see kernels/README.md): the kernels turn logits into the filtered, renormalized
distribution without sorting the vocabulary. Every filter is a probability threshold: min-p's
is `min_p * p_max`; top-k's is the k-th largest probability; top-p's is the probability of the
token whose sorted mass first reaches `top_p`. The two searched thresholds are found exactly
by bisection over float32 bit patterns (positive floats sort like their bits), `NUM_PIVOTS`
candidates per pass, a fixed number of passes (so the launch sequence is static and can be
captured in a CUDA graph). Tokens tied with the threshold are all kept; the sort-based
reference keeps an arbitrary subset of such ties.

Each row is split into chunks of `CHUNK` tokens, one program per (row, chunk), so a single row
fills many multiprocessors. Passes communicate through small per-chunk partials, never atomics:
every program of a row re-reduces the previous pass's partials in the same order, so all of
them agree on the bisection state and the result is deterministic.

Launches: chunk softmax statistics; the search passes (none when neither top-k nor top-p is
asked for, one to measure the kept mass; `num_passes` per active search); the write.
The draw is `argmax(probs / Exponential(1))` (the exponential race), with torch's generator.
Reference: `reference.top_k_top_p_min_p_probs_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError, check_last_dim_contiguous, next_pow2

__all__ = ["sample_from_probs", "top_k_top_p_min_p_probs"]

# Modes of the previous pass / of a search.
_NONE, _COUNT, _MASS = 0, 1, 2
_HI_BITS = 0x3F800000 + 16  # float32 bits of 1.0, plus a margin of 16 ulps


@triton.jit
def _row_stats(stats_ptr, row, num_chunks, BLOCK_C: tl.constexpr):
    """(max, sum of exp(x - max)) of a row from its chunks' partials."""
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    m_c = tl.load(stats_ptr + (row * num_chunks + offs) * 2, mask=mask, other=float("-inf"))
    s_c = tl.load(stats_ptr + (row * num_chunks + offs) * 2 + 1, mask=mask, other=0.0)
    m = tl.max(m_c, 0)
    z = tl.sum(tl.where(m_c == float("-inf"), 0.0, s_c * tl.exp(m_c - m)), 0)
    return m, z


@triton.jit
def _candidates(lo, hi, NUM_PIVOTS: tl.constexpr):
    step = (hi - lo + NUM_PIVOTS - 1) // NUM_PIVOTS
    return tl.minimum(lo + step * tl.arange(0, NUM_PIVOTS), hi - 1)  # (NUM_PIVOTS,), [0] == lo


@triton.jit
def _resolve(
    state_ptr, count_ptr, mass_ptr, row, num_chunks, target,
    MODE: tl.constexpr, NUM_PIVOTS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Apply the previous pass: its state (lo, hi), its candidates' counts and masses -> new
    (lo, hi) and the mass of probs >= new lo."""
    lo = tl.load(state_ptr + row * 2)
    hi = tl.load(state_ptr + row * 2 + 1)
    cand = _candidates(lo, hi, NUM_PIVOTS)
    offs_c = tl.arange(0, BLOCK_C)
    offs_p = tl.arange(0, NUM_PIVOTS)
    idx = (row * num_chunks + offs_c[:, None]) * NUM_PIVOTS + offs_p[None, :]
    mask = (offs_c < num_chunks)[:, None]
    mass = tl.sum(tl.load(mass_ptr + idx, mask=mask, other=0.0), 0)  # (NUM_PIVOTS,)
    if MODE == 1:
        measure = tl.sum(tl.load(count_ptr + idx, mask=mask, other=0.0), 0)
    else:
        measure = mass
    ok = measure >= target
    ok0 = tl.sum(tl.where(offs_p == 0, ok.to(tl.int32), 0), 0) > 0
    searching = (hi - lo > 1) & ok0
    new_lo = tl.where(searching, tl.max(tl.where(ok, cand, lo), 0), lo)
    new_hi = tl.where(searching, tl.min(tl.where(ok, hi, cand), 0), lo + 1)
    kept_mass = tl.max(tl.where(cand == new_lo, mass, -1.0), 0)
    return new_lo, new_hi, kept_mass


@triton.jit
def _stats_kernel(logits_ptr, temperatures_ptr, stats_ptr, stride_l, vocab, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inv_t = 1.0 / tl.load(temperatures_ptr + row).to(tl.float32)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=offs < vocab, other=float("-inf"))
    x = x.to(tl.float32) * inv_t
    m = tl.max(x, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a chunk masked out entirely: s = 0
    s = tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - m_safe)), 0)
    tl.store(stats_ptr + (row * num_chunks + chunk) * 2, m)
    tl.store(stats_ptr + (row * num_chunks + chunk) * 2 + 1, s)


@triton.jit
def _pass_kernel(
    logits_ptr, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, stats_ptr,
    prev_state_ptr, prev_count_ptr, prev_mass_ptr, state_ptr, count_ptr, mass_ptr,
    stride_l, vocab, num_chunks,
    PREV: tl.constexpr, SEARCH: tl.constexpr, START: tl.constexpr,
    NUM_PIVOTS: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_C: tl.constexpr,
    HI_BITS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    m, z = _row_stats(stats_ptr, row, num_chunks, BLOCK_C)
    inv_z = 1.0 / z
    # NOTE: an exclusive upper bound for every p, a few ulps above 1.0: with FMA contraction the
    # largest p may exceed 1 / z (or even 1.0) by an ulp.
    hi_start = HI_BITS
    if PREV == 0:
        lo = (tl.load(min_ps_ptr + row).to(tl.float32) * inv_z).to(tl.int32, bitcast=True)
        hi = hi_start
    else:
        if PREV == 1:
            prev_target = tl.load(top_ks_ptr + row).to(tl.float32)
        else:
            prev_target = tl.load(top_ps_ptr + row).to(tl.float32)
        lo, hi, _ = _resolve(prev_state_ptr, prev_count_ptr, prev_mass_ptr, row, num_chunks, prev_target,
                             PREV, NUM_PIVOTS, BLOCK_C)
    if START:
        # A new search: from the previous threshold up to p_max, or nothing when the row
        # disables it (a (lo, lo + 1) state resolves to lo).
        if SEARCH == 1:
            k = tl.load(top_ks_ptr + row)
            hi = tl.where((k > 0) & (k < vocab), hi_start, lo + 1)
        elif SEARCH == 2:
            hi = tl.where(tl.load(top_ps_ptr + row).to(tl.float32) < 1.0, hi_start, lo + 1)
        else:
            hi = lo + 1
    if chunk == 0:
        tl.store(state_ptr + row * 2, lo)
        tl.store(state_ptr + row * 2 + 1, hi)

    thresholds = _candidates(lo, hi, NUM_PIVOTS).to(tl.float32, bitcast=True)
    inv_t = 1.0 / tl.load(temperatures_ptr + row).to(tl.float32)
    count = tl.zeros([NUM_PIVOTS], tl.float32)
    mass = tl.zeros([NUM_PIVOTS], tl.float32)
    for sub in range(0, CHUNK, SUB):
        offs = chunk * CHUNK + sub + tl.arange(0, SUB)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=offs < vocab, other=float("-inf"))
        p = tl.exp(x.to(tl.float32) * inv_t - m) * inv_z
        p = tl.where(offs < vocab, p, -1.0)
        hit = p[None, :] >= thresholds[:, None]  # (NUM_PIVOTS, SUB)
        count += tl.sum(hit.to(tl.float32), 1)
        mass += tl.sum(tl.where(hit, p[None, :], 0.0), 1)
    out = (row * num_chunks + chunk) * NUM_PIVOTS + tl.arange(0, NUM_PIVOTS)
    tl.store(count_ptr + out, count)
    tl.store(mass_ptr + out, mass)


@triton.jit
def _write_kernel(
    logits_ptr, temperatures_ptr, top_ks_ptr, top_ps_ptr, stats_ptr,
    prev_state_ptr, prev_count_ptr, prev_mass_ptr, out_ptr,
    stride_l, stride_o, vocab, num_chunks,
    PREV: tl.constexpr, NUM_PIVOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    m, z = _row_stats(stats_ptr, row, num_chunks, BLOCK_C)
    if PREV == 1:
        prev_target = tl.load(top_ks_ptr + row).to(tl.float32)
    else:
        prev_target = tl.load(top_ps_ptr + row).to(tl.float32)
    lo, _, kept_mass = _resolve(prev_state_ptr, prev_count_ptr, prev_mass_ptr, row, num_chunks, prev_target,
                                PREV, NUM_PIVOTS, BLOCK_C)
    threshold = lo.to(tl.float32, bitcast=True)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inv_t = 1.0 / tl.load(temperatures_ptr + row).to(tl.float32)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=offs < vocab, other=float("-inf"))
    # NOTE: the same formula as in _pass_kernel, bit for bit, or threshold ties would break.
    p = tl.exp(x.to(tl.float32) * inv_t - m) * (1.0 / z)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, tl.where(p >= threshold, p / kept_mass, 0.0), mask=offs < vocab)


def _passes_needed(num_pivots: int) -> int:
    """Passes that shrink the bit range [0, _HI_BITS) to width 1."""
    width, passes = _HI_BITS, 0
    while width > 1:
        width = -(-width // num_pivots)
        passes += 1
    return passes


def top_k_top_p_min_p_probs(
    logits: torch.Tensor,  # (bs, vocab)
    temperatures: torch.Tensor,  # (bs,) > 0 (greedy rows take argmax instead)
    top_ks: torch.Tensor,  # (bs,) int; <= 0 or >= vocab disables
    top_ps: torch.Tensor,  # (bs,) in (0, 1]; 1 disables
    min_ps: torch.Tensor,  # (bs,) in [0, 1); 0 disables
    out: torch.Tensor | None = None,  # (bs, vocab) float32
    need_top_k: bool = True,
    need_top_p: bool = True,
    chunk: int = 4096,
    num_pivots: int = 32,
) -> torch.Tensor:
    """The filtered, renormalized sampling distribution of each row; returns `out`.

    `need_top_k` / `need_top_p` = False skip that search's launches (pass them when the host
    knows no row of the batch uses the filter; a row whose parameter disables it is skipped on
    the device either way). Per-row parameters stay on the device: no host sync.
    Mutates `out` only (allocated when None).
    """
    if logits.dim() != 2:
        raise KernelInputError(f"expected logits (bs, vocab), got {tuple(logits.shape)}")
    bs, vocab = logits.shape
    for name, t in (("temperatures", temperatures), ("top_ks", top_ks), ("top_ps", top_ps), ("min_ps", min_ps)):
        if t.shape != (bs,) or t.device != logits.device:
            raise KernelInputError(f"{name} must be ({bs},) on {logits.device}, got {tuple(t.shape)} on {t.device}")
    if num_pivots < 2 or num_pivots & (num_pivots - 1):
        raise KernelInputError(f"num_pivots must be a power of two >= 2, got {num_pivots}")
    if out is None:
        out = torch.empty(bs, vocab, dtype=torch.float32, device=logits.device)
    elif out.shape != (bs, vocab) or out.dtype != torch.float32:
        raise KernelInputError(f"out must be float32 ({bs}, {vocab}), got {out.dtype} {tuple(out.shape)}")
    check_last_dim_contiguous(logits=logits, out=out)
    if bs == 0 or vocab == 0:
        return out
    num_chunks = triton.cdiv(vocab, chunk)
    dev = logits.device
    stats = torch.empty(bs, num_chunks, 2, dtype=torch.float32, device=dev)
    states = torch.empty(2, bs, 2, dtype=torch.int32, device=dev)
    counts = torch.empty(2, bs, num_chunks, num_pivots, dtype=torch.float32, device=dev)
    masses = torch.empty(2, bs, num_chunks, num_pivots, dtype=torch.float32, device=dev)
    grid = (bs, num_chunks)
    block_c = next_pow2(num_chunks)
    _stats_kernel[grid](logits, temperatures, stats, logits.stride(0), vocab, num_chunks, CHUNK=chunk, num_warps=8)

    searches = [mode for mode, needed in ((_COUNT, need_top_k), (_MASS, need_top_p)) if needed] or [_NONE]
    prev, i = _NONE, 0
    for search in searches:
        for p in range(_passes_needed(num_pivots) if search != _NONE else 1):
            cur, old = i % 2, (i + 1) % 2
            _pass_kernel[grid](
                logits, temperatures, top_ks, top_ps, min_ps, stats,
                states[old], counts[old], masses[old], states[cur], counts[cur], masses[cur],
                logits.stride(0), vocab, num_chunks,
                PREV=prev, SEARCH=search, START=p == 0,
                NUM_PIVOTS=num_pivots, CHUNK=chunk, SUB=max(16, min(chunk, 16384 // num_pivots)), BLOCK_C=block_c,
                HI_BITS=_HI_BITS, num_warps=8,
            )
            # NOTE: a disabled search's state is (lo, lo + 1): resolving it keeps lo, whatever the mode.
            prev, i = (search if search != _NONE else _MASS), i + 1
    last = (i + 1) % 2
    _write_kernel[grid](
        logits, temperatures, top_ks, top_ps, stats, states[last], counts[last], masses[last], out,
        logits.stride(0), out.stride(0), vocab, num_chunks,
        PREV=prev, NUM_PIVOTS=num_pivots, CHUNK=chunk, BLOCK_C=block_c, num_warps=8,
    )
    return out


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of probs (bs, vocab), drawn exactly from each row's distribution by
    the exponential race. Returns (bs,) int64; mutates nothing (draws from `generator`)."""
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.float() / noise).argmax(dim=-1)
