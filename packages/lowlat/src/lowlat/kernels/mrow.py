"""Multi-row GEMV for 2..16 rows (speculative verify steps, small decode batches): each weight tile read once.

``out[m, n] = sum_k x[m, k] * w[n, k]`` for every row ``m < B``, computed as ``acc (BLOCK_N, BLOCK_M) = w_tile
(BLOCK_N, BLOCK_K) @ x_tile.T (BLOCK_K, BLOCK_M)``: the weight tile is the left operand and the rows are the narrow
side (``BLOCK_M`` = the rows padded to a power of two, at least 8 for the tensor cores: an ``mma`` of n = 8 has no
padding at 8 rows). Two cores over the same tiles (``GemvConfig.variant``):

- ``mrow``: ``tl.dot`` (tensor cores). ``lowlat.kernels.layer``'s ``dot`` kernels put the rows on the left, padded to
  16, and stage each weight tile through shared memory as the right operand; here the weight rows are the MMA's
  M side, so a tile of 16-128 weight rows needs no row padding and the activations are the small operand.
- ``mrow_fma``: a broadcast multiply and one reduction over K per tile step (CUDA cores, no shared memory staging
  of the weights): ``sum(w[:, None, :] * x[None, :, :], 2)``.

The three GEMV stages of a Llama layer have twins here (``ops`` dispatches on the variant): GEMV + residual (o_proj,
down; without the residual: any projection), RMSNorm + gate-up + SiLU, RMSNorm + QKV + RoPE + KV write. Like the other
kernels, each loads its first weight tile (and the residual, and the RoPE factors) before its PDL wait, accumulates
the norm's sum of squares in the main loop (no pass over x after the wait), and releases its dependent launch after
the main loop (``PDL_EARLY``: right after the wait). ``B`` is a ``tl.constexpr`` (one compile per row count).

Measured on the H200 (benchmarks/speculative/bench_verify_gemv.py, 8B shapes, PDL-chained over distinct weights;
benchmarks/RESULTS.md issue 34, 2026-12-02):

- ``mrow``'s time does not grow with the rows, as cuBLAS's does not: 1 to 8 rows within 1-5% (o_proj 10.9 us,
  gate-up 60.0, down 31.0, LM head 237), 3.8-4.4 TB/s; but 1.03-1.11x the row-wise M = 1 kernel at one row.
- The weight rows per tile (the MMA's M side) must be 32 or more: tiles of 16 rows cost 1.2-2.4x (o_proj 13.3-14.3
  us vs 10.9), and some configs of gate-up (two accumulators) collapse to 1-2 ms (32 x 512 x 4 warps x 3 stages;
  8 warps), likely register spills: never pick one unmeasured. Best: o_proj 32 x 256 (4 warps, 4 stages), gate-up 64 x 128
  (4, 4) or 128 x 128 (8, 3), down 32 x 512 (4, 3), LM head 64 x 128-256.
- The qkv twin as two dots of BLOCK_P rows (r1 and r1 + D/2) was the slowest stage: with BLOCK_P 32 (the MMA's M 32)
  there are only 96 tiles for 132 SMs: 23.5 us against 20.6 for the ``dot`` kernel and 14.7 row-wise at M = 1;
  BLOCK_P 16 was under the MMA's size (39 us). It now runs one dot over the 2 * BLOCK_P rows of a tile, interleaved,
  split into the two halves for RoPE after the loop: BLOCK_P 32 (M 64) 21.25 us, still above ``dot``'s 20.67; BLOCK_P
  16 (M 32 on 192 tiles, the expected lever) 29.4, 8 35.0 (RESULTS.md issue 34, fifth session). qkv stays ``dot``.

FP8 (e4m3) weights (``HAS_SCALE``): each tile is widened to bf16 in registers before the MMA (exact) and the finished
float32 sums take their rows' scales (before the residual). At 8 rows on the H200 8B shape they win gate-up only
(128 x 128, 8 warps: 51.7 us vs ``dot`` 56.8) and lose 45-58% on o_proj and down (16.2 vs 11.2, 47.6 vs 30.1).
- ``mrow_f16`` (FP8 weights widened to fp16, one conversion per two weights, instead of bf16 through float32: in
  the sm_90 code of an FP8 gate-up tile 256 slow-pipe ``F2F`` conversions per step go away): at one row on the H200
  (RESULTS.md issue 33, 2026-12-02) gate-up 64 x 256 (4 warps, 3 stages) 32.98 us against the row-wise 33.32 (noise),
  o_proj 8.72 (32 x 256) against 6.04, down 22.26 (32 x 512) against 16.93, qkv 16.52 (32 pairs) against 10.16. At
  8 rows (2026-12-03) as fast as at one: qkv 16.27, o_proj 8.68, gate-up 32.65, down 22.68 us against the bf16-widening
  kernels' 20.14, 10.88, 52.00, 29.75: ``tuning.FP8_TABLES`` at 2-8 rows. Activations above 65,504 in magnitude
  overflow fp16 (NaN rows on the H200); ``mrow_f16s`` scales the rows by 2^-4 first (up to ~1.05e6; PTX checked
  cross-compiled, not yet run on a GPU).
- Split-K (``SPLIT``, ``GemvConfig.split_k``; o_proj / down): SPLIT programs per output tile over K / SPLIT columns
  each, partials through a float32 workspace, the last program of a tile (an int32 counter, as the fused attention
  merge) summing them in split order onto the residual. Meant for grids of few tiles (o_proj and down: 128 tiles of 32
  rows for 132 SMs); at 8 rows with FP8 weights it lost (o_proj 9.69 with 4 splits vs 8.68, down 24.54-26.46 with
  4-7 vs 22.68, 2026-12-03): in no table.
- ``mrow_w8a8`` / ``mrow_w8a8b`` (W8A8, ``MMA`` 4 / 5; FP8 weights only): no weight conversion at all. The rows are
  quantized to e4m3 in the kernel and the MMA runs FP8 x FP8 (sm_90: ``wgmma`` m64n16k32 e4m3), float32 sums, the
  rows padded to 16 (with 8, Triton lowers the dot to an fp16 ``mma.sync``). ``mrow_w8a8``: one scale per row,
  amax(|row|) / 448 over all of K (the prefill's per-token rule), from a pass over the rows after the PDL wait
  (``_rows_amax``: each program reads its rows' K columns from L2 once more before its first MMA, pipelined through
  shared memory; sm_90 PTX: 8 ``cp.async`` of 16 bytes per thread and step of 8,192 elements, two barriers per step);
  the epilogue multiplies by weight row scale x row scale. ``mrow_w8a8b``: one scale per row and K block (BLOCK_K
  columns, as the 1 x 128 activation groups of block-scaled FP8 recipes): no pass before the loop, each K step's
  partial sums times its block scales. Both quantize each (BLOCK_M, BLOCK_K) row tile once per program and K step
  (multiply by the reciprocal scale, clamp, ``cvt.rn.satfinite.e4m3x2.f32``); the FP8 MMA's partial sums are added
  into a float32 accumulator at least every 128 products (``max_num_imprecise_acc``: sm_90's FP8 MMA accumulates in
  reduced precision). ``wgmma`` needs 64 weight rows per warp group: with fewer (``block_n`` 32 at 4 warps) Triton
  3.6 / 3.9 fall back to ``mma.sync`` with both operands widened to fp16 (``cvt.rn.f16x2.e4m3x2``): no W8A8 gain.
  Split-K (``split_k``) fills the GPU with 64-row tiles (o_proj / down: 64 tiles for 132 SMs). Not measured on a
  GPU yet, in no table (benchmarks/fp8/GPU_NOTES.md).
- ``mrow_fma`` (CUDA cores) is 1.5x slower at one row and 4.7-7x at 8 (a cross-thread reduction per tile step and
  registers for the (BLOCK_N, BLOCK_M, BLOCK_K) product); kept as a reference point, in no table.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat.kernels.layer import _rope_factors, _rope_store, e4m3_rne, row_scales


@triton.jit
def _wx(w, x, acc, MMA: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc (BN, BM) + w (BN, BK) @ x (BM, BK).T``; ``x`` is float32 (already scaled). FP8 (e4m3) weights: the tile
    widened to bf16 in registers (exact: every e4m3 value is one), the rows rounded to bf16 as for bf16 weights;
    ``MMA`` 2 (``mrow_f16``): to fp16 instead (exact too; one ``cvt.rn.f16x2.e4m3x2`` per two weights, where bf16
    goes through float32: three conversions on the slow conversion pipe), the rows rounded to fp16 (more mantissa than
    bf16; finite only below 65504 in magnitude)."""
    # NOTE: one if / elif / else chain (layer._dot's note: a fall-through fp8 dot would be traced)
    W_FP8: tl.constexpr = w.dtype.is_fp8()
    if not MMA:
        out = acc + tl.sum(w.to(tl.float32)[:, None, :] * x[None, :, :], 2)
    elif DOT_F32:
        out = tl.dot(w.to(tl.float32), tl.trans(x), acc, input_precision="ieee")
    elif W_FP8 and MMA == 2:
        out = tl.dot(w.to(tl.float16), tl.trans(x.to(tl.float16)), acc)
    elif W_FP8 and MMA == 3:
        # mrow_f16s: the rows times 2^-4 before the cast, the product times 2^4 (exact, powers of two), so fp16 holds
        # activations up to ~1.05e6 (65,504 unscaled). The multiply is inline PTX: written as `x * 0.0625`, LLVM
        # narrows it past the cast (`cvt.rn.f16x2.f32` then `mul.f16x2`: x comes from a bf16 load) and the cast
        # overflows first (the H200's NaN rows of 2026-12-03; benchmarks/fp8/GPU_NOTES.md)
        xs = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, 0f3D800000;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                       pack=1)
        out = acc + tl.dot(w.to(tl.float16), tl.trans(xs.to(tl.float16))) * 16.0
    elif W_FP8:
        out = tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)), acc)
    else:
        out = tl.dot(w, tl.trans(x.to(w.dtype)), acc)
    return out


# the most FP8 products the MMA sums in its reduced-precision accumulator before a float32 add (sm_90 wgmma)
W8A8_IMPRECISE_K = tl.constexpr(128)


@triton.jit
def _fp8_scale(amax):
    """(scale, 1 / scale) of rows whose largest magnitude is ``amax``: scale = amax / 448 (IEEE-rounded, as the
    prefill's per-token quantizer and torch), at least 1e-12 (a zero or padding row: its values stay 0, never 0 / 0)."""
    scale = tl.maximum(tl.div_rn(amax, 448.0), 1e-12)
    return scale, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _to_e4m3(v, SOFT_RNE: tl.constexpr):
    """float32 ``v`` saturated to +-448 and narrowed to e4m3 (round to nearest even). ``SOFT_RNE``: rounded on the
    bits first (``layer.e4m3_rne``: Triton's interpreter drops the carry of a rounded-up mantissa; the GPU's
    ``cvt.rn.satfinite`` needs no help)."""
    v = tl.clamp(v, -448.0, 448.0)
    if SOFT_RNE:
        v = e4m3_rne(v)
    return v.to(tl.float8e4nv)


# the W8A8 per-row pass (``_rows_amax``): elements of the rows per load step (16 KB of bf16: 64 per thread at 4 warps)
AMAX_ELEMS = tl.constexpr(8192)


@triton.jit
def _rows_amax(x_ptr, norm_w_ptr, B: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, NORMED: tl.constexpr):
    """max_k |x[m, k]| (``NORMED``: of ``x[m, k] * norm_w[k]``, the values the K loop quantizes) of the first B rows as
    (BLOCK_M,) float32 (0 for padding rows). Steps of AMAX_ELEMS elements over only the B rows (padded to a power of
    two, not to the MMA's 16), software-pipelined (``tl.range`` stages): the pass is on the launch's critical path,
    between the PDL wait and the first MMA."""
    RP: tl.constexpr = 1 if B == 1 else (2 if B <= 2 else (4 if B <= 4 else (8 if B <= 8 else BLOCK_M)))
    AK: tl.constexpr = AMAX_ELEMS // RP
    offs_m = tl.arange(0, RP)
    amax = tl.zeros((RP,), tl.float32)
    for k0 in tl.range(0, K, AK, num_stages=4):
        offs_k = k0 + tl.arange(0, AK)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m[:, None] < B) & (offs_k[None, :] < K),
                    other=0.0).to(tl.float32)
        if NORMED:
            x = x * tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
    out = tl.zeros((BLOCK_M,), tl.float32)
    for m in tl.static_range(RP):  # (RP,) -> (BLOCK_M,): one select per row (RP <= BLOCK_M)
        out = tl.where(tl.arange(0, BLOCK_M) == m, tl.max(tl.where(offs_m == m, amax, 0.0), 0), out)
    return out


@triton.jit
def _w8a8_prologue(x_ptr, norm_w_ptr, B: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, MMA: tl.constexpr,
                   NORMED: tl.constexpr):
    """The rows' (scale, 1 / scale) for the K loop: ``MMA`` 4 (per row) from ``_rows_amax``; else ones (unused)."""
    if MMA == 4:
        xs, xinv = _fp8_scale(_rows_amax(x_ptr, norm_w_ptr, B, K, BLOCK_M, NORMED))
    else:
        xs = tl.full((BLOCK_M,), 1.0, tl.float32)
        xinv = xs
    return xs, xinv


@triton.jit
def _wxa(w, x, xinv, acc, MMA: tl.constexpr, DOT_F32: tl.constexpr):
    """``_wx``, or for ``MMA`` 4 / 5 (W8A8, FP8 ``w``) ``acc + w @ e4m3(x / scale).T``: 4 with the rows' scales
    (``xinv`` = 1 / scale, (BM,); the caller multiplies the sums by the scales), 5 with this K block's scales (the
    partial sums times them here; ``xinv`` unused). ``DOT_F32`` (the interpreter): the rounding on the bits."""
    BK: tl.constexpr = w.shape[1]
    IMPRECISE: tl.constexpr = W8A8_IMPRECISE_K if BK > W8A8_IMPRECISE_K else BK
    if MMA == 4:
        xq = _to_e4m3(x * xinv[:, None], DOT_F32)
        out = tl.dot(w, tl.trans(xq), acc, max_num_imprecise_acc=IMPRECISE)
    elif MMA == 5:
        bs, binv = _fp8_scale(tl.max(tl.abs(x), 1))
        xq = _to_e4m3(x * binv[:, None], DOT_F32)
        out = acc + tl.dot(w, tl.trans(xq), max_num_imprecise_acc=IMPRECISE) * bs[None, :]
    else:
        out = _wx(w, x, acc, MMA, DOT_F32)
    return out


@triton.jit
def _w8a8_epilogue(acc, xs, MMA: tl.constexpr):
    """The per-row W8A8 sums (``MMA`` 4) times their rows' scales (``acc`` (BN, BM)); else ``acc``."""
    if MMA == 4:
        acc = acc * xs[None, :]
    return acc


@triton.jit
def _rows(x_ptr, k0, B: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of the first B rows of x (rows of K elements) as (BLOCK_M, BLOCK_K) float32."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m[:, None] < B) & (offs_k[None, :] < K),
                other=0.0)
    return x.to(tl.float32)


@triton.jit
def _wtile(w_ptr, offs_n, n_mask, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows ``offs_n``, columns [k0, k0 + BLOCK_K): (BLOCK_N, BLOCK_K) in the weight dtype."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < K),
                   other=0.0)


@triton.jit
def mrow_residual_kernel(
    a_ptr, w_ptr, s_ptr, res_ptr, out_ptr, part_ptr, count_ptr,
    B: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MMA: tl.constexpr, DOT_F32: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
    LOOP: tl.constexpr, HAS_SCALE: tl.constexpr, SPLIT: tl.constexpr = 1,
):
    # out[b, n] = res[b, n] + sum_k a[b, k] * w[n, k] (o_proj, down; HAS_RES off: a plain projection)
    # LOOP: fewer programs than tiles, each looping over tiles (GemvConfig.programs); else one tile each
    # SPLIT > 1 (split-K, GemvConfig.split_k; never with LOOP): SPLIT programs per tile, each over K / SPLIT columns
    # (a multiple of BLOCK_K), partials through part_ptr, the last one of a tile finishing it (_split_finish)
    if SPLIT > 1:
        _mrow_residual_split(tl.program_id(0) // SPLIT, tl.program_id(0) % SPLIT, a_ptr, w_ptr, s_ptr, res_ptr,
                             out_ptr, part_ptr, count_ptr, B, N, K, BLOCK_M, BLOCK_N, BLOCK_K, MMA, DOT_F32, HAS_RES,
                             USE_PDL, PDL_EARLY, HAS_SCALE, SPLIT)
    elif LOOP:
        for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
            _mrow_residual_tile(tile, a_ptr, w_ptr, s_ptr, res_ptr, out_ptr, B, N, K, BLOCK_M, BLOCK_N, BLOCK_K, MMA,
                                DOT_F32, HAS_RES, USE_PDL, PDL_EARLY, HAS_SCALE)
    else:
        _mrow_residual_tile(tl.program_id(0), a_ptr, w_ptr, s_ptr, res_ptr, out_ptr, B, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                            MMA, DOT_F32, HAS_RES, USE_PDL, PDL_EARLY, HAS_SCALE)


@triton.jit
def _mrow_residual_tile(
    pid, a_ptr, w_ptr, s_ptr, res_ptr, out_ptr,
    B: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MMA: tl.constexpr, DOT_F32: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    mask = n_mask[:, None] & (offs_m[None, :] < B)  # (BLOCK_N, BLOCK_M): the output transposed
    out_ptrs = out_ptr + offs_m[None, :] * N + offs_n[:, None]
    w = _wtile(w_ptr, offs_n, n_mask, 0, K, BLOCK_K)
    # NOTE: the residual before the wait, as in the other GEMV kernels: it comes from two or more launches back
    res = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if HAS_RES:
        res = tl.load(res_ptr + offs_m[None, :] * N + offs_n[:, None], mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    # FP8 weights: the sums start at zero and take their rows' scales before the residual; else the residual is the
    # accumulator's start. W8A8 (MMA 4): the rows' scales first, from all of K (after the wait)
    xs, xinv = _w8a8_prologue(a_ptr, a_ptr, B, K, BLOCK_M, MMA, False)
    acc = _wxa(w, _rows(a_ptr, 0, B, K, BLOCK_M, BLOCK_K), xinv,
               tl.zeros((BLOCK_N, BLOCK_M), tl.float32) if HAS_SCALE else res, MMA, DOT_F32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = _wtile(w_ptr, offs_n, n_mask, k0, K, BLOCK_K)
        acc = _wxa(w, _rows(a_ptr, k0, B, K, BLOCK_M, BLOCK_K), xinv, acc, MMA, DOT_F32)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_SCALE:
        acc = _w8a8_epilogue(acc, xs, MMA) * row_scales(s_ptr, offs_n, n_mask, HAS_SCALE)[:, None] + res
    tl.store(out_ptrs, acc, mask=mask)


@triton.jit
def _mrow_residual_split(
    tile, split, a_ptr, w_ptr, s_ptr, res_ptr, out_ptr, part_ptr, count_ptr,
    B: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MMA: tl.constexpr, DOT_F32: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
    HAS_SCALE: tl.constexpr, SPLIT: tl.constexpr,
):
    """Columns [split * K / SPLIT, (split + 1) * K / SPLIT) of output tile ``tile``: the scaled partial sums stored to
    ``part_ptr`` (SPLIT, B, N) float32, then ``_split_finish``."""
    KS: tl.constexpr = K // SPLIT
    k_lo = split * KS
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    mask = n_mask[:, None] & (offs_m[None, :] < B)  # (BLOCK_N, BLOCK_M): the output transposed
    w = _wtile(w_ptr, offs_n, n_mask, k_lo, K, BLOCK_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    # W8A8 (MMA 4): every split's rows' scales from all of K (the same scales in every split)
    xs, xinv = _w8a8_prologue(a_ptr, a_ptr, B, K, BLOCK_M, MMA, False)
    acc = _wxa(w, _rows(a_ptr, k_lo, B, K, BLOCK_M, BLOCK_K), xinv, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), MMA,
               DOT_F32)
    for k0 in range(k_lo + BLOCK_K, k_lo + KS, BLOCK_K):
        w = _wtile(w_ptr, offs_n, n_mask, k0, K, BLOCK_K)
        acc = _wxa(w, _rows(a_ptr, k0, B, K, BLOCK_M, BLOCK_K), xinv, acc, MMA, DOT_F32)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    acc = _w8a8_epilogue(acc, xs, MMA) * row_scales(s_ptr, offs_n, n_mask, HAS_SCALE)[:, None]
    tl.store(part_ptr + (split * B + offs_m[None, :]) * N + offs_n[:, None], acc, mask=mask)
    _split_finish(count_ptr + tile, part_ptr, res_ptr, out_ptr, offs_m, offs_n, mask, B, N, HAS_RES, SPLIT)


@triton.jit
def _split_finish(count_ptr, part_ptr, res_ptr, out_ptr, offs_m, offs_n, mask, B: tl.constexpr, N: tl.constexpr,
                  HAS_RES: tl.constexpr, SPLIT: tl.constexpr):
    """After a split program stored its partials: count it at ``count_ptr`` (one int32 per output tile); the program
    that counts last sums the SPLIT partials in split order (the same sum whichever program finishes last) onto the
    residual, stores the tile and sets the counter back to 0 for the next launch. As ``layer._merge_if_last``: the
    barrier orders every thread's partial stores before the count, the count is acquire-release at GPU scope, and the
    last program reads the partials through L2 (``.cg``). The residual is read here, after the wait (PDL)."""
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        total = tl.zeros(mask.shape, tl.float32)
        if HAS_RES:
            total = tl.load(res_ptr + offs_m[None, :] * N + offs_n[:, None], mask=mask, other=0.0).to(tl.float32)
        for s in tl.static_range(SPLIT):
            total += tl.load(part_ptr + (s * B + offs_m[None, :]) * N + offs_n[:, None], mask=mask, other=0.0,
                             cache_modifier=".cg")
        tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], total, mask=mask)


@triton.jit
def _normed_rows(x_ptr, norm_w_ptr, k0, ss, B: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """``_rows`` scaled by the norm weight, and ``ss`` (BLOCK_M,) plus the rows' sum of squares over the block."""
    x = _rows(x_ptr, k0, B, K, BLOCK_M, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    gamma = tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    return x * gamma[None, :], ss + tl.sum(x * x, 1)


@triton.jit
def mrow_gate_up_kernel(
    x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr,
    eps,
    B: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MMA: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
    LOOP: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    # act[b, j] = silu(g) * u with g, u = rmsnorm(x)[b] . w[j], w[INTER + j]
    if LOOP:
        for tile in range(tl.program_id(0), tl.cdiv(INTER, BLOCK_N), tl.num_programs(0)):
            _mrow_gate_up_tile(tile, x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr, eps, B, H, INTER, BLOCK_M, BLOCK_N,
                               BLOCK_K, MMA, DOT_F32, USE_PDL, PDL_EARLY, HAS_SCALE)
    else:
        _mrow_gate_up_tile(tl.program_id(0), x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr, eps, B, H, INTER, BLOCK_M,
                           BLOCK_N, BLOCK_K, MMA, DOT_F32, USE_PDL, PDL_EARLY, HAS_SCALE)


@triton.jit
def _mrow_gate_up_tile(
    pid, x_ptr, norm_w_ptr, w_ptr, s_ptr, act_ptr,
    eps,
    B: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MMA: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    wg = _wtile(w_ptr, offs_n, n_mask, 0, H, BLOCK_K)
    wu = _wtile(w_ptr, INTER + offs_n, n_mask, 0, H, BLOCK_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    xs, xinv = _w8a8_prologue(x_ptr, norm_w_ptr, B, H, BLOCK_M, MMA, True)
    xg, ss = _normed_rows(x_ptr, norm_w_ptr, 0, tl.zeros((BLOCK_M,), tl.float32), B, H, BLOCK_M, BLOCK_K)
    g = _wxa(wg, xg, xinv, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), MMA, DOT_F32)
    u = _wxa(wu, xg, xinv, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), MMA, DOT_F32)
    for k0 in range(BLOCK_K, H, BLOCK_K):
        wg = _wtile(w_ptr, offs_n, n_mask, k0, H, BLOCK_K)
        wu = _wtile(w_ptr, INTER + offs_n, n_mask, k0, H, BLOCK_K)
        xg, ss = _normed_rows(x_ptr, norm_w_ptr, k0, ss, B, H, BLOCK_M, BLOCK_K)
        g = _wxa(wg, xg, xinv, g, MMA, DOT_F32)
        u = _wxa(wu, xg, xinv, u, MMA, DOT_F32)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    rstd = 1.0 / tl.sqrt(ss / H + eps)
    g = _w8a8_epilogue(g, xs, MMA) * rstd[None, :] * row_scales(s_ptr, offs_n, n_mask, HAS_SCALE)[:, None]
    u = _w8a8_epilogue(u, xs, MMA) * rstd[None, :] * row_scales(s_ptr, INTER + offs_n, n_mask, HAS_SCALE)[:, None]
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + offs_m[None, :] * INTER + offs_n[:, None], act, mask=n_mask[:, None] & (offs_m[None, :] < B))


@triton.jit
def mrow_qkv_rope_kernel(
    x_ptr, norm_w_ptr, w_ptr, s_ptr, inv_freq_ptr, pos_ptr, loc_ptr,  # inputs
    q_ptr, k_cache_ptr, v_cache_ptr,  # outputs
    eps,
    stride_ks, stride_kh, stride_vs, stride_vh, inv_k_scale, inv_v_scale,
    B: tl.constexpr, H: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    MMA: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr,
    HAS_SCALE: tl.constexpr, KV_FP8: tl.constexpr,
):
    # layer.qkv_rope_kernel's tiles (BLOCK_P rotary pairs of one head: weight rows r1 and r1 + D/2), weight-stationary
    HALF: tl.constexpr = D // 2
    PB: tl.constexpr = HALF // BLOCK_P
    num_tiles = (NQ + 2 * NKV) * PB
    offs_p = tl.arange(0, BLOCK_P)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        r1 = (tile // PB) * D + (tile % PB) * BLOCK_P + offs_p
        r2 = r1 + HALF
        # both halves of the rotary pairs in one tile of 2 * BLOCK_P weight rows, interleaved (r1[0], r2[0], r1[1],
        # ...): one MMA of M = 2 * BLOCK_P per K step (BLOCK_P 16: M 32 on twice the tiles of BLOCK_P 32), split into
        # the halves after the loop
        rows = tl.reshape(tl.join(r1, r2), (2 * BLOCK_P,))
        w = _wtile(w_ptr, rows, rows >= 0, 0, H, BLOCK_K)
        cos, sin, loc = _rope_factors(tile, pos_ptr, loc_ptr, inv_freq_ptr, B, D, BLOCK_M, BLOCK_P)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            if PDL_EARLY:
                tl.extra.cuda.gdc_launch_dependents()
        xs, xinv = _w8a8_prologue(x_ptr, norm_w_ptr, B, H, BLOCK_M, MMA, True)
        xg, ss = _normed_rows(x_ptr, norm_w_ptr, 0, tl.zeros((BLOCK_M,), tl.float32), B, H, BLOCK_M, BLOCK_K)
        acc = _wxa(w, xg, xinv, tl.zeros((2 * BLOCK_P, BLOCK_M), tl.float32), MMA, DOT_F32)
        for k0 in range(BLOCK_K, H, BLOCK_K):
            w = _wtile(w_ptr, rows, rows >= 0, k0, H, BLOCK_K)
            xg, ss = _normed_rows(x_ptr, norm_w_ptr, k0, ss, B, H, BLOCK_M, BLOCK_K)
            acc = _wxa(w, xg, xinv, acc, MMA, DOT_F32)
        if USE_PDL and not PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        rstd = 1.0 / tl.sqrt(ss / H + eps)
        acc = _w8a8_epilogue(acc, xs, MMA) * row_scales(s_ptr, rows, rows >= 0, HAS_SCALE)[:, None]
        acc1, acc2 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_P, 2, BLOCK_M)), (0, 2, 1)))
        _rope_store(tl.trans(acc1) * rstd[:, None], tl.trans(acc2) * rstd[:, None], tile,
                    cos, sin, loc, q_ptr, k_cache_ptr, v_cache_ptr, B, stride_ks, stride_kh, stride_vs, stride_vh,
                    inv_k_scale, inv_v_scale, NQ, NKV, D, BLOCK_M, BLOCK_P, KV_FP8)
