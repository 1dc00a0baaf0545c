"""Row-wise GEMV for the smallest decode batches: no tensor-core dot, one reduction per row.

``out[b, n] = res[b, n] + sum_k a[b, k] * w[n, k]`` for a few rows ``b``. The ``tl.dot`` kernels of
``lowlat.kernels.layer`` pad the batch to 16 rows and stage each weight tile through shared
memory for the MMA; here a weight tile goes from global memory to registers and is reduced
against each activation row in turn (``BLOCK_M`` = the batch padded to a power of two, unrolled),
so at batch 1 the kernel is one load, one multiply and one row sum per weight element. Which of
the two is faster per shape and batch is measured (``benchmarks/lowlat/bench_gemv.py``) and
recorded in ``lowlat.kernels.tuning``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_rows_residual_kernel(
    a_ptr, w_ptr, res_ptr, out_ptr,
    B,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    PDL_EARLY: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # NOTE: the first weight tile is requested before waiting on the previous launch (PDL)
    w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    acc = _add_rows(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), w.to(tl.float32), a_ptr, 0, offs_k, offs_k < K, B, K, BLOCK_M)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        km = (k0 + offs_k) < K
        wf = tl.load(w_ptr + offs_n[:, None] * K + k0 + offs_k[None, :], mask=n_mask[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc = _add_rows(acc, wf, a_ptr, k0, offs_k, km, B, K, BLOCK_M)
    if USE_PDL and not PDL_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    mask = (offs_m[:, None] < B) & n_mask[None, :]
    res = tl.load(res_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc + res.to(tl.float32), mask=mask)


@triton.jit
def _add_rows(acc, wf, a_ptr, k0, offs_k, k_mask, B, K: tl.constexpr, BLOCK_M: tl.constexpr):
    """`acc[m, :] += wf @ a[m, k0:k0 + BLOCK_K]` for every row m < B (rows unrolled)."""
    offs_m = tl.arange(0, BLOCK_M)
    for m in tl.static_range(BLOCK_M):
        xm = tl.load(a_ptr + m * K + k0 + offs_k, mask=k_mask & (offs_k * 0 + m < B), other=0.0).to(tl.float32)
        acc = tl.where(offs_m[:, None] == m, acc + tl.sum(wf * xm[None, :], 1)[None, :], acc)
    return acc
