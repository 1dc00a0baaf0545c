"""Triton kernels of the MoE MLP for small decode batches (the ``nvidia`` plugin's MoE path).

Four launches after the attention half: (1) ``route_kernel``, one program: RMSNorm of the
residual stream, router GEMV, softmax, top-k, renormalization, and one int32 *bitmap* per expert
(bit ``t`` set when token ``t`` chose the expert); or ``route_split_kernel`` (``moe_ops.ROUTE_CHUNK``, the default):
the same over hidden / chunk programs, each with its columns of the normed rows and partial logits, the last
one to finish (a counter) doing the softmax and top-k; (2) ``expert_gate_up_kernel`` and
(3) ``expert_down_kernel``, grid (expert, column block, row tile): with ``PREFETCH`` a program loads its
expert's first weight block *before* it waits on the router (under PDL the launch starts while routing is
still running; but the experts no token chose read that block too), then places the expert's tokens into rows by popcount: token ``t`` goes to row
``popcount(bitmap & ((1 << t) - 1))``, tile ``row // ROWS`` with at most ``ROWS = 8`` rows per
tile; a tile with no row skips its GEMM; (4) ``combine_kernel``: residual + the routing-weighted
sum of each token's ``top_k`` expert rows, found again by popcount (deterministic, no atomics).
Tokens per step are limited to 31 (one int32 bitmap).

FP8 (e4m3) experts: ``expert_gate_up_ws_kernel`` / ``expert_down_ws_kernel`` (the same grid, bitmap placement and
outputs) run weight-stationary as ``lowlat.kernels.mrow``: each weight tile (BLOCK_N weight rows, BLOCK_K) is the MMA's
left operand and the expert's 8 rows the narrow side (no padding to 16 rows), through mrow's ``_wx`` (``MMA`` 3: FP8
widened to fp16, one conversion per two weights, the rows scaled by 2^-4 so that activations up to ~1.05e6 stay in
fp16's range). The float32 sums take their rows' scales (``HAS_SCALE``) before the SiLU (gate-up) or before they are
stored for the combine's routing weight (down). With model-dtype weights (``HAS_SCALE`` off) they are the same
kernels over bf16 / fp16 tiles (``MMA`` 1). Under PDL they release the next launch as the dense kernels do
(``LaunchConfig.pdl_early``: after the wait for a grid that fits the GPU at once, else after the main loop; the
expert grids are larger, so the down / combine launches' programs do not hold SM slots while the experts stream).

Row-wise slot kernels (``expert_gate_up_slot_kernel`` / ``expert_down_slot_kernel``, a ``rows`` expert config): grid
(tokens x top_k, column block), one program per (token, choice) slot and column block, CUDA-core reductions as
``lowlat.kernels.gemv`` (no MMA, no 8-row tile), writing the same rows of ``act`` / ``y`` (the token's row in its
expert's placement). No program of an unrouted expert; but two tokens that chose one expert read its weights twice,
so they are meant for a single token (where ``gemv``'s row-wise kernels beat the MMA ones on the dense FP8 stages).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat.kernels.gemv import _row_as_tile
from lowlat.kernels.layer import _dot, row_scales, scaled_f16
from lowlat.kernels.mrow import _wx


@triton.jit
def _popcount32(v):
    # SWAR popcount of non-negative int32 lanes.
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return (v & 0xFF) + ((v >> 8) & 0xFF) + ((v >> 16) & 0xFF) + ((v >> 24) & 0xFF)


@triton.jit
def _placement(bitmap, rt, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    # Rows of tile ``rt`` of one expert: (token index, valid) per row, from the expert's bitmap.
    offs_t = tl.arange(0, BLOCK_T)
    sel = (bitmap >> offs_t) & 1  # (BLOCK_T,)
    place = _popcount32(bitmap & ((1 << offs_t) - 1))
    offs_r = tl.arange(0, BLOCK_R)
    hit = (sel[None, :] == 1) & (place[None, :] == rt * ROWS + offs_r[:, None]) & (offs_r[:, None] < ROWS)
    tok = tl.sum(tl.where(hit, offs_t[None, :], 0), 1)  # (BLOCK_R,)
    valid = tl.sum(hit.to(tl.int32), 1) > 0
    return tok, valid


@triton.jit
def route_kernel(
    x_ptr, norm_w_ptr, router_ptr,  # inputs
    hn_ptr, ids_ptr, wts_ptr, bitmap_ptr,  # outputs
    B, eps,
    H: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, hn16_ptr=None, HN16: tl.constexpr = False,
):
    # HN16: the normed rows also stored to hn16_ptr times 2^-4 in fp16 (the FP8 expert kernels' rows, cast once)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < B
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    offs_k = tl.arange(0, BLOCK_K)
    wr = tl.load(router_ptr + offs_e[None, :] * H + offs_k[:, None], mask=e_mask[None, :] & (offs_k[:, None] < H), other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the expert kernels start and prefetch their weights now
    ss = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        km = (k0 + offs_k) < H
        xv = tl.load(x_ptr + offs_m[:, None] * H + k0 + offs_k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0)
        xv = xv.to(tl.float32)
        ss += tl.sum(xv * xv, 1)
    rstd = 1.0 / tl.sqrt(ss / H + eps)
    logits = tl.zeros((BLOCK_M, BLOCK_E), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        km = (k0 + offs_k) < H
        if k0 > 0:
            wr = tl.load(router_ptr + offs_e[None, :] * H + k0 + offs_k[:, None], mask=e_mask[None, :] & km[:, None], other=0.0)
        xv = tl.load(x_ptr + offs_m[:, None] * H + k0 + offs_k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0)
        gamma = tl.load(norm_w_ptr + k0 + offs_k, mask=km, other=0.0).to(tl.float32)
        hn = (xv.to(tl.float32) * rstd[:, None] * gamma[None, :]).to(hn_ptr.dtype.element_ty)  # rounded as stored
        tl.store(hn_ptr + offs_m[:, None] * H + k0 + offs_k[None, :], hn, mask=m_mask[:, None] & km[None, :])
        if HN16:
            tl.store(hn16_ptr + offs_m[:, None] * H + k0 + offs_k[None, :], scaled_f16(hn.to(tl.float32), DOT_F32),
                     mask=m_mask[:, None] & km[None, :])
        logits = _dot(hn, wr, logits, DOT_F32)
    _top_k(logits.to(router_ptr.dtype.element_ty).to(tl.float32), ids_ptr, wts_ptr, bitmap_ptr, offs_m, m_mask,
           offs_e, e_mask, TOP_K, BLOCK_E)


@triton.jit
def _top_k(logits, ids_ptr, wts_ptr, bitmap_ptr, offs_m, m_mask, offs_e, e_mask, TOP_K: tl.constexpr,
           BLOCK_E: tl.constexpr):
    """From the router logits (BLOCK_M, BLOCK_E; float32 of the runner's logits dtype): softmax, top-k (lowest index
    among ties), the renormalized weights, each choice's expert id and the experts' token bitmaps, stored."""
    logits = tl.where(e_mask[None, :], logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    p = tl.where(e_mask[None, :], p, -1.0)
    chosen = tl.zeros_like(p).to(tl.int32)
    total = tl.zeros_like(tl.max(p, 1))
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        idx = tl.min(tl.where(p == best[:, None], offs_e[None, :], BLOCK_E), 1)  # lowest index among ties
        tl.store(ids_ptr + offs_m * TOP_K + j, idx, mask=m_mask)
        tl.store(wts_ptr + offs_m * TOP_K + j, best, mask=m_mask)
        total += best
        hit = offs_e[None, :] == idx[:, None]
        chosen = tl.where(hit, 1, chosen)
        p = tl.where(hit, -1.0, p)
    for j in tl.static_range(TOP_K):
        wv = tl.load(wts_ptr + offs_m * TOP_K + j, mask=m_mask, other=0.0)
        tl.store(wts_ptr + offs_m * TOP_K + j, wv / total, mask=m_mask)
    chosen = tl.where(m_mask[:, None], chosen, 0)
    bitmap = tl.sum(chosen << offs_m[:, None], 0)  # (BLOCK_E,) distinct bits: the sum is an OR
    tl.store(bitmap_ptr + offs_e, bitmap, mask=e_mask)


@triton.jit
def route_split_kernel(
    x_ptr, norm_w_ptr, router_ptr,  # inputs
    hn_ptr, ids_ptr, wts_ptr, bitmap_ptr,  # outputs
    part_ptr, count_ptr,  # (splits, MAX_T, BLOCK_E) float32 partial logits; one int32 counter, 0 between launches
    B, eps,
    H: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr, MAX_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, SS_K: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, hn16_ptr=None, HN16: tl.constexpr = False,
):
    # route_kernel's work over a grid of H / CHUNK programs: each one computes its rows' RMS over the whole row (the
    # rows are read from L2 by every program: 8 KB per token at Llama widths), stores its CHUNK columns of the normed
    # rows (rounded as stored, as route_kernel) and their partial router logits; the program that counts last sums the
    # partials in split order (the same bits whichever program is last), then softmax / top-k / bitmaps (_top_k) and
    # sets the counter back to 0. One program ran the whole loop (~21 us per layer on the H200, 2026-12-04).
    sp = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < B
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    offs_c = sp * CHUNK + tl.arange(0, CHUNK)
    c_mask = offs_c < H
    wr = tl.load(router_ptr + offs_e[None, :] * H + offs_c[:, None], mask=e_mask[None, :] & c_mask[:, None], other=0.0)
    gamma = tl.load(norm_w_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the expert kernels start and prefetch their weights now
    ss = tl.zeros((BLOCK_M,), tl.float32)
    offs_k = tl.arange(0, SS_K)
    for k0 in tl.static_range(0, H, SS_K):  # unrolled: every slice's load in flight at once
        km = (k0 + offs_k) < H
        xv = tl.load(x_ptr + offs_m[:, None] * H + k0 + offs_k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0)
        xv = xv.to(tl.float32)
        ss += tl.sum(xv * xv, 1)
    rstd = 1.0 / tl.sqrt(ss / H + eps)
    cm = m_mask[:, None] & c_mask[None, :]
    xc = tl.load(x_ptr + offs_m[:, None] * H + offs_c[None, :], mask=cm, other=0.0).to(tl.float32)
    hn = (xc * rstd[:, None] * gamma[None, :]).to(hn_ptr.dtype.element_ty)  # rounded as stored
    tl.store(hn_ptr + offs_m[:, None] * H + offs_c[None, :], hn, mask=cm)
    if HN16:
        tl.store(hn16_ptr + offs_m[:, None] * H + offs_c[None, :], scaled_f16(hn.to(tl.float32), DOT_F32), mask=cm)
    logits = _dot(hn, wr, tl.zeros((BLOCK_M, BLOCK_E), tl.float32), DOT_F32)
    tl.store(part_ptr + (sp * MAX_T + offs_m[:, None]) * BLOCK_E + offs_e[None, :], logits, mask=m_mask[:, None])
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        offs_s = tl.arange(0, BLOCK_S)
        sm = offs_s < tl.num_programs(0)
        parts = tl.load(part_ptr + (offs_s[:, None, None] * MAX_T + offs_m[None, :, None]) * BLOCK_E
                        + offs_e[None, None, :], mask=sm[:, None, None] & m_mask[None, :, None], other=0.0,
                        cache_modifier=".cg")  # (BLOCK_S, BLOCK_M, BLOCK_E)
        total = tl.sum(parts, 0)
        _top_k(total.to(router_ptr.dtype.element_ty).to(tl.float32), ids_ptr, wts_ptr, bitmap_ptr, offs_m, m_mask,
               offs_e, e_mask, TOP_K, BLOCK_E)


@triton.jit
def expert_gate_up_kernel(
    hn_ptr, w13_ptr, bitmap_ptr, act_ptr,
    MAX_T: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, LOOP_START: tl.constexpr,
):
    # act[e, row, n] = silu(hn[tok] @ gate[e, n]) * (hn[tok] @ up[e, n]) for the expert's rows.
    e = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    rt = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    base = w13_ptr + e.to(tl.int64) * (2 * INTER * H)
    if PREFETCH:  # the first block before the wait (every expert's programs read it, routed or not)
        wmask = n_mask[None, :] & (offs_k[:, None] < H)
        wg = tl.load(base + offs_n[None, :] * H + offs_k[:, None], mask=wmask, other=0.0)
        wu = tl.load(base + (INTER + offs_n[None, :]) * H + offs_k[:, None], mask=wmask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bitmap = tl.load(bitmap_ptr + e)
    if _popcount32(bitmap) > rt * ROWS:
        tok, valid = _placement(bitmap, rt, ROWS, BLOCK_R, BLOCK_T)
        offs_r = tl.arange(0, BLOCK_R)
        acc_g = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
        if PREFETCH:  # the prefetched first block (LOOP_START = BLOCK_K), then a loop Triton can pipeline
            a = tl.load(hn_ptr + tok[:, None] * H + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < H), other=0.0)
            acc_g = _dot(a, wg, acc_g, DOT_F32)
            acc_u = _dot(a, wu, acc_u, DOT_F32)
        for k0 in range(LOOP_START, H, BLOCK_K):
            km = (k0 + offs_k) < H
            wg = tl.load(base + offs_n[None, :] * H + k0 + offs_k[:, None], mask=n_mask[None, :] & km[:, None], other=0.0)
            wu = tl.load(base + (INTER + offs_n[None, :]) * H + k0 + offs_k[:, None], mask=n_mask[None, :] & km[:, None], other=0.0)
            a = tl.load(hn_ptr + tok[:, None] * H + k0 + offs_k[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            acc_g = _dot(a, wg, acc_g, DOT_F32)
            acc_u = _dot(a, wu, acc_u, DOT_F32)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        row = rt * ROWS + offs_r
        ptr = act_ptr + (e * MAX_T + row[:, None]) * INTER + offs_n[None, :]
        tl.store(ptr, act, mask=valid[:, None] & n_mask[None, :])


@triton.jit
def expert_down_kernel(
    act_ptr, w2_ptr, bitmap_ptr, y_ptr,
    MAX_T: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, LOOP_START: tl.constexpr,
):
    # y[e, row, n] = act[e, row] @ down[e, n] (float32) for the expert's rows.
    e = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    rt = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    base = w2_ptr + e.to(tl.int64) * (H * INTER)
    if PREFETCH:
        w = tl.load(base + offs_n[None, :] * INTER + offs_k[:, None], mask=n_mask[None, :] & (offs_k[:, None] < INTER), other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bitmap = tl.load(bitmap_ptr + e)
    if _popcount32(bitmap) > rt * ROWS:
        _tok, valid = _placement(bitmap, rt, ROWS, BLOCK_R, BLOCK_T)
        offs_r = tl.arange(0, BLOCK_R)
        row = rt * ROWS + offs_r
        a_rows = act_ptr + (e * MAX_T + row[:, None]) * INTER
        acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
        if PREFETCH:
            a = tl.load(a_rows + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < INTER), other=0.0)
            acc = _dot(a, w, acc, DOT_F32)
        for k0 in range(LOOP_START, INTER, BLOCK_K):  # pipelined, as in the gate-up kernel
            km = (k0 + offs_k) < INTER
            w = tl.load(base + offs_n[None, :] * INTER + k0 + offs_k[:, None], mask=n_mask[None, :] & km[:, None], other=0.0)
            a = tl.load(a_rows + k0 + offs_k[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            acc = _dot(a, w, acc, DOT_F32)
        tl.store(y_ptr + (e * MAX_T + row[:, None]) * H + offs_n[None, :], acc, mask=valid[:, None] & n_mask[None, :])


@triton.jit
def expert_gate_up_ws_kernel(
    hn_ptr, w13_ptr, s13_ptr, bitmap_ptr, act_ptr,
    MAX_T: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MMA: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, HAS_SCALE: tl.constexpr,
    IN16: tl.constexpr = False, OUT16: tl.constexpr = False,
):
    # expert_gate_up_kernel's act, weight-stationary: acc (BLOCK_N, BLOCK_R) = w tile (BLOCK_N, BLOCK_K) @ rows.T;
    # FP8: g, u = the sums times s13[e, n], s13[e, INTER + n] (float32) before the SiLU
    # IN16: hn_ptr holds the rows times 2^-4 in fp16 (route_kernel's HN16): an fp16 MMA (MMA 2), the sums times 16;
    # OUT16: act stored times 2^-4 (act_ptr fp16) for the down kernel's IN16
    e = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    rt = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    base = w13_ptr + e.to(tl.int64) * (2 * INTER * H)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    bitmap = tl.load(bitmap_ptr + e)
    # NOTE: an unrouted expert's programs read no weight and exit (an exited program counts as released)
    if _popcount32(bitmap) > rt * ROWS:
        tok, valid = _placement(bitmap, rt, ROWS, BLOCK_R, BLOCK_T)
        acc_g = tl.zeros((BLOCK_N, BLOCK_R), tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_R), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            km = (k0 + offs_k) < H
            wmask = n_mask[:, None] & km[None, :]
            wg = tl.load(base + offs_n[:, None] * H + k0 + offs_k[None, :], mask=wmask, other=0.0)
            wu = tl.load(base + (INTER + offs_n[:, None]) * H + k0 + offs_k[None, :], mask=wmask, other=0.0)
            a = tl.load(hn_ptr + tok[:, None] * H + k0 + offs_k[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            acc_g = _wx(wg, a.to(tl.float32), acc_g, MMA, DOT_F32)
            acc_u = _wx(wu, a.to(tl.float32), acc_u, MMA, DOT_F32)
        if USE_PDL and not PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        s_base = s13_ptr + e * (2 * INTER)
        in_scale = 16.0 if IN16 else 1.0
        g = acc_g * (row_scales(s_base, offs_n, n_mask, HAS_SCALE) * in_scale)[:, None]
        u = acc_u * (row_scales(s_base, INTER + offs_n, n_mask, HAS_SCALE) * in_scale)[:, None]
        act = g / (1.0 + tl.exp(-g)) * u
        if OUT16:
            act = scaled_f16(act, DOT_F32)
        row = rt * ROWS + tl.arange(0, BLOCK_R)
        ptr = act_ptr + (e * MAX_T + row[None, :]) * INTER + offs_n[:, None]
        tl.store(ptr, act, mask=valid[None, :] & n_mask[:, None])


@triton.jit
def expert_down_ws_kernel(
    act_ptr, w2_ptr, s2_ptr, bitmap_ptr, y_ptr,
    MAX_T: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MMA: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, HAS_SCALE: tl.constexpr,
    IN16: tl.constexpr = False,
):
    # expert_down_kernel's y, weight-stationary; FP8: the sums times s2[e, n] (float32); IN16: as the gate-up kernel's
    # (act_ptr: the gate-up kernel's OUT16 rows)
    e = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    rt = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    base = w2_ptr + e.to(tl.int64) * (H * INTER)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    bitmap = tl.load(bitmap_ptr + e)
    if _popcount32(bitmap) > rt * ROWS:
        _tok, valid = _placement(bitmap, rt, ROWS, BLOCK_R, BLOCK_T)
        row = rt * ROWS + tl.arange(0, BLOCK_R)
        a_rows = act_ptr + (e * MAX_T + row[:, None]) * INTER
        acc = tl.zeros((BLOCK_N, BLOCK_R), tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            km = (k0 + offs_k) < INTER
            w = tl.load(base + offs_n[:, None] * INTER + k0 + offs_k[None, :], mask=n_mask[:, None] & km[None, :],
                        other=0.0)
            a = tl.load(a_rows + k0 + offs_k[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            acc = _wx(w, a.to(tl.float32), acc, MMA, DOT_F32)
        if USE_PDL and not PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        acc = acc * (row_scales(s2_ptr + e * H, offs_n, n_mask, HAS_SCALE) * (16.0 if IN16 else 1.0))[:, None]
        tl.store(y_ptr + (e * MAX_T + row[None, :]) * H + offs_n[:, None], acc, mask=valid[None, :] & n_mask[:, None])


@triton.jit
def _slot(ids_ptr, bitmap_ptr, TOP_K: tl.constexpr):
    """The token ``t`` of slot program ``program_id(0)`` (t * TOP_K + choice), its expert, and its row among the
    expert's rows (popcount placement, as the combine finds it)."""
    s = tl.program_id(0)
    t = s // TOP_K
    e = tl.load(ids_ptr + s)
    return t, e, _popcount32(tl.load(bitmap_ptr + e) & ((1 << t) - 1))


@triton.jit
def _x_slice(x_ptr, offs_k, k_mask, ROWS: tl.constexpr, X2D: tl.constexpr):
    """One activation row's columns ``offs_k`` as float32 to multiply a (ROWS, BLOCK_K) weight tile: loaded in the
    tile's shape (``X2D``, ``W_VEC`` 16: one register layout for both, ``gemv._row_as_tile``), else (1, BLOCK_K)."""
    # NOTE: one if / else assigning one value (layer._dot's note)
    if X2D:
        x = _row_as_tile(x_ptr, offs_k, k_mask, 0, 1, ROWS)
    else:
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
    return x


@triton.jit
def expert_gate_up_slot_kernel(
    hn_ptr, w13_ptr, s13_ptr, ids_ptr, bitmap_ptr, act_ptr,
    MAX_T: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_VEC: tl.constexpr,
    USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    # act[e, row, n] for the slot's expert e and its token's row, row-wise; FP8: the sums times their rows' scales
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    # NOTE: the hint inline (gemv's note: through a helper function the compiler loses it)
    wk = tl.max_contiguous(tl.multiple_of(offs_k, W_VEC), W_VEC) if W_VEC > 0 else offs_k
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    t, e, row = _slot(ids_ptr, bitmap_ptr, TOP_K)
    base = w13_ptr + e.to(tl.int64) * (2 * INTER * H)
    acc_g = tl.zeros((BLOCK_N,), tl.float32)
    acc_u = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        km = (k0 + offs_k) < H
        wm = n_mask[:, None] & km[None, :]
        wg = tl.load(base + offs_n[:, None] * H + k0 + wk[None, :], mask=wm, other=0.0).to(tl.float32)
        wu = tl.load(base + (INTER + offs_n[:, None]) * H + k0 + wk[None, :], mask=wm, other=0.0).to(tl.float32)
        x = _x_slice(hn_ptr + t * H + k0, offs_k, km, BLOCK_N, W_VEC >= 16)
        acc_g += tl.sum(wg * x, 1)
        acc_u += tl.sum(wu * x, 1)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    s_base = s13_ptr + e * (2 * INTER)
    g = acc_g * row_scales(s_base, offs_n, n_mask, HAS_SCALE)
    u = acc_u * row_scales(s_base, INTER + offs_n, n_mask, HAS_SCALE)
    tl.store(act_ptr + (e * MAX_T + row) * INTER + offs_n, g / (1.0 + tl.exp(-g)) * u, mask=n_mask)


@triton.jit
def expert_down_slot_kernel(
    act_ptr, w2_ptr, s2_ptr, ids_ptr, bitmap_ptr, y_ptr,
    MAX_T: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_VEC: tl.constexpr,
    USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    # y[e, row, n] = act[e, row] . w2[e, n] for the slot's expert e and its token's row, row-wise
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    wk = tl.max_contiguous(tl.multiple_of(offs_k, W_VEC), W_VEC) if W_VEC > 0 else offs_k
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    _t, e, row = _slot(ids_ptr, bitmap_ptr, TOP_K)
    base = w2_ptr + e.to(tl.int64) * (H * INTER)
    a_row = act_ptr + (e * MAX_T + row) * INTER
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        km = (k0 + offs_k) < INTER
        w = tl.load(base + offs_n[:, None] * INTER + k0 + wk[None, :], mask=n_mask[:, None] & km[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * _x_slice(a_row + k0, offs_k, km, BLOCK_N, W_VEC >= 16), 1)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    acc = acc * row_scales(s2_ptr + e * H, offs_n, n_mask, HAS_SCALE)
    tl.store(y_ptr + (e * MAX_T + row) * H + offs_n, acc, mask=n_mask)


@triton.jit
def combine_kernel(
    res_ptr, y_ptr, ids_ptr, wts_ptr, bitmap_ptr, out_ptr,
    MAX_T: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    # out[t, n] = res[t, n] + sum_j wts[t, j] * y[ids[t, j], popcount(bitmap[ids[t, j]] below t), n]
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.load(res_ptr + t * H + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j)
        wt = tl.load(wts_ptr + t * TOP_K + j)
        row = _popcount32(tl.load(bitmap_ptr + e) & ((1 << t) - 1))
        acc += wt * tl.load(y_ptr + (e * MAX_T + row) * H + offs_n, mask=n_mask, other=0.0)
    tl.store(out_ptr + t * H + offs_n, acc, mask=n_mask)
