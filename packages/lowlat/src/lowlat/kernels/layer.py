"""Per-stage Triton kernels of a Llama-style decode layer (one launch per stage).

Used by the ``nvidia`` plugin (chained with programmatic dependent launch when ``USE_PDL``) and
by the ``amd`` plugin's ``staged`` mode (``USE_PDL`` off: portable Triton, no ``tl.extra.cuda``
is ever traced). Each GEMV kernel loads its first weight block *before* waiting on the previous
launch, so weight traffic overlaps the previous kernel's tail, and lets its own dependent launch
start after its main loop (``PDL_EARLY``: right after the wait instead, ``LaunchConfig.pdl_early``).

Stages: (1) RMSNorm + QKV GEMV + RoPE + paged KV write; (2) split-KV decode attention with the
GQA group packed in one tile; (3) split merge (none with one split, none with ``FUSED_MERGE``: the last split
program merges); (4) GEMV + residual (o_proj, down);
(5) RMSNorm + gate-up GEMV + SiLU(gate) * up.
``DOT_F32`` runs every dot in float32 at full precision (`input_precision="ieee"`, not TF32: float32 layers
match the float32 reference on a GPU as on the interpreter; the interpreter's bf16 dot is not reliable).
FP8 (e4m3) weights: ``HAS_SCALE`` kernels widen each weight tile in registers (``_dot``: to bf16 for the tensor
cores, exact) and multiply the finished float32 sums by each output row's scale (``s_ptr``). FP8 KV caches
(``KV_FP8``): the qkv epilogue stores ``k * inv_k_scale`` saturated and rounded to e4m3 (``e4m3_rne``), the
attention multiplies the scores by ``k_scale`` (folded into ``scale``) and its output by ``v_scale``. Its two dots widen
the FP8 K / V tiles to bf16 as ``_dot`` does, or with ``KV_F16`` (``LaunchConfig.attn_f16``) to fp16 (one
``cvt.rn.f16x2.e4m3x2`` per two elements; bf16 goes through float32, three conversions), q cast once per split to fp16
times 2^-4 (``scaled_f16``; the scores times 16, folded into ``scale``) and p (in [0, 1]) to fp16, float32 sums.
The batch ``B`` of the three GEMV kernels is a ``tl.constexpr``: one compile per batch size (lmserver's decode graphs
capture 1, 2, 4, 8, then multiples of 8; its warm-up compiles 1, 2, 4, 8), and a runtime ``B`` cost the 8B layer on the H200 12 us
per gate-up launch from batch 2 (73.3 against 61.6 us at batch 4; batch 1 was already specialized by Triton,
an int argument equal to 1 being a constant), benchmarks/RESULTS.md "lowlat", sixth session.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat.kernels.online_softmax import merge_partials, softmax_step, split_partial


@triton.jit
def _dot(a, w, acc, DOT_F32: tl.constexpr):
    """``acc + a @ w``: in float32 at full precision (``ieee``, not TF32) with DOT_F32, else in ``w``'s dtype (``a``
    cast to it) with float32 accumulation."""
    # NOTE: one if / elif / else: Triton traces the code after a static if that returns, so a fall-through dot in
    # fp8 would be traced (and fail its K >= 32 check at head_dim 16, seen on the H200) even when not taken
    W_FP8: tl.constexpr = w.dtype.is_fp8()
    if DOT_F32:
        out = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    elif W_FP8:  # FP8 weights or KV: widened to bf16 (every e4m3 value is one), the other side too
        out = tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16), acc)
    else:
        out = tl.dot(a.to(w.dtype), w, acc)
    return out


@triton.jit
def scaled_f16(x, DOT_F32: tl.constexpr):
    """``x`` (float32) times 2^-4 in fp16 (finite up to ~1.05e6 in magnitude, 65,504 unscaled; the caller multiplies
    its float32 products by 16, exact). On a GPU the multiply is inline PTX, as in mrow's ``mrow_f16s``: written as
    ``x * 0.0625``, LLVM narrows it past the cast of a value loaded as bf16 (``cvt.rn.f16x2.f32`` then ``mul.f16x2``)
    and the cast overflows first (the H200's NaN rows of 2026-12-03; benchmarks/fp8/GPU_NOTES.md). With ``DOT_F32``
    (the interpreter, which runs no inline PTX, or float32 activations, which nothing narrows) a plain multiply."""
    if DOT_F32:
        y = x * 0.0625
    else:
        y = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, 0f3D800000;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return y.to(tl.float16)


@triton.jit
def e4m3_rne(y):
    """``y`` (float32, within +-448) rounded to the nearest e4m3 value, ties to even, as float32: the narrowing store
    after it is exact. The GPU's conversion rounds the same way; Triton's interpreter drops the carry of a rounded-up
    mantissa (124 -> 64), so the rounding is done here, on the bits: 20 of float32's 23 mantissa bits dropped
    (normal e4m3), or to a multiple of 2^-9 below 2^-6 (subnormal e4m3)."""
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = ~0xFFFFF
    sub = (tl.abs(y) + 24576.0) - 24576.0  # 1.5 * 2^14: float32's step there is 2^-9
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # y's sign (-0 too)
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


@triton.jit
def row_scales(s_ptr, rows, mask, HAS_SCALE: tl.constexpr):
    """Per-output-row FP8 weight scales of ``rows`` (float32), or 1.0 without ``HAS_SCALE``."""
    if HAS_SCALE:
        return tl.load(s_ptr + rows, mask=mask, other=0.0)
    return tl.full(rows.shape, 1.0, tl.float32)


@triton.jit
def rms_rstd(x_ptr, B, eps, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / RMS of each of the first B rows of x (rows of H elements), as (BLOCK_M,) float32."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    ss = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        km = (k0 + offs_k) < H
        xv = tl.load(x_ptr + offs_m[:, None] * H + k0 + offs_k[None, :], mask=(offs_m[:, None] < B) & km[None, :], other=0.0)
        xv = xv.to(tl.float32)
        ss += tl.sum(xv * xv, 1)
    return 1.0 / tl.sqrt(ss / H + eps)


@triton.jit
def qkv_rope_kernel(
    x_ptr, norm_w_ptr, w_ptr, s_ptr, inv_freq_ptr, pos_ptr, loc_ptr,  # inputs
    q_ptr, k_cache_ptr, v_cache_ptr,  # outputs
    B: tl.constexpr, eps,
    stride_ks, stride_kh, stride_vs, stride_vh, inv_k_scale, inv_v_scale,
    H: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
    HAS_SCALE: tl.constexpr, KV_FP8: tl.constexpr,
):
    # One tile = BLOCK_P rotary pairs (rows r1 and r1 + D/2) of one q, k or v head, for all rows.
    HALF: tl.constexpr = D // 2
    PB: tl.constexpr = HALF // BLOCK_P
    num_tiles = (NQ + 2 * NKV) * PB
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < B
    offs_k = tl.arange(0, BLOCK_K)
    offs_p = tl.arange(0, BLOCK_P)
    pid = tl.program_id(0)
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        head = tile // PB
        r1 = head * D + (tile % PB) * BLOCK_P + offs_p
        r2 = r1 + HALF
        k_mask = offs_k < H
        w1 = tl.load(w_ptr + r1[None, :] * H + offs_k[:, None], mask=k_mask[:, None], other=0.0)  # (BK, BP)
        w2 = tl.load(w_ptr + r2[None, :] * H + offs_k[:, None], mask=k_mask[:, None], other=0.0)
        gamma = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        cos, sin, loc = _rope_factors(tile, pos_ptr, loc_ptr, inv_freq_ptr, B, D, BLOCK_M, BLOCK_P)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            if PDL_EARLY:
                tl.extra.cuda.gdc_launch_dependents()
        rstd = rms_rstd(x_ptr, B, eps, H, BLOCK_M, BLOCK_K)
        xv = tl.load(x_ptr + offs_m[:, None] * H + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        xn = xv.to(tl.float32) * gamma[None, :]
        acc1 = _dot(xn, w1, tl.zeros((BLOCK_M, BLOCK_P), tl.float32), DOT_F32)
        acc2 = _dot(xn, w2, tl.zeros((BLOCK_M, BLOCK_P), tl.float32), DOT_F32)
        for k0 in range(BLOCK_K, H, BLOCK_K):
            km = (k0 + offs_k) < H
            w1 = tl.load(w_ptr + r1[None, :] * H + k0 + offs_k[:, None], mask=km[:, None], other=0.0)
            w2 = tl.load(w_ptr + r2[None, :] * H + k0 + offs_k[:, None], mask=km[:, None], other=0.0)
            gamma = tl.load(norm_w_ptr + k0 + offs_k, mask=km, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + offs_m[:, None] * H + k0 + offs_k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0)
            xn = xv.to(tl.float32) * gamma[None, :]
            acc1 = _dot(xn, w1, acc1, DOT_F32)
            acc2 = _dot(xn, w2, acc2, DOT_F32)
        if USE_PDL and not PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        s1 = row_scales(s_ptr, r1, r1 >= 0, HAS_SCALE)
        s2 = row_scales(s_ptr, r2, r2 >= 0, HAS_SCALE)
        _rope_store(acc1 * rstd[:, None] * s1[None, :], acc2 * rstd[:, None] * s2[None, :], tile, cos, sin, loc, q_ptr,
                    k_cache_ptr, v_cache_ptr, B, stride_ks, stride_kh, stride_vs, stride_vh, inv_k_scale, inv_v_scale,
                    NQ, NKV, D, BLOCK_M, BLOCK_P, KV_FP8)


@triton.jit
def _rope_factors(tile, pos_ptr, loc_ptr, inv_freq_ptr, B, D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    """cos, sin (BLOCK_M, BLOCK_P) of a qkv tile's rotary pairs and each row's KV slot (BLOCK_M,): step inputs
    written before any layer ran, so the qkv kernels compute them before their PDL wait."""
    PB: tl.constexpr = (D // 2) // BLOCK_P
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < B
    pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0).to(tl.float32)
    freq = tl.load(inv_freq_ptr + (tile % PB) * BLOCK_P + tl.arange(0, BLOCK_P))
    ang = pos[:, None] * freq[None, :]
    loc = tl.load(loc_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    return tl.cos(ang), tl.sin(ang), loc


@triton.jit
def _rope_store(
    a, b, tile, cos, sin, loc, q_ptr, k_cache_ptr, v_cache_ptr,
    B, stride_ks, stride_kh, stride_vs, stride_vh, inv_k_scale, inv_v_scale,
    NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Epilogue of a qkv tile: ``a``, ``b`` (BLOCK_M, BLOCK_P) are the normalized projections of rows
    r1 and r1 + D/2 of one head; RoPE (``_rope_factors``) for q and k heads, then q to ``q_ptr``, k and v
    to the cache at each row's slot ``loc`` (``KV_FP8``: times ``inv_k_scale`` / ``inv_v_scale``, saturated at
    +-448 and rounded to e4m3)."""
    HALF: tl.constexpr = D // 2
    PB: tl.constexpr = HALF // BLOCK_P
    head = tile // PB
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < B
    offs_p = tl.arange(0, BLOCK_P)
    is_q = head < NQ
    is_k = (head >= NQ) & (head < NQ + NKV)
    is_v = head >= NQ + NKV
    rope = is_q | is_k
    o1 = tl.where(rope, a * cos - b * sin, a)
    o2 = tl.where(rope, b * cos + a * sin, b)
    col = (tile % PB) * BLOCK_P + offs_p  # column inside the head
    full = m_mask[:, None] & (offs_p[None, :] < BLOCK_P)  # (BLOCK_M, BLOCK_P)
    q_mask = full & (tl.zeros_like(full) | is_q)
    k_mask_s = full & (tl.zeros_like(full) | is_k)
    v_mask = full & (tl.zeros_like(full) | is_v)
    qp = q_ptr + offs_m[:, None] * (NQ * D) + head * D + col[None, :]
    tl.store(qp, o1, mask=q_mask)
    tl.store(qp + HALF, o2, mask=q_mask)
    if KV_FP8:
        inv = tl.where(is_k, inv_k_scale, inv_v_scale)
        o1 = e4m3_rne(tl.clamp(o1 * inv, -448.0, 448.0))
        o2 = e4m3_rne(tl.clamp(o2 * inv, -448.0, 448.0))
    kh = head - NQ
    kp = k_cache_ptr + loc[:, None] * stride_ks + kh * stride_kh + col[None, :]
    tl.store(kp, o1, mask=k_mask_s)
    tl.store(kp + HALF, o2, mask=k_mask_s)
    vh = head - NQ - NKV
    vp = v_cache_ptr + loc[:, None] * stride_vs + vh * stride_vh + col[None, :]
    tl.store(vp, o1, mask=v_mask)
    tl.store(vp + HALF, o2, mask=v_mask)


@triton.jit
def _attend_block(q, k, v, s_mask, scale, m_i, l_i, acc, DOT_F32: tl.constexpr, GUARD: tl.constexpr,
                  KV_F16: tl.constexpr = False):
    """One K/V tile of online softmax (``online_softmax.softmax_step``, GUARD for rows that may have no key yet):
    scores masked by ``s_mask`` (broadcast to (rows, BLOCK_N)); returns the updated (max, sum, accumulator).
    KV_F16 (an FP8 cache): ``q`` is already fp16 (``scaled_f16``), the K / V tiles widened to fp16 and p cast to it,
    float32 sums (``scale`` includes the 16)."""
    # NOTE: the fp16 dots are not `_dot`'s (the GEMV stages keep its bf16 widening)
    if KV_F16:
        s = tl.dot(q, k.to(tl.float16))
    else:
        s = _dot(q, k, tl.zeros((q.shape[0], k.shape[1]), tl.float32), DOT_F32)
    s = tl.where(s_mask, s * scale, float("-inf"))
    m_i, l_i, p, alpha = softmax_step(m_i, l_i, s, GUARD)
    if KV_F16:
        acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc * alpha[:, None])
    else:
        acc = _dot(p, v, acc * alpha[:, None], DOT_F32)
    return m_i, l_i, acc


@triton.jit
def _score_mask(offs_n, n_mask, lim, ROW_LIMITS: tl.constexpr):
    """The scores' mask of a K/V tile: positions in range (``n_mask``, (1, BLOCK_N)), or with ROW_LIMITS each query
    row's own limit (positions ``< lim``, (rows, BLOCK_N); ``lim`` (rows,) within the split's end)."""
    if ROW_LIMITS:
        mask = offs_n[None, :] < lim[:, None]
    else:
        mask = n_mask[None, :]
    return mask


@triton.jit
def _kv_tile_ptrs(t0, end, row, kvh, req_to_token_ptr, k_cache_ptr, v_cache_ptr, stride_rt, stride_ks, stride_kh,
                  stride_vs, stride_vh, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions [t0, t0 + BLOCK_N) of request-table row ``row``: (positions, in-range mask, K tile pointers
    (D, BLOCK_N), V tile pointers (BLOCK_N, D)) of KV head ``kvh`` at the slots the table holds."""
    offs_n = t0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    offs_d = tl.arange(0, D)
    slots = tl.load(req_to_token_ptr + row * stride_rt + offs_n, mask=n_mask, other=0).to(tl.int64)
    k_ptrs = k_cache_ptr + slots[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None]
    v_ptrs = v_cache_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :]
    return offs_n, n_mask, k_ptrs, v_ptrs


@triton.jit
def _attend_split(
    q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    q_off, q_mask, part_row, lim, row, kvh, split, start, end, fresh_from,
    stride_rt, stride_ks, stride_kh, stride_vs, stride_vh, scale, v_scale,
    D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PARTIALS: tl.constexpr,
    DOT_F32: tl.constexpr, ROW_LIMITS: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
    FRESH_FROM: tl.constexpr = True, KV_F16: tl.constexpr = False,
):
    """One split of split-KV attention for a tile of query rows against KV head ``kvh`` of request-table row ``row``:
    positions [start, end) in tiles of BLOCK_N, online softmax (``online_softmax``), then the rows' output (v_scale
    applied) to ``out_ptr`` (without PARTIALS) or their partial and log-sum-exp at ``(part_row * NUM_SPLITS + split)``
    for a merge. Query row i is at ``q_ptr + q_off[i]`` (D values; ``out_ptr`` likewise), live where ``q_mask``; with
    ROW_LIMITS it attends to positions ``< lim[i]`` only (``lim`` within ``end``). The first tile's positions below
    ``fresh_from`` are read before the PDL wait (the previous launch writes only later ones), q and the rest after it;
    without FRESH_FROM (no PDL, nothing of the previous launch to wait for: the persistent kernel) in one load each.
    KV_F16 (FP8 caches only): the dots in fp16 (``_attend_block``), q cast once here.
    Shared by ``decode_attention_kernel``, ``rows_attn`` (both paths) and ``persistent`` (no PDL, always PARTIALS)."""
    offs_d = tl.arange(0, D)
    offs_n, n_mask, k_ptrs, v_ptrs = _kv_tile_ptrs(start, end, row, kvh, req_to_token_ptr, k_cache_ptr, v_cache_ptr,
                                                   stride_rt, stride_ks, stride_kh, stride_vs, stride_vh, D, BLOCK_N)
    if FRESH_FROM:
        old = n_mask & (offs_n < fresh_from)
        k = tl.load(k_ptrs, mask=old[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=old[:, None], other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            if PDL_EARLY:
                tl.extra.cuda.gdc_launch_dependents()
        newest = n_mask & (offs_n >= fresh_from)  # the previous launch's K/V: read after the wait
        k = tl.where(newest[None, :], tl.load(k_ptrs, mask=newest[None, :], other=0.0), k)
        v = tl.where(newest[:, None], tl.load(v_ptrs, mask=newest[:, None], other=0.0), v)
    else:  # nothing written by the previous launch (no PDL wait here)
        k = tl.load(k_ptrs, mask=n_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=q_mask[:, None], other=0.0)
    if KV_F16:  # q / 16 in fp16 once per split; the scores times 16 through the softmax scale
        q = scaled_f16(q.to(tl.float32), DOT_F32)
        scale = scale * 16.0
    m_i = tl.full((q_off.shape[0],), float("-inf"), tl.float32)
    l_i = tl.zeros((q_off.shape[0],), tl.float32)
    acc = tl.zeros((q_off.shape[0], D), tl.float32)
    if start < end:
        m_i, l_i, acc = _attend_block(q, k, v, _score_mask(offs_n, n_mask, lim, ROW_LIMITS), scale, m_i, l_i, acc,
                                      DOT_F32, ROW_LIMITS, KV_F16)
    for t0 in range(start + BLOCK_N, end, BLOCK_N):
        offs_n, n_mask, k_ptrs, v_ptrs = _kv_tile_ptrs(t0, end, row, kvh, req_to_token_ptr, k_cache_ptr, v_cache_ptr,
                                                       stride_rt, stride_ks, stride_kh, stride_vs, stride_vh, D, BLOCK_N)
        k = tl.load(k_ptrs, mask=n_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
        m_i, l_i, acc = _attend_block(q, k, v, _score_mask(offs_n, n_mask, lim, ROW_LIMITS), scale, m_i, l_i, acc,
                                      DOT_F32, ROW_LIMITS, KV_F16)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    out, lse = split_partial(acc, m_i, l_i, v_scale)
    if PARTIALS:
        base = part_row * NUM_SPLITS + split
        tl.store(part_o_ptr + base[:, None] * D + offs_d[None, :], out, mask=q_mask[:, None])
        tl.store(part_lse_ptr + base, lse, mask=q_mask)
    else:
        tl.store(out_ptr + q_off[:, None] + offs_d[None, :], out, mask=q_mask[:, None])


@triton.jit
def _decode_split(
    q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    b, kvh, split, splits, row, seq_len, stride_rt, stride_ks, stride_kh, stride_vs, stride_vh, scale, v_scale,
    NQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PARTIALS: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
    PDL_EARLY: tl.constexpr, FRESH: tl.constexpr, KV_F16: tl.constexpr = False,
):
    """Decode row ``b``'s program for KV head ``kvh`` and split ``split`` of ``splits`` (at most NUM_SPLITS, by which
    the partials are laid out): its GQA group of G heads in one tile of BLOCK_G query rows against the split's K/V
    tiles (``_attend_split``: partials with PARTIALS, else the output); at most FRESH of its last positions come from
    the previous launch. KV_F16: the dots in fp16 (an FP8 cache; ``_attend_block``)."""
    chunk = tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(seq_len, start + chunk)
    offs_g = tl.arange(0, BLOCK_G)
    heads = kvh * G + offs_g
    _attend_split(q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, part_o_ptr, part_lse_ptr, out_ptr,
                  b * (NQ * D) + heads * D, offs_g < G, b * NQ + heads, end, row, kvh, split, start, end,
                  seq_len - FRESH, stride_rt, stride_ks, stride_kh, stride_vs, stride_vh, scale, v_scale,
                  D, BLOCK_N, NUM_SPLITS, PARTIALS, DOT_F32, False, USE_PDL, PDL_EARLY, USE_PDL or FRESH > 0, KV_F16)


@triton.jit
def decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
    part_o_ptr, part_lse_ptr, out_ptr, count_ptr,
    stride_rt, stride_ks, stride_kh, stride_vs, stride_vh, scale, v_scale,
    NQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, FRESH: tl.constexpr,
    FUSED_MERGE: tl.constexpr = False, BLOCK_S: tl.constexpr = 1, BLOCK_GM: tl.constexpr = 1,
    KV_F16: tl.constexpr = False,
):
    # grid (batch, kv_heads, splits): the whole GQA group of one KV head shares each K/V tile. An FP8 cache: `scale`
    # includes k_scale, the output is multiplied by v_scale (1.0 otherwise); KV_F16: its dots in fp16 (_attend_block).
    # One split: the output goes straight to out_ptr (B, NQ * D), no partials and no merge launch.
    # FUSED_MERGE (several splits): the split program that finishes last for its (row, KV head) merges the group's
    # partials into out_ptr itself (`_merge_if_last`, a counter per (row, KV head) in count_ptr), so no merge launch.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # NOTE: before the wait, the split's first K/V tile: the previous launch (qkv) writes q and the K/V of this step's
    # rows: at most FRESH positions, the last ones of each row (a decode row: its newest token; row j of a verify step:
    # its request's drafts up to its own, seq_len - 1 - j .. seq_len - 1); the lengths, the request table and older K/V
    # come from earlier launches or steps.
    _decode_split(q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, part_o_ptr, part_lse_ptr, out_ptr, b, kvh, split,
                  NUM_SPLITS, tl.load(req_idx_ptr + b).to(tl.int64), tl.load(seq_lens_ptr + b), stride_rt, stride_ks,
                  stride_kh, stride_vs, stride_vh, scale, v_scale, NQ, G, D, BLOCK_G, BLOCK_N, NUM_SPLITS,
                  NUM_SPLITS > 1, DOT_F32, USE_PDL, PDL_EARLY, FRESH, KV_F16)
    if FUSED_MERGE and NUM_SPLITS > 1:
        _merge_if_last(count_ptr + b * tl.num_programs(1) + kvh, part_o_ptr, part_lse_ptr, out_ptr, b, kvh, NQ, G, D,
                       NUM_SPLITS, BLOCK_S, BLOCK_GM)


@triton.jit
def _merge_if_last(count_ptr, part_o_ptr, part_lse_ptr, out_ptr, b, kvh, NQ: tl.constexpr, G: tl.constexpr,
                   D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_GM: tl.constexpr):
    """After a split program stored its partials: count it at ``count_ptr`` (one int32 per (row, KV head)); the
    program that counts last merges the NUM_SPLITS partials of the G heads of KV head ``kvh`` into ``out_ptr`` (as
    ``merge_splits_kernel``, all (head, split) partials in one (BLOCK_GM, BLOCK_S, D) load: one round trip, not one per
    split) and sets the counter back to 0 for the next launch. The barrier orders every thread's partial stores
    before the count; the count is acquire-release at GPU scope, so the last program's reads (through L2: ``.cg``)
    see every split's stores."""
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if done == NUM_SPLITS - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        offs_h = tl.arange(0, BLOCK_GM)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, D)
        heads = kvh * G + offs_h
        first = (b * NQ + heads) * NUM_SPLITS  # (BLOCK_GM,)
        hs_mask = (offs_h[:, None] < G) & (offs_s[None, :] < NUM_SPLITS)  # (BLOCK_GM, BLOCK_S)
        idx = first[:, None] + offs_s[None, :]
        lse = tl.load(part_lse_ptr + idx, mask=hs_mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_o_ptr + idx[:, :, None] * D + offs_d[None, None, :], mask=hs_mask[:, :, None], other=0.0,
                    cache_modifier=".cg")  # (BLOCK_GM, BLOCK_S, D)
        out = merge_partials(o, lse, 1)
        tl.store(out_ptr + b * (NQ * D) + heads[:, None] * D + offs_d[None, :], out, mask=(offs_h < G)[:, None])


@triton.jit
def _merge_program(part_o_ptr, part_lse_ptr, out_ptr, used_ptr, NQ: tl.constexpr, D: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
                   HAS_USED: tl.constexpr):
    """Program (b, h) of a merge launch: the log-sum-exp merge (``online_softmax.merge_partials``) of row ``b``'s
    split partials of head ``h`` into ``out_ptr`` (batch, heads * D); with HAS_USED only its first ``used_ptr[b]``
    splits (the others may hold stale partials)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    if HAS_USED:
        s_mask = s_mask & (offs_s < tl.load(used_ptr + b))
    offs_d = tl.arange(0, D)
    base = (b * NQ + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    o = tl.load(part_o_ptr + (base + offs_s[:, None]) * D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    out = merge_partials(o, lse, 0)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + b * (NQ * D) + h * D + offs_d, out)


@triton.jit
def merge_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    NQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
    PDL_EARLY: tl.constexpr,
):
    # grid (batch, heads): log-sum-exp merge of the split partials into (batch, heads * D).
    _merge_program(part_o_ptr, part_lse_ptr, out_ptr, part_lse_ptr, NQ, D, NUM_SPLITS, BLOCK_S, USE_PDL, PDL_EARLY,
                   False)


@triton.jit
def gemv_residual_kernel(
    a_ptr, w_ptr, s_ptr, res_ptr, out_ptr,
    B: tl.constexpr,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
    LOOP: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr,
):
    # out[b, n] = res[b, n] + s[n] * sum_k a[b, k] * w[n, k]   (o_proj + residual, down + residual; s: FP8 scales)
    # HAS_RES off: no residual (a row-parallel partial under TP, summed over the ranks before the residual add)
    # LOOP: fewer programs than tiles, each looping over tiles (GemvConfig.programs); else one tile each
    if LOOP:
        for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
            _gemv_residual_tile(tile, a_ptr, w_ptr, s_ptr, res_ptr, out_ptr, B, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                DOT_F32, USE_PDL, PDL_EARLY, HAS_SCALE, HAS_RES)
    else:
        _gemv_residual_tile(tl.program_id(0), a_ptr, w_ptr, s_ptr, res_ptr, out_ptr, B, N, K, BLOCK_M, BLOCK_N,
                            BLOCK_K, DOT_F32, USE_PDL, PDL_EARLY, HAS_SCALE, HAS_RES)


@triton.jit
def _gemv_residual_tile(
    pid, a_ptr, w_ptr, s_ptr, res_ptr, out_ptr,
    B: tl.constexpr,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < B
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
    # NOTE: the residual before the wait too: it comes from two or more launches back (gemv_rows_residual_kernel)
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        res = tl.load(res_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        res = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    acc = _dot(a, w, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DOT_F32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        km = (k0 + offs_k) < K
        w = tl.load(w_ptr + offs_n[None, :] * K + k0 + offs_k[:, None], mask=n_mask[None, :] & km[:, None], other=0.0)
        a = tl.load(a_ptr + offs_m[:, None] * K + k0 + offs_k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0)
        acc = _dot(a, w, acc, DOT_F32)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    acc = acc * row_scales(s_ptr, offs_n, n_mask, HAS_SCALE)[None, :]
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc + res, mask=mask)


@triton.jit
def residual_add_kernel(x_ptr, r_ptr, out_ptr, N: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    # out[b, n] = x[b, n] + r[b, n] in float32, stored in out's dtype; grid (rows, column blocks). Under TP: the
    # residual add after a row-parallel projection's partials were summed over the ranks (r, the reduced sum).
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + b * N + offs, mask=mask, other=0.0)  # the residual: from launches before the reduce
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    r = tl.load(r_ptr + b * N + offs, mask=mask, other=0.0)
    tl.store(out_ptr + b * N + offs, x.to(tl.float32) + r.to(tl.float32), mask=mask)


@triton.jit
def norm_gate_up_kernel(
    x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr,
    B: tl.constexpr, eps,
    H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
    LOOP: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    # act[b, j] = silu(g) * u with g, u = rmsnorm(x)[b] . w[j], w[INTER + j]
    # LOOP: fewer programs than tiles, each looping over tiles (GemvConfig.programs); else one tile each
    if LOOP:
        for tile in range(tl.program_id(0), tl.cdiv(INTER, BLOCK_N), tl.num_programs(0)):
            _norm_gate_up_tile(tile, x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr, B, eps, H, INTER, BLOCK_M, BLOCK_N,
                               BLOCK_K, DOT_F32, USE_PDL, PDL_EARLY, HAS_SCALE)
    else:
        _norm_gate_up_tile(tl.program_id(0), x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr, B, eps, H, INTER, BLOCK_M,
                           BLOCK_N, BLOCK_K, DOT_F32, USE_PDL, PDL_EARLY, HAS_SCALE)


@triton.jit
def _norm_gate_up_tile(
    pid, x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr,
    B: tl.constexpr, eps,
    H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < B
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < H
    wm = n_mask[None, :] & k_mask[:, None]
    wg = tl.load(w_ptr + offs_n[None, :] * H + offs_k[:, None], mask=wm, other=0.0)
    wu = tl.load(w_ptr + (INTER + offs_n[None, :]) * H + offs_k[:, None], mask=wm, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    rstd = rms_rstd(x_ptr, B, eps, H, BLOCK_M, BLOCK_K)
    gamma = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + offs_m[:, None] * H + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    xn = xv.to(tl.float32) * gamma[None, :]
    g = _dot(xn, wg, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DOT_F32)
    u = _dot(xn, wu, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DOT_F32)
    for k0 in range(BLOCK_K, H, BLOCK_K):
        km = (k0 + offs_k) < H
        wm = n_mask[None, :] & km[:, None]
        wg = tl.load(w_ptr + offs_n[None, :] * H + k0 + offs_k[:, None], mask=wm, other=0.0)
        wu = tl.load(w_ptr + (INTER + offs_n[None, :]) * H + k0 + offs_k[:, None], mask=wm, other=0.0)
        gamma = tl.load(norm_w_ptr + k0 + offs_k, mask=km, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + offs_m[:, None] * H + k0 + offs_k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0)
        xn = xv.to(tl.float32) * gamma[None, :]
        g = _dot(xn, wg, g, DOT_F32)
        u = _dot(xn, wu, u, DOT_F32)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    g = g * rstd[:, None] * row_scales(s_ptr, offs_n, n_mask, HAS_SCALE)[None, :]
    u = u * rstd[:, None] * row_scales(s_ptr, INTER + offs_n, n_mask, HAS_SCALE)[None, :]
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + offs_m[:, None] * INTER + offs_n[None, :], act, mask=m_mask[:, None] & n_mask[None, :])
