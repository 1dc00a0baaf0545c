"""Persistent "K2" kernel of the ``amd`` plugin, in portable Triton (no ``tl.extra.cuda``).

One launch runs attention -> split merge -> o_proj + residual -> RMSNorm + gate-up + SiLU -> down
+ residual. Tasks are numbered stage by stage; program ``p`` of ``P`` runs tasks p, p + P, ...
in order. A stage's task first loads its first weight block, then waits until the previous stage's
counter reaches this launch's target, then works, then bumps its own stage counter (release).

Hand-over: each stage counter counts finished tiles of this launch; a consumer waits for it to
reach the stage's task count. The last program out (counted on ``done``) zeroes the counters and
bumps the generation tag ``epoch``, so the next launch starts clean with no memset launch between
them (CUDA-graph safe), and task counts may change from launch to launch (batch, split count).

Bounded spins: a wait gives up after ``SPIN_LIMIT`` polls, sets the error flag and skips the
remaining waits; the host reads the flag with ``check_errors`` (never a hang). All programs must be
co-resident (the grid fits the GPU at once: one program per compute unit, or the measured count of
``tuning.PERSISTENT``); under the interpreter ``P`` is 1, so tasks run in order and every wait is
already satisfied.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowlat.kernels.layer import _decode_split, _dot
from lowlat.kernels.online_softmax import merge_partials


@triton.jit
def attn_mlp_persistent_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
    part_o_ptr, part_lse_ptr, attn_ptr,
    x_ptr, wo_ptr, x1_ptr, post_norm_ptr, wgu_ptr, act_ptr, wd_ptr, out_ptr,
    sync_ptr, err_ptr,  # sync: [epoch (generation tag), done, cnt_attn, cnt_merge, cnt_o, cnt_gu]
    B, eps, scale, SPIN_LIMIT,
    stride_rt, stride_ks, stride_kh, stride_vs, stride_vh,
    H: tl.constexpr, INTER: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_NA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    G: tl.constexpr = NQ // NKV
    QD: tl.constexpr = NQ * D
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_attn = B * NKV * NUM_SPLITS
    n_merge = B * NQ
    n_o = tl.cdiv(H, BLOCK_N)
    n_gu = tl.cdiv(INTER, BLOCK_N)
    n_down = tl.cdiv(H, BLOCK_N)
    end_attn = n_attn
    end_merge = end_attn + n_merge
    end_o = end_merge + n_o
    end_gu = end_o + n_gu
    total = end_gu + n_down
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < B
    offs_d = tl.arange(0, D)
    bad = pid * 0
    for t in range(pid, total, nprog):
        if t < end_attn:
            # ---- split-KV attention of one (request, kv head, split) ----
            b = t // (NKV * NUM_SPLITS)
            kvh = (t // NUM_SPLITS) % NKV
            split = t % NUM_SPLITS
            # (no PDL: FRESH 0, every position read in the loop; partials even for one split: the merge tasks read them)
            _decode_split(q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, part_o_ptr, part_lse_ptr, attn_ptr, b, kvh,
                          split, NUM_SPLITS, tl.load(req_idx_ptr + b).to(tl.int64), tl.load(seq_lens_ptr + b), stride_rt,
                          stride_ks, stride_kh, stride_vs, stride_vh, scale, 1.0, NQ, G, D, BLOCK_G, BLOCK_NA, NUM_SPLITS,
                          True, DOT_F32, False, False, 0)
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 2, 1, sem="release")
        elif t < end_merge:
            # ---- merge the splits of one (request, head) ----
            i = t - end_attn
            b = i // NQ
            h = i % NQ
            bad = _wait_count(sync_ptr + 2, n_attn, err_ptr, bad, SPIN_LIMIT)
            offs_s = tl.arange(0, BLOCK_S)
            s_mask = offs_s < NUM_SPLITS
            base = (b * NQ + h) * NUM_SPLITS
            lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"), cache_modifier=".cg")
            po = tl.load(part_o_ptr + (base + offs_s[:, None]) * D + offs_d[None, :], mask=s_mask[:, None], other=0.0, cache_modifier=".cg")
            merged = merge_partials(po, lse, 0)
            tl.store(attn_ptr + b * QD + h * D + offs_d, merged)
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 3, 1, sem="release")
        elif t < end_o:
            # ---- o_proj + residual (waits for every merged head) ----
            acc, _, bad = _gemv_task(t - end_merge, attn_ptr, wo_ptr, x1_ptr, post_norm_ptr, sync_ptr + 3, n_merge, err_ptr,
                                     bad, B, eps, SPIN_LIMIT, H, QD, False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
            offs_n = (t - end_merge) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = m_mask[:, None] & (offs_n < H)[None, :]
            res0 = tl.load(x_ptr + offs_m[:, None] * H + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(x1_ptr + offs_m[:, None] * H + offs_n[None, :], acc + res0, mask=mask)
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 4, 1, sem="release")
        elif t < end_gu:
            # ---- RMSNorm + gate-up + SiLU (waits for every o_proj tile) ----
            g, u, bad = _gemv_task(t - end_o, x1_ptr, wgu_ptr, x1_ptr, post_norm_ptr, sync_ptr + 4, n_o, err_ptr, bad,
                                   B, eps, SPIN_LIMIT, INTER, H, True, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
            offs_n = (t - end_o) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = m_mask[:, None] & (offs_n < INTER)[None, :]
            tl.store(act_ptr + offs_m[:, None] * INTER + offs_n[None, :], g / (1.0 + tl.exp(-g)) * u, mask=mask)
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 5, 1, sem="release")
        else:
            # ---- down + residual (waits for every gate-up tile) ----
            acc, _, bad = _gemv_task(t - end_gu, act_ptr, wd_ptr, x1_ptr, post_norm_ptr, sync_ptr + 5, n_gu, err_ptr, bad,
                                     B, eps, SPIN_LIMIT, H, INTER, False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
            offs_n = (t - end_gu) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = m_mask[:, None] & (offs_n < H)[None, :]
            res2 = tl.load(x1_ptr + offs_m[:, None] * H + offs_n[None, :], mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs_m[:, None] * H + offs_n[None, :], acc + res2.to(tl.float32), mask=mask)
    # NOTE: the last program out is the only one left: no wait of this launch can still read the counters.
    done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
    if done == nprog - 1:
        tl.atomic_xchg(sync_ptr + 2, 0, sem="acq_rel")
        tl.atomic_xchg(sync_ptr + 3, 0, sem="acq_rel")
        tl.atomic_xchg(sync_ptr + 4, 0, sem="acq_rel")
        tl.atomic_xchg(sync_ptr + 5, 0, sem="acq_rel")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="acq_rel")
        tl.atomic_add(sync_ptr, 1, sem="acq_rel")


@triton.jit
def _wait_count(counter_ptr, target, err_ptr, bad, SPIN_LIMIT):
    """Poll ``counter_ptr`` until it reaches ``target`` (acquire), at most SPIN_LIMIT polls; on giving up set the
    error flag and return ``bad + 1`` (later waits of the program are skipped), else ``bad``."""
    cur = tl.atomic_add(counter_ptr, 0, sem="acquire")
    spins = bad * 0
    while (cur < target) & (spins < SPIN_LIMIT) & (bad == 0):
        cur = tl.atomic_add(counter_ptr, 0, sem="acquire")
        spins += 1
    if cur < target:
        bad = bad + 1
        tl.atomic_or(err_ptr, 1)
    tl.debug_barrier()
    return bad


@triton.jit
def _gemv_task(
    tile, a_ptr, w_ptr, x1_ptr, norm_ptr, counter_ptr, n_wait, err_ptr, bad, B, eps, SPIN_LIMIT,
    N: tl.constexpr, K: tl.constexpr, GATE_UP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    """One output tile of a GEMV stage: ``a (B, K) @ w[tile rows].T``; with GATE_UP, ``w`` holds gate rows
    [0, N) and up rows [N, 2N), ``a`` is RMSNorm'd (x1's rstd, norm weight) and both products are returned.
    The first weight block is loaded before the wait on ``counter_ptr`` (the producing stage); N and K are
    compile-time constants per stage, so weight rows have a known alignment (vector loads) and the K loop a
    fixed trip count (software-pipelined: no load under a branch in the loop)."""
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < B
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    km = offs_k < K
    w1 = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=n_mask[None, :] & km[:, None], other=0.0)
    w2 = w1
    if GATE_UP:
        w2 = tl.load(w_ptr + (N + offs_n[None, :]) * K + offs_k[:, None], mask=n_mask[None, :] & km[:, None], other=0.0)
    bad = _wait_count(counter_ptr, n_wait, err_ptr, bad, SPIN_LIMIT)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # the activations were written by other programs of this launch: read past L1 (.cg)
    a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0,
                cache_modifier=".cg")
    if GATE_UP:
        a = a.to(tl.float32) * tl.load(norm_ptr + offs_k, mask=km, other=0.0).to(tl.float32)[None, :]
    acc1 = _dot(a.to(w1.dtype), w1, acc1, DOT_F32)
    if GATE_UP:
        acc2 = _dot(a.to(w1.dtype), w2, acc2, DOT_F32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        km = (k0 + offs_k) < K
        wm = n_mask[None, :] & km[:, None]
        w1 = tl.load(w_ptr + offs_n[None, :] * K + k0 + offs_k[:, None], mask=wm, other=0.0)
        a = tl.load(a_ptr + offs_m[:, None] * K + k0 + offs_k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0,
                    cache_modifier=".cg")
        if GATE_UP:
            w2 = tl.load(w_ptr + (N + offs_n[None, :]) * K + k0 + offs_k[:, None], mask=wm, other=0.0)
            a = a.to(tl.float32) * tl.load(norm_ptr + k0 + offs_k, mask=km, other=0.0).to(tl.float32)[None, :]
            acc2 = _dot(a.to(w1.dtype), w2, acc2, DOT_F32)
        acc1 = _dot(a.to(w1.dtype), w1, acc1, DOT_F32)
    if GATE_UP:
        ss = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            km = (k0 + offs_k) < K
            xv = tl.load(x1_ptr + offs_m[:, None] * K + k0 + offs_k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0,
                         cache_modifier=".cg").to(tl.float32)
            ss += tl.sum(xv * xv, 1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc1 = acc1 * rstd[:, None]
        acc2 = acc2 * rstd[:, None]
    return acc1, acc2, bad
