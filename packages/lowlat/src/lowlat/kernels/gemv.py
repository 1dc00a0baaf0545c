"""Row-wise GEMV for the smallest decode batches: no tensor-core dot, one reduction per row.

``out[b, n] = res[b, n] + sum_k a[b, k] * w[n, k]`` for a few rows ``b``. The ``tl.dot`` kernels of
``lowlat.kernels.layer`` pad the batch to 16 rows and stage each weight tile through shared
memory for the MMA; here a weight tile goes from global memory to registers and is reduced
against each activation row in turn (``BLOCK_M`` = the batch padded to a power of two, unrolled),
so at batch 1 the kernel is one load, one multiply and one row sum per weight element. Which of
the two is faster per shape and batch is measured (``benchmarks/lowlat/bench_gemv.py``) and
recorded in ``lowlat.kernels.tuning``. The qkv (RMSNorm + QKV + RoPE + KV write) and gate-up
(RMSNorm + gate-up + SiLU) stages have row-wise twins here too: the norm's weight scales each activation
row, its sum of squares is accumulated in the main loop (no pass over x after the PDL wait), and ``1 / rms``
is applied to the sums. FP8 (e4m3) weights (``HAS_SCALE``): each tile is widened to float32 in registers (the
same code) and the finished sums are multiplied by each output row's scale (``layer.row_scales``). ``W_VEC``
(``GemvConfig.vec``) caps a weight load at that many contiguous elements: a 16-byte load holds 16 FP8 weights
but 8 bf16 activations, and on sm_90 Triton then stages the activation row through shared memory to match the
tile's register layout; ``W_VEC`` 8 loads FP8 weights 8 bytes at a time in the activation's layout instead (no
staging; a no-op for bf16 weights). ``W_VEC`` 16 keeps FP8 weights' 16-byte loads and loads each activation row in the
weight tile's shape instead (``x[m, k]`` for every tile row, the same addresses: served by L1), so that Triton gives
both loads one register layout (16 elements per thread: one 16-byte weight load, two activation loads) and stages
nothing through shared memory. Which is faster is for ``benchmarks/lowlat/bench_gemv.py --fp8`` to measure.

``ACC2D`` (``GemvConfig.acc2d``, one activation row): each K step FMAs into a float32 accumulator of the weight
tile's shape and the sums are reduced across the threads once after the loop (``_rows_acc2d``), instead of a
cross-thread (and, with several warps, shared-memory + barrier) reduction per K step; the K loop is unrolled. In the
sm_90 code of the default path the next step's weight loads wait behind each step's barrier (one tile in flight per
program); with ``ACC2D`` they are issued ahead. Measured on the H200 (8B shape, FP8, batch 1; benchmarks/RESULTS.md
issue 33, 2026-12-02): slower at every tile tried (o_proj 6.66 against 6.04 us, gate-up 34.96-36.72 against 33.32,
down 17.23-17.77 against 16.93, qkv 12.3-13.9 against 10.16): more registers per program (o_proj 48 -> 64, down 53
-> 198 with the unrolled loop) and fewer programs per SM cost more than the barriers did, so no table uses it.

``PREFETCH`` (``LaunchConfig.l2_prefetch``): after its tiles each program requests its share of the next stage's
weights into L2 (``l2_prefetch``: one ``cp.async.bulk.prefetch.L2`` per program). Measured on the same stack: slower
(70.4 us per layer without, 74.2 / 80.1 / 86.2 with 16 / 32 / 64 MiB per launch), so it is off.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat.kernels.layer import _rope_factors, _rope_store, row_scales


@triton.jit
def gemv_rows_residual_kernel(
    a_ptr, w_ptr, s_ptr, res_ptr, out_ptr,
    B,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    PDL_EARLY: tl.constexpr,
    LOOP: tl.constexpr, HAS_SCALE: tl.constexpr, W_VEC: tl.constexpr, HAS_RES: tl.constexpr,
    ACC2D: tl.constexpr = False, pf_ptr=None, pf_bytes=0, PREFETCH: tl.constexpr = False,
):
    # LOOP: fewer programs than tiles, each looping over tiles (GemvConfig.programs); else one tile each
    # HAS_RES off: no residual (a row-parallel partial under TP); ACC2D: one row (BLOCK_M 1), the module docstring
    # PREFETCH: this program's share of pf_bytes from pf_ptr into L2 after its tiles (l2_prefetch)
    if LOOP:
        for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
            _gemv_rows_residual_tile(tile, a_ptr, w_ptr, s_ptr, res_ptr, out_ptr, B, N, K, BLOCK_M, BLOCK_N,
                                     BLOCK_K, USE_PDL, PDL_EARLY, HAS_SCALE, W_VEC, HAS_RES, ACC2D)
    else:
        _gemv_rows_residual_tile(tl.program_id(0), a_ptr, w_ptr, s_ptr, res_ptr, out_ptr, B, N, K, BLOCK_M,
                                 BLOCK_N, BLOCK_K, USE_PDL, PDL_EARLY, HAS_SCALE, W_VEC, HAS_RES, ACC2D)
    l2_prefetch(pf_ptr, pf_bytes, PREFETCH)


@triton.jit
def _gemv_rows_residual_tile(
    pid, a_ptr, w_ptr, s_ptr, res_ptr, out_ptr,
    B,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    PDL_EARLY: tl.constexpr, HAS_SCALE: tl.constexpr, W_VEC: tl.constexpr, HAS_RES: tl.constexpr,
    ACC2D: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # NOTE: the hint inline (through a helper function the compiler loses it)
    wk = tl.max_contiguous(tl.multiple_of(offs_k, W_VEC), W_VEC) if W_VEC > 0 else offs_k
    # NOTE: the first weight tile and the residual are requested before waiting on the previous launch (PDL): the
    # residual comes from two or more launches back (o_proj: the layer input; down: o_proj's output), which had
    # finished before the previous launch passed its own wait, the point where this launch may start
    w = tl.load(w_ptr + offs_n[:, None] * K + wk[None, :], mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
    mask = (offs_m[:, None] < B) & n_mask[None, :]
    if HAS_RES:
        res = tl.load(res_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        res = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    if ACC2D:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32) + _rows_acc2d(w, w_ptr, a_ptr, offs_n, n_mask, offs_k, wk, B, K,
                                                                    BLOCK_K)[None, :]
    else:
        acc = _add_rows(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), w.to(tl.float32), a_ptr, 0, offs_k, offs_k < K, B, K,
                        BLOCK_M, W_VEC >= 16)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            km = (k0 + offs_k) < K
            wf = tl.load(w_ptr + offs_n[:, None] * K + k0 + wk[None, :], mask=n_mask[:, None] & km[None, :],
                         other=0.0).to(tl.float32)
            acc = _add_rows(acc, wf, a_ptr, k0, offs_k, km, B, K, BLOCK_M, W_VEC >= 16)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    acc = acc * row_scales(s_ptr, offs_n, n_mask, HAS_SCALE)[None, :]
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc + res, mask=mask)


@triton.jit
def l2_prefetch(pf_ptr, pf_bytes, PREFETCH: tl.constexpr):
    """This program's share of the ``pf_bytes`` bytes at ``pf_ptr`` (the next GEMV stage's weights; 16-byte aligned,
    a multiple of 16) requested into L2 by one thread: ``cp.async.bulk.prefetch.L2`` (sm_90) hands the range to the
    copy engine, no registers and no wait, so the memory keeps streaming through this launch's tail and whatever runs
    between it and the stage that reads them (``LaunchConfig.l2_prefetch``). Not traced without ``PREFETCH``."""
    if PREFETCH:
        nprog = tl.num_programs(0)
        chunk = ((pf_bytes + nprog - 1) // nprog + 15) // 16 * 16
        start = tl.program_id(0) * chunk
        size = tl.minimum(chunk, pf_bytes - start)
        if size > 0:
            base = pf_ptr.to(tl.pointer_type(tl.int8), bitcast=True) + start
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [base, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _add_rows(acc, wf, a_ptr, k0, offs_k, k_mask, B, K: tl.constexpr, BLOCK_M: tl.constexpr, X2D: tl.constexpr):
    """`acc[m, :] += wf @ a[m, k0:k0 + BLOCK_K]` for every row m < B (rows unrolled). ``X2D``: each activation row
    loaded in ``wf``'s shape (``W_VEC`` 16, module docstring)."""
    offs_m = tl.arange(0, BLOCK_M)
    for m in tl.static_range(BLOCK_M):
        if X2D:
            xm2 = _row_as_tile(a_ptr + m * K + k0, offs_k, k_mask, m, B, wf.shape[0])
            acc = tl.where(offs_m[:, None] == m, acc + tl.sum(wf * xm2, 1)[None, :], acc)
        else:
            xm = tl.load(a_ptr + m * K + k0 + offs_k, mask=k_mask & (offs_k * 0 + m < B), other=0.0).to(tl.float32)
            acc = tl.where(offs_m[:, None] == m, acc + tl.sum(wf * xm[None, :], 1)[None, :], acc)
    return acc


@triton.jit
def _rows_acc2d(w, w_ptr, a_ptr, offs_n, n_mask, offs_k, wk, B, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """``sum_k w[n, k] * a[0, k]`` over all of K for the tile rows ``offs_n`` (``ACC2D``, one activation row): ``w``
    is the first (BLOCK_N, BLOCK_K) tile, already requested. Each step FMAs into a tile-shaped float32 accumulator,
    reduced across threads once after the loop: no barrier between the steps, so the next step's loads can be issued
    before this step's FMAs."""
    acc2 = w.to(tl.float32) * _row_as_tile_raw(a_ptr, offs_k, offs_k < K, 0, B, w.shape[0]).to(tl.float32)
    for k0 in tl.static_range(BLOCK_K, K, BLOCK_K):  # unrolled: loads hoisted
        km = (k0 + offs_k) < K
        wn = tl.load(w_ptr + offs_n[:, None] * K + k0 + wk[None, :], mask=n_mask[:, None] & km[None, :], other=0.0)
        xn = _row_as_tile_raw(a_ptr + k0, offs_k, km, 0, B, w.shape[0])
        acc2 += wn.to(tl.float32) * xn.to(tl.float32)
    return tl.sum(acc2, 1)


@triton.jit
def _row_as_tile_raw(ptr, offs_k, k_mask, m, B, ROWS: tl.constexpr):
    """``_row_as_tile`` in the activation's dtype (converted where it is used, so a prefetched slice holds half the
    registers)."""
    zn = tl.zeros((ROWS, 1), tl.int32)
    mask = k_mask[None, :] & (zn + m < B)
    return tl.load(ptr + zn + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _rows2_normed_acc2d(w1, w2, w_ptr, r1, r2, n_mask, x_ptr, norm_w_ptr, offs_k, wk, B, K: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """``_rows_acc2d`` for two weight tiles (rows ``r1`` and ``r2``) against one RMSNorm'd activation row: returns
    ``(w1 @ (x * gamma), w2 @ (x * gamma), sum(x ** 2))`` over all of K (the caller applies ``1 / rms``); the sum of
    squares is accumulated per element too (x loaded flat for it: the tile-shaped load repeats each element)."""
    km = offs_k < K
    xg = (_row_as_tile_raw(x_ptr, offs_k, km, 0, B, w1.shape[0]).to(tl.float32)
          * _row_as_tile_raw(norm_w_ptr, offs_k, km, 0, 1, w1.shape[0]).to(tl.float32))
    x1 = tl.load(x_ptr + offs_k, mask=km & (offs_k * 0 < B), other=0.0).to(tl.float32)
    acc1 = w1.to(tl.float32) * xg
    acc2 = w2.to(tl.float32) * xg
    ss = x1 * x1
    for k0 in tl.static_range(BLOCK_K, K, BLOCK_K):  # unrolled: loads hoisted
        km = (k0 + offs_k) < K
        w1 = tl.load(w_ptr + r1[:, None] * K + k0 + wk[None, :], mask=n_mask[:, None] & km[None, :], other=0.0)
        w2 = tl.load(w_ptr + r2[:, None] * K + k0 + wk[None, :], mask=n_mask[:, None] & km[None, :], other=0.0)
        xg = (_row_as_tile_raw(x_ptr + k0, offs_k, km, 0, B, w1.shape[0]).to(tl.float32)
              * _row_as_tile_raw(norm_w_ptr + k0, offs_k, km, 0, 1, w1.shape[0]).to(tl.float32))
        x1 = tl.load(x_ptr + k0 + offs_k, mask=km & (offs_k * 0 < B), other=0.0).to(tl.float32)
        acc1 += w1.to(tl.float32) * xg
        acc2 += w2.to(tl.float32) * xg
        ss += x1 * x1
    return tl.sum(acc1, 1), tl.sum(acc2, 1), tl.sum(ss, 0)


@triton.jit
def _row_as_tile(ptr, offs_k, k_mask, m, B, ROWS: tl.constexpr):
    """``ptr[offs_k]`` (float32; zeros unless ``m < B``) repeated over ``ROWS`` rows: one load in the shape of a
    (ROWS, BLOCK_K) weight tile, so that both share one register layout (``W_VEC`` 16)."""
    zn = tl.zeros((ROWS, 1), tl.int32)
    mask = k_mask[None, :] & (zn + m < B)
    return tl.load(ptr + zn + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _add_rows2_normed(acc1, acc2, ss, w1, w2, gamma, x_ptr, k0, offs_k, k_mask, B, K: tl.constexpr,
                      BLOCK_M: tl.constexpr, X2D: tl.constexpr = False, norm_w_ptr=None):
    """RMSNorm'd `_add_rows` for two weight tiles: `acc[m, :] += w @ (x[m, k0:k0 + BLOCK_K] * gamma)` for both
    tiles and `ss[m] += sum(x[m, k0:k0 + BLOCK_K] ** 2)` (the norm's sum of squares, so no separate pass over x
    after the PDL wait; the caller applies 1 / rms to the sums). Each activation row is loaded once; the norm
    weight ``gamma`` (float32, BLOCK_K) scales the activation, not the weight tile. ``X2D`` (``W_VEC`` 16): the
    activation rows and the norm weight (``norm_w_ptr``; ``gamma`` unused) loaded in the weight tiles' shape."""
    offs_m = tl.arange(0, BLOCK_M)
    w1f = w1.to(tl.float32)
    w2f = w2.to(tl.float32)
    if X2D:
        gamma2 = _row_as_tile(norm_w_ptr + k0, offs_k, k_mask, 0, 1, w1.shape[0])
    for m in tl.static_range(BLOCK_M):
        xm = tl.load(x_ptr + m * K + k0 + offs_k, mask=k_mask & (offs_k * 0 + m < B), other=0.0).to(tl.float32)
        if X2D:
            xg = _row_as_tile(x_ptr + m * K + k0, offs_k, k_mask, m, B, w1.shape[0]) * gamma2
        else:
            xg = (xm * gamma)[None, :]
        acc1 = tl.where(offs_m[:, None] == m, acc1 + tl.sum(w1f * xg, 1)[None, :], acc1)
        acc2 = tl.where(offs_m[:, None] == m, acc2 + tl.sum(w2f * xg, 1)[None, :], acc2)
        ss = tl.where(offs_m == m, ss + tl.sum(xm * xm, 0), ss)
    return acc1, acc2, ss


@triton.jit
def qkv_rope_rows_kernel(
    x_ptr, norm_w_ptr, w_ptr, s_ptr, inv_freq_ptr, pos_ptr, loc_ptr,  # inputs
    q_ptr, k_cache_ptr, v_cache_ptr,  # outputs
    B, eps,
    stride_ks, stride_kh, stride_vs, stride_vh, inv_k_scale, inv_v_scale,
    H: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    PDL_EARLY: tl.constexpr, HAS_SCALE: tl.constexpr, KV_FP8: tl.constexpr, W_VEC: tl.constexpr,
    ACC2D: tl.constexpr = False, pf_ptr=None, pf_bytes=0, PREFETCH: tl.constexpr = False,
):
    # layer.qkv_rope_kernel's tiles (BLOCK_P rotary pairs of one head), row-wise: weights (BLOCK_P, BLOCK_K)
    # ACC2D: one row (BLOCK_M 1), the module docstring
    HALF: tl.constexpr = D // 2
    PB: tl.constexpr = HALF // BLOCK_P
    num_tiles = (NQ + 2 * NKV) * PB
    offs_k = tl.arange(0, BLOCK_K)
    # NOTE: the hint inline (through a helper function the compiler loses it)
    wk = tl.max_contiguous(tl.multiple_of(offs_k, W_VEC), W_VEC) if W_VEC > 0 else offs_k
    offs_p = tl.arange(0, BLOCK_P)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        r1 = (tile // PB) * D + (tile % PB) * BLOCK_P + offs_p
        r2 = r1 + HALF
        km = offs_k < H
        w1 = tl.load(w_ptr + r1[:, None] * H + wk[None, :], mask=km[None, :], other=0.0)
        w2 = tl.load(w_ptr + r2[:, None] * H + wk[None, :], mask=km[None, :], other=0.0)
        gamma = tl.load(norm_w_ptr + offs_k, mask=km, other=0.0).to(tl.float32)
        cos, sin, loc = _rope_factors(tile, pos_ptr, loc_ptr, inv_freq_ptr, B, D, BLOCK_M, BLOCK_P)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            if PDL_EARLY:
                tl.extra.cuda.gdc_launch_dependents()
        zero = tl.zeros((BLOCK_M, BLOCK_P), tl.float32)
        if ACC2D:
            a1, a2, s1 = _rows2_normed_acc2d(w1, w2, w_ptr, r1, r2, r1 >= 0, x_ptr, norm_w_ptr, offs_k, wk, B, H,
                                             BLOCK_K)
            acc1 = zero + a1[None, :]
            acc2 = zero + a2[None, :]
            ss = tl.zeros((BLOCK_M,), tl.float32) + s1
        else:
            acc1, acc2, ss = _add_rows2_normed(zero, zero, tl.zeros((BLOCK_M,), tl.float32), w1, w2, gamma, x_ptr, 0,
                                               offs_k, km, B, H, BLOCK_M, W_VEC >= 16, norm_w_ptr)
            for k0 in range(BLOCK_K, H, BLOCK_K):
                km = (k0 + offs_k) < H
                w1 = tl.load(w_ptr + r1[:, None] * H + k0 + wk[None, :], mask=km[None, :], other=0.0)
                w2 = tl.load(w_ptr + r2[:, None] * H + k0 + wk[None, :], mask=km[None, :], other=0.0)
                gamma = tl.load(norm_w_ptr + k0 + offs_k, mask=km, other=0.0).to(tl.float32)
                acc1, acc2, ss = _add_rows2_normed(acc1, acc2, ss, w1, w2, gamma, x_ptr, k0, offs_k, km, B, H, BLOCK_M,
                                                   W_VEC >= 16, norm_w_ptr)
        rstd = 1.0 / tl.sqrt(ss / H + eps)
        if USE_PDL and not PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        s1 = row_scales(s_ptr, r1, r1 >= 0, HAS_SCALE)
        s2 = row_scales(s_ptr, r2, r2 >= 0, HAS_SCALE)
        _rope_store(acc1 * rstd[:, None] * s1[None, :], acc2 * rstd[:, None] * s2[None, :], tile, cos, sin, loc, q_ptr,
                    k_cache_ptr, v_cache_ptr, B, stride_ks, stride_kh, stride_vs, stride_vh, inv_k_scale, inv_v_scale,
                    NQ, NKV, D, BLOCK_M, BLOCK_P, KV_FP8)
    l2_prefetch(pf_ptr, pf_bytes, PREFETCH)


@triton.jit
def norm_gate_up_rows_kernel(
    x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr,
    B, eps,
    H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    PDL_EARLY: tl.constexpr,
    LOOP: tl.constexpr, HAS_SCALE: tl.constexpr, W_VEC: tl.constexpr, ACC2D: tl.constexpr = False,
    pf_ptr=None, pf_bytes=0, PREFETCH: tl.constexpr = False,
):
    # act[b, j] = silu(g) * u, g, u = rmsnorm(x)[b] . w[j], w[INTER + j], row-wise (layer.norm_gate_up_kernel's twin)
    # LOOP: fewer programs than tiles, each looping over tiles (GemvConfig.programs); else one tile each
    # ACC2D: one row (BLOCK_M 1), the module docstring
    if LOOP:
        for tile in range(tl.program_id(0), tl.cdiv(INTER, BLOCK_N), tl.num_programs(0)):
            _norm_gate_up_rows_tile(tile, x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr, B, eps, H, INTER, BLOCK_M,
                                    BLOCK_N, BLOCK_K, USE_PDL, PDL_EARLY, HAS_SCALE, W_VEC, ACC2D)
    else:
        _norm_gate_up_rows_tile(tl.program_id(0), x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr, B, eps, H, INTER,
                                BLOCK_M, BLOCK_N, BLOCK_K, USE_PDL, PDL_EARLY, HAS_SCALE, W_VEC, ACC2D)
    l2_prefetch(pf_ptr, pf_bytes, PREFETCH)


@triton.jit
def _norm_gate_up_rows_tile(
    pid, x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr,
    B, eps,
    H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    PDL_EARLY: tl.constexpr, HAS_SCALE: tl.constexpr, W_VEC: tl.constexpr, ACC2D: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    # NOTE: the hint inline (through a helper function the compiler loses it)
    wk = tl.max_contiguous(tl.multiple_of(offs_k, W_VEC), W_VEC) if W_VEC > 0 else offs_k
    km = offs_k < H
    wm = n_mask[:, None] & km[None, :]
    wg = tl.load(w_ptr + offs_n[:, None] * H + wk[None, :], mask=wm, other=0.0)
    wu = tl.load(w_ptr + (INTER + offs_n[:, None]) * H + wk[None, :], mask=wm, other=0.0)
    gamma = tl.load(norm_w_ptr + offs_k, mask=km, other=0.0).to(tl.float32)  # a constant: before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    zero = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if ACC2D:
        g1, u1, s1 = _rows2_normed_acc2d(wg, wu, w_ptr, offs_n, INTER + offs_n, n_mask, x_ptr, norm_w_ptr, offs_k, wk,
                                         B, H, BLOCK_K)
        g = zero + g1[None, :]
        u = zero + u1[None, :]
        ss = tl.zeros((BLOCK_M,), tl.float32) + s1
    else:
        g, u, ss = _add_rows2_normed(zero, zero, tl.zeros((BLOCK_M,), tl.float32), wg, wu, gamma, x_ptr, 0, offs_k, km,
                                     B, H, BLOCK_M, W_VEC >= 16, norm_w_ptr)
        for k0 in range(BLOCK_K, H, BLOCK_K):
            km = (k0 + offs_k) < H
            wm = n_mask[:, None] & km[None, :]
            wg = tl.load(w_ptr + offs_n[:, None] * H + k0 + wk[None, :], mask=wm, other=0.0)
            wu = tl.load(w_ptr + (INTER + offs_n[:, None]) * H + k0 + wk[None, :], mask=wm, other=0.0)
            gamma = tl.load(norm_w_ptr + k0 + offs_k, mask=km, other=0.0).to(tl.float32)
            g, u, ss = _add_rows2_normed(g, u, ss, wg, wu, gamma, x_ptr, k0, offs_k, km, B, H, BLOCK_M, W_VEC >= 16,
                                         norm_w_ptr)
    rstd = 1.0 / tl.sqrt(ss / H + eps)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    g = g * rstd[:, None] * row_scales(s_ptr, offs_n, n_mask, HAS_SCALE)[None, :]
    u = u * rstd[:, None] * row_scales(s_ptr, INTER + offs_n, n_mask, HAS_SCALE)[None, :]
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + offs_m[:, None] * INTER + offs_n[None, :], act, mask=(offs_m[:, None] < B) & n_mask[None, :])
