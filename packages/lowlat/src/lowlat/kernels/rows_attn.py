"""Split-KV decode attention that reads each request's K/V once for all of its rows (speculative verify steps).

A verify step runs as decode rows: row j of a request is a decode row at its own position over the request's table
row (``lowlat.plugins._stack.covers_rows``), so the per-row kernel (``layer.decode_attention_kernel``, grid (rows,
KV heads, splits)) reads the request's K/V once per row, 6-8 times from L2, with 320 programs at 8 rows and 5 splits.
(The o_proj after it does not start later for that: 13.3 us per layer in the chained verify step with either kernel,
benchmarks/RESULTS.md issue 34.)

``rows_attention_kernel`` keeps the per-row grid (the same graph serves decode and verify steps of a size, so the
kernel cannot know at capture which it runs), but only a *leader* program works: row ``b`` leads when it starts a run
of rows of one request (its table row differs from row ``b - 1``'s, or ``b`` starts an aligned block of ``R`` rows).
The leader takes that run (at most ``R`` rows, within its aligned block) as one tile of ``R x G`` query rows against
each K/V tile it reads; the other rows' programs return at once. A run of one row (a decode row) takes the per-row
kernel's program instead (``layer._decode_split``: its GQA tile and KV block). The split count is chosen *per launch on the
device* from the number of runs (``TARGET`` programs over runs x KV heads, at most the grid's ``NUM_SPLITS``); splits
past a run's effective count are empty and store ``lse = -inf`` partials; the merge launch is the per-row one.

The stack launches the per-row kernel's grid (its split count; ``LaunchConfig.rows_attention_up_to``), so a decode
step of distinct requests costs what it did. A larger grid (more splits for a verify run) measured faster on verify
rows and slower on decode rows (H200, 8B shape, context 608, attention alone, us per layer: verify 6 + 2 rows: per-row
14.48, this kernel on 5 splits of 128 12.44, 10 of 64 10.88, 16 of 32 9.80; decode of 8 requests: 19.14, 18.88,
22.30, 28.04: the empty splits' programs and the wider merge). Verify steps would take the larger grid in a graph of
their own (lmserver captures one only where the plugin's path differs), or with a merge that skips empty splits.

Rows of one run attend to different lengths (row j of a request to ``prefix + j + 1`` positions): each query row
masks the positions at or past its own length, and the K/V tiles span the run's longest row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat.kernels.layer import _attend_split, _decode_split, _merge_program

ROWS_PER_RUN = 8  # R: the most rows of one request a leader takes (ops.MAX_VERIFY_ROWS)


@triton.jit
def rows_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
    part_o_ptr, part_lse_ptr, out_ptr, used_ptr,
    B, stride_rt, stride_ks, stride_kh, stride_vs, stride_vh, scale, v_scale,
    NQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KVH: tl.constexpr,
    R: tl.constexpr, BLOCK_GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, TARGET: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr, FRESH: tl.constexpr,
    BLOCK_G1: tl.constexpr = 16, BLOCK_N1: tl.constexpr = 64, SKIP_EMPTY: tl.constexpr = False,
    KV_F16: tl.constexpr = False,
):
    # grid (B, KV heads, NUM_SPLITS). Query tile row m = r * BLOCK_GP + g: run row r (row b + r), head kvh * G + g.
    # One split (NUM_SPLITS == 1): the output goes straight to out_ptr; else partials for merge_splits_kernel, or with
    # SKIP_EMPTY for rows_merge_kernel: the programs of splits past the effective count return without a store, and
    # split 0's program of each run stores that count for the run's rows at used_ptr (int32, one per row).
    # KV_F16 (an FP8 cache): both paths' dots in fp16 (layer._attend_block).
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(req_idx_ptr + b)
    prev = tl.load(req_idx_ptr + tl.maximum(b - 1, 0))
    if (b % R == 0) | (prev != row):  # a leader (else: another row's program computes this row)
        # runs in the launch: the split count that gives about TARGET busy programs
        offs_b = tl.arange(0, BLOCK_B)
        in_b = offs_b < B
        rq = tl.load(req_idx_ptr + offs_b, mask=in_b, other=-1)
        rq_prev = tl.load(req_idx_ptr + offs_b - 1, mask=in_b & (offs_b > 0), other=-1)
        runs = tl.sum((in_b & ((offs_b % R == 0) | (rq != rq_prev))).to(tl.int32), 0)
        eff = tl.minimum(tl.maximum(tl.cdiv(TARGET, runs * KVH), 1), NUM_SPLITS)
        # this leader's run: rows b .. b + n - 1 of table row `row`, inside the aligned block of R rows
        offs_r = tl.arange(0, R)
        rows_r = b + offs_r
        in_blk = (rows_r < B) & (rows_r // R == b // R)
        same = in_blk & (tl.load(req_idx_ptr + rows_r, mask=in_blk, other=-1) == row)
        n = tl.min(tl.where(same, R, offs_r), 0)
        # NOTE: before the PDL wait: the launch before this one (qkv) waited for every earlier one, so no merge of the
        # previous layer still reads used_ptr
        if SKIP_EMPTY:  # noqa: SIM102 (a static if around a runtime one)
            if (split == 0) & (kvh == 0):
                tl.store(used_ptr + rows_r, tl.zeros((R,), tl.int32) + eff, mask=offs_r < n)
        limit = eff  # SKIP_EMPTY: the splits past the effective count return (the merge reads only `eff`)
        if not SKIP_EMPTY:
            limit = eff * 0 + NUM_SPLITS
        if split < limit:
            if n == 1:  # a decode row: the per-row program (its own tile and KV block)
                _decode_split(q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, part_o_ptr, part_lse_ptr, out_ptr, b,
                              kvh, split, eff, row.to(tl.int64), tl.load(seq_lens_ptr + b), stride_rt, stride_ks,
                              stride_kh, stride_vs, stride_vh, scale, v_scale, NQ, G, D, BLOCK_G1, BLOCK_N1, NUM_SPLITS,
                              NUM_SPLITS > 1, DOT_F32, USE_PDL, PDL_EARLY, FRESH, KV_F16)
            else:
                lens_r = tl.load(seq_lens_ptr + rows_r, mask=offs_r < n, other=0)
                max_len = tl.max(lens_r, 0)
                chunk = tl.cdiv(tl.cdiv(max_len, eff), BLOCK_N) * BLOCK_N
                start = split * chunk
                end = tl.minimum(max_len, start + chunk)
                offs_m = tl.arange(0, BLOCK_M)
                r_m = offs_m // BLOCK_GP
                g_m = offs_m % BLOCK_GP
                m_ok = (r_m < n) & (g_m < G)
                lim = tl.minimum(tl.load(seq_lens_ptr + b + r_m, mask=m_ok, other=0), end)  # (BLOCK_M,)
                heads = kvh * G + g_m
                # NOTE: the first K/V tile's positions older than the run's FRESH last ones are read before the wait (the
                # qkv launch writes each row's own position: at most FRESH of them, the last of the run's longest row; as
                # the per-row kernel's note in layer.decode_attention_kernel)
                _attend_split(q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, part_o_ptr, part_lse_ptr, out_ptr,
                              (b + r_m) * (NQ * D) + heads * D, m_ok, (b + r_m) * NQ + heads, lim, row.to(tl.int64), kvh,
                              split, start, end, max_len - FRESH, stride_rt, stride_ks, stride_kh, stride_vs, stride_vh,
                              scale, v_scale, D, BLOCK_N, NUM_SPLITS, NUM_SPLITS > 1, DOT_F32, True, USE_PDL,
                              PDL_EARLY, True, KV_F16)


@triton.jit
def rows_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, used_ptr,
    NQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
    PDL_EARLY: tl.constexpr,
):
    """``layer.merge_splits_kernel`` over the first ``used_ptr[b]`` splits of row ``b`` (``rows_attention_kernel``
    with SKIP_EMPTY stored them; the others hold stale partials). Grid (batch, heads)."""
    _merge_program(part_o_ptr, part_lse_ptr, out_ptr, used_ptr, NQ, D, NUM_SPLITS, BLOCK_S, USE_PDL, PDL_EARLY, True)
