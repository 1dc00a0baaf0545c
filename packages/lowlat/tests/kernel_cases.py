"""Kernel and plugin cases against the torch reference; run by test_kernels_interpret.py.

Not collected directly (the name does not match test_*.py): a child pytest runs this file with
TRITON_INTERPRET=1 on the CPU, or without it on a CUDA machine (then on the GPU).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lowlat import Coverage, KVCache, LayerShape, LowlatConfig, reference_decoder_layer
from lowlat.build import BuildContext
from lowlat.errors import ShapeError
from lowlat.kernels import ops
from lowlat.kernels.online_softmax import merge_partials, softmax_step, split_partial
from lowlat.reference import apply_rope, decode_attention, rms_norm
from lowlat.testing import TinyModel, decode_meta, fake_setup, greedy_decode, random_kv, random_layer

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
# Tiny shapes on the interpreter; a GQA group of 2 and 4, head_dim 16 and 32.
SHAPES = [
    LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96),
    LayerShape(hidden_size=96, num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=64),
]
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in kernel output"
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _ctx(shape: LayerShape, weights: list, dtype: torch.dtype, max_tokens: int = 8, **cfg: object) -> BuildContext:
    return BuildContext(shape, tuple(weights), DEVICE, dtype, dtype, Coverage(max_tokens=max_tokens),
                        LowlatConfig(**cfg), fake_setup(vendor="cpu" if DEVICE.type == "cpu" else "nvidia"), 256)  # type: ignore[arg-type]


def _lc(shape: LayerShape) -> ops.LaunchConfig:
    return ops.LaunchConfig.for_device(DEVICE, shape, use_pdl=False)


# the larger shape (8 heads of 32) in the default tier with the plain dot variant only: its other variants are the
# interpreter's slowest cases here (10-23 s each on 2 busy cores); every variant runs at the small shape
QKV_CASES = [
    pytest.param(v, p, d, s, marks=pytest.mark.slow if s is SHAPES[1] and (v, p) != ("dot", 0) else ())
    for v, p in [("dot", 0), ("rows", 0), ("dot", 3), ("rows", 3)] for d in DTYPES for s in SHAPES
]


@pytest.mark.parametrize(("variant", "programs", "dtype", "shape"), QKV_CASES)
def test_interpret_qkv_rope_kv_write(variant: str, programs: int, dtype: torch.dtype, shape: LayerShape) -> None:
    g = torch.Generator().manual_seed(11)
    w = random_layer(shape, dtype, DEVICE, generator=g)
    meta = decode_meta([5, 1, 9], 40, 12, DEVICE, generator=g)
    kv = random_kv(shape, 40, dtype, DEVICE, generator=g)
    before = KVCache(kv.k.clone(), kv.v.clone())
    x = torch.randn(3, shape.hidden_size, generator=g).to(DEVICE, dtype)
    q = torch.full((3, shape.q_size), float("nan"), device=DEVICE, dtype=dtype)  # poisoned
    lc = _lc(shape)
    if variant != "dot" or programs:  # 2 rotary pairs per tile, K in blocks of 64 (hidden 96: a partial last block)
        lc = replace(lc, tuned=(("qkv", 8, ops.GemvConfig(variant, block_n=2, block_k=64, programs=programs)),))
    ops.qkv_rope(x, w, kv, meta, q, shape, lc)
    h = rms_norm(x.float(), w.input_norm.float(), shape.rms_eps)
    qkv = h @ w.qkv.float().T
    rq, rk, rv = qkv.split([shape.q_size, shape.kv_size, shape.kv_size], -1)
    rq = apply_rope(rq.view(3, shape.num_heads, -1), meta.positions, w.rope_inv_freq).reshape(3, -1)
    rk = apply_rope(rk.view(3, shape.num_kv_heads, -1), meta.positions, w.rope_inv_freq)
    loc = meta.out_cache_loc
    assert _rel(q, rq) < TOL[dtype]
    assert _rel(kv.k[loc], rk) < TOL[dtype]
    assert _rel(kv.v[loc], rv.view(3, shape.num_kv_heads, -1)) < TOL[dtype]
    others = torch.ones(40, dtype=torch.bool, device=DEVICE)
    others[loc] = False
    assert torch.equal(kv.k[others], before.k[others]) and torch.equal(kv.v[others], before.v[others])


@pytest.mark.parametrize(("shape", "dtype", "splits"), [
    (SHAPES[0], torch.float32, 1), (SHAPES[0], torch.bfloat16, 5), (SHAPES[1], torch.float32, 8), (SHAPES[1], torch.bfloat16, 3),
])
def test_interpret_split_kv_attention(shape: LayerShape, dtype: torch.dtype, splits: int) -> None:
    g = torch.Generator().manual_seed(12 + splits)
    lens = [1, 17, 40, 6]
    meta = decode_meta(lens, 120, 48, DEVICE, generator=g)
    kv = random_kv(shape, 120, dtype, DEVICE, generator=g)
    q = torch.randn(4, shape.q_size, generator=g).to(DEVICE, dtype)
    part_o = torch.full((4, shape.num_heads, splits, shape.head_dim), float("nan"), device=DEVICE)
    part_lse = torch.full((4, shape.num_heads, splits), float("nan"), device=DEVICE)
    out = torch.full_like(q, float("nan"))
    ops.attention(q, kv, meta, part_o, part_lse, out, shape, _lc(shape), splits)
    ref = decode_attention(q.view(4, shape.num_heads, -1), kv, meta, shape.head_dim**-0.5).reshape(4, -1)
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize(("shape", "dtype", "splits"), [
    (SHAPES[0], torch.bfloat16, 2),
    pytest.param(SHAPES[0], torch.float32, 5, marks=pytest.mark.slow),
    pytest.param(SHAPES[1], torch.bfloat16, 3, marks=pytest.mark.slow),
])
def test_interpret_split_kv_attention_fused_merge(shape: LayerShape, dtype: torch.dtype, splits: int) -> None:
    """The last split program of each row and KV head merges the partials (no merge launch): against the reference
    on fresh inputs, twice over the same counters (each launch leaves them zero), with splits past a row's length."""
    counts = torch.zeros(5 * shape.num_kv_heads + 3, dtype=torch.int32, device=DEVICE)
    for rnd in range(2):
        g = torch.Generator().manual_seed(40 + 7 * splits + rnd)
        lens = [1, 17, 40, 6, 23][: 4 + rnd]
        b = len(lens)
        meta = decode_meta(lens, 140, 48, DEVICE, generator=g)
        kv = random_kv(shape, 140, dtype, DEVICE, generator=g)
        q = torch.randn(b, shape.q_size, generator=g).to(DEVICE, dtype)
        part_o = torch.full((b, shape.num_heads, splits, shape.head_dim), float("nan"), device=DEVICE)
        part_lse = torch.full((b, shape.num_heads, splits), float("nan"), device=DEVICE)
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written by the merging programs
        ops.attention(q, kv, meta, part_o, part_lse, out, shape, _lc(shape), splits, counts=counts)
        ref = decode_attention(q.view(b, shape.num_heads, -1), kv, meta, shape.head_dim**-0.5).reshape(b, -1)
        assert _rel(out, ref) < TOL[dtype]
        assert int(counts.abs().sum()) == 0


def _attention_f64(q: torch.Tensor, kv: KVCache, meta, group: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Float64 oracle: each row's heads over its own request's first seq_len positions (a host loop)."""
    b, nq, d = q.shape
    out = torch.empty(b, nq, d, dtype=torch.float64)
    k, v = kv.k.double().cpu(), kv.v.double().cpu()
    table, rows, lens = meta.req_to_token.cpu().long(), meta.req_pool_indices.cpu().long(), meta.seq_lens.cpu().long()
    for i in range(b):
        slots = table[rows[i], : lens[i]]
        for h in range(nq):
            s = (k[slots, h // group] @ q[i, h].double().cpu()) * d**-0.5
            out[i, h] = torch.softmax(s, 0) @ v[slots, h // group]
    return out


def _rows_meta(runs: list[tuple[int, int, int]], num_slots: int, max_context: int, g: torch.Generator):  # type: ignore[no-untyped-def]
    """Rows as ``(table row, prefix, rows)`` runs: each run's row j at position prefix + j (seq_len prefix + j + 1)
    over its table row; a table row may come back in a later run (the same request again, not adjacent)."""
    from lowlat.layer import ForwardMeta

    table = torch.randperm(num_slots, generator=g)[: 8 * max_context].view(8, max_context).to(torch.int32)  # distinct
    req = torch.tensor([t for t, _, n in runs for _ in range(n)], dtype=torch.int64)
    pos = torch.tensor([p + j for _, p, n in runs for j in range(n)], dtype=torch.int64)
    lens = (pos + 1).to(torch.int32)
    loc = table[req, pos].to(torch.int64)
    return ForwardMeta(table.to(DEVICE), req.to(DEVICE), lens.to(DEVICE), pos.to(DEVICE), loc.to(DEVICE),
                       max_seq_len=max_context)


# (runs, num_sms, block): a verify step (one request's 6 rows + 2 padding rows, length 1), two requests' 6 rows each (the
# second one crosses the 8-row block: two runs), decode rows of distinct requests, a padding run longer than 8 rows,
# a request's rows split by another request's; num_sms sets how many splits the kernel uses (runs of one row take the
# per-row program: the decode case, and the last run of the last case)
ROWS_CASES = [
    ([(0, 30, 6), (7, 0, 2)], 16, 8),
    ([(0, 21, 6), (3, 9, 6)], 1, 8),
    ([(0, 13, 1), (1, 1, 1), (2, 40, 1), (3, 27, 1)], 4, 16),
    pytest.param([(2, 33, 3), (7, 0, 10)], 8, 8, marks=pytest.mark.slow),
    pytest.param([(0, 17, 3), (1, 5, 2), (0, 20, 1)], 64, 8, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("runs", "num_sms", "block"), ROWS_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_interpret_rows_attention_matches_float64(runs: list, num_sms: int, block: int, dtype: torch.dtype) -> None:
    """``rows_attention`` (a leader program per run of rows of one request) against the float64 oracle, with
    poisoned outputs and partials (every element written): on a grid of as many splits as KV blocks, the per-row
    kernel's split count and one split; then the large grid with ``used`` (its unused splits' partials stay poisoned:
    the merge must not read them; every row's used count written)."""
    shape = SHAPES[1] if dtype == torch.bfloat16 else SHAPES[0]
    g = torch.Generator().manual_seed(50 + num_sms)
    meta = _rows_meta(runs, 400, 48, g)
    b = int(meta.seq_lens.shape[0])
    kv = random_kv(shape, 400, dtype, DEVICE, generator=g)
    q = torch.randn(b, shape.q_size, generator=g).to(DEVICE, dtype)
    ref = _attention_f64(q.view(b, shape.num_heads, -1), kv, meta, shape.group_size).reshape(b, -1)
    lc = replace(_lc(shape), num_sms=num_sms, rows_attn_block=block)
    for splits in (ops.rows_splits(b, shape, 48, lc, 8, DEVICE), ops.num_splits(b, shape, 48, lc, 8), 1):
        part_o = torch.full((b, shape.num_heads, splits, shape.head_dim), float("nan"), device=DEVICE)
        part_lse = torch.full((b, shape.num_heads, splits), float("nan"), device=DEVICE)
        out = torch.full_like(q, float("nan"))
        ops.rows_attention(q, kv, meta, part_o, part_lse, out, shape, lc, splits)
        assert _rel(out.cpu(), ref) < TOL[dtype], splits
    splits = ops.rows_splits(b, shape, 48, lc, 8, DEVICE)
    used = torch.full((b + 3,), -7, dtype=torch.int32, device=DEVICE)
    part_o = torch.full((b, shape.num_heads, splits, shape.head_dim), float("nan"), device=DEVICE)
    part_lse = torch.full((b, shape.num_heads, splits), float("nan"), device=DEVICE)
    out = torch.full_like(q, float("nan"))
    ops.rows_attention(q, kv, meta, part_o, part_lse, out, shape, lc, splits, used=used)
    assert _rel(out.cpu(), ref) < TOL[dtype]
    assert bool(((used[:b] >= 1) & (used[:b] <= splits)).all()) and bool((used[b:] == -7).all())


def test_attention_counts_are_checked() -> None:
    shape = SHAPES[0]
    g = torch.Generator().manual_seed(3)
    meta = decode_meta([5, 9], 40, 12, DEVICE, generator=g)
    kv = random_kv(shape, 40, torch.float32, DEVICE, generator=g)
    q = torch.randn(2, shape.q_size, generator=g).to(DEVICE)
    part_o = torch.empty(2, shape.num_heads, 2, shape.head_dim, device=DEVICE)
    part_lse = torch.empty(2, shape.num_heads, 2, device=DEVICE)
    for bad in (torch.zeros(2 * shape.num_kv_heads - 1, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)):
        with pytest.raises(ShapeError, match="counts"):
            ops.attention(q, kv, meta, part_o, part_lse, torch.empty_like(q), shape, _lc(shape), 2, counts=bad.to(DEVICE))


@triton.jit
def _softmax_splits_probe(s_ptr, v_ptr, part_ptr, lse_ptr, M: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                          SPLITS: tl.constexpr, BLOCK: tl.constexpr, GUARD: tl.constexpr):
    """Scores (M, N) against values (N, D): split ``sp`` takes keys [sp * N / SPLITS, (sp + 1) * N / SPLITS) in blocks
    of BLOCK through ``softmax_step`` and stores its ``split_partial`` at (row, sp)."""
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    for sp in tl.static_range(SPLITS):
        m_i = tl.full((M,), float("-inf"), tl.float32)
        l_i = tl.zeros((M,), tl.float32)
        acc = tl.zeros((M, D), tl.float32)
        for t in tl.static_range(N // SPLITS // BLOCK):
            offs_n = sp * (N // SPLITS) + t * BLOCK + tl.arange(0, BLOCK)
            s = tl.load(s_ptr + offs_m[:, None] * N + offs_n[None, :])
            v = tl.load(v_ptr + offs_n[:, None] * D + offs_d[None, :])
            m_i, l_i, p, alpha = softmax_step(m_i, l_i, s, GUARD)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        out, lse = split_partial(acc, m_i, l_i, 1.0)
        tl.store(part_ptr + (offs_m[:, None] * SPLITS + sp) * D + offs_d[None, :], out)
        tl.store(lse_ptr + offs_m * SPLITS + sp, lse)


@triton.jit
def _merge_probe(part_ptr, lse_ptr, out_ptr, out3_ptr, M: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
    """``merge_partials`` both ways: row by row over axis 0 ((SPLITS, D) with (SPLITS,)), and all rows at once over
    axis 1 ((M, SPLITS, D) with (M, SPLITS))."""
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    for r in tl.static_range(M):
        lse = tl.load(lse_ptr + r * SPLITS + offs_s)
        part = tl.load(part_ptr + (r * SPLITS + offs_s[:, None]) * D + offs_d[None, :])
        tl.store(out_ptr + r * D + offs_d, merge_partials(part, lse, 0))
    offs_m = tl.arange(0, M)
    idx = offs_m[:, None] * SPLITS + offs_s[None, :]
    lse2 = tl.load(lse_ptr + idx)
    part3 = tl.load(part_ptr + idx[:, :, None] * D + offs_d[None, None, :])
    tl.store(out3_ptr + offs_m[:, None] * D + offs_d[None, :], merge_partials(part3, lse2, 1))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the unguarded -inf - -inf (NaN)
def test_online_softmax_functions_match_float64() -> None:
    """``lowlat.kernels.online_softmax`` on its own, against a float64 softmax: per-split partials (out, lse) over
    blocks of keys, and their merge over either axis. Row 1 has no key in split 0 (partial (0, -inf), weight 0 in the
    merge); row 2 none in split 1's first block; row 3 a score of 80 (the running max must rescale). Without GUARD a
    row with no key so far gets NaN; rows with a key in every split's first block get the same values either way."""
    m, n, d, splits, block = 4, 32, 16, 2, 8
    g = torch.Generator().manual_seed(30)
    s = torch.randn(m, n, generator=g, dtype=torch.float64) * 3
    s[1, : n // splits] = float("-inf")
    s[2, n // splits : n // splits + block] = float("-inf")
    s[2, n // splits + block + 3] = float("-inf")
    s[3, 5] = 80.0
    v = torch.randn(n, d, generator=g, dtype=torch.float64)
    ref_part = torch.zeros(m, splits, d, dtype=torch.float64)
    ref_lse = torch.full((m, splits), float("-inf"), dtype=torch.float64)
    for sp in range(splits):
        ss = s[:, sp * n // splits : (sp + 1) * n // splits]
        live = torch.isfinite(ss).any(1)
        ref_lse[live, sp] = torch.logsumexp(ss[live], 1)
        ref_part[live, sp] = torch.softmax(ss[live], 1) @ v[sp * n // splits : (sp + 1) * n // splits]
    ref = torch.softmax(s, 1) @ v
    results = {}
    for guard in (True, False):
        part = torch.full((m, splits, d), float("nan"), device=DEVICE)
        lse = torch.full((m, splits), float("nan"), device=DEVICE)
        _softmax_splits_probe[(1,)](s.float().to(DEVICE), v.float().to(DEVICE), part, lse, m, n, d, splits, block, guard)
        results[guard] = (part.cpu().double(), lse.cpu().double())
    part, lse = results[True]
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and bool(torch.isfinite(part).all())
    assert float((part - ref_part).abs().max()) < 1e-5 and float((lse - ref_lse).nan_to_num(0.0).abs().max()) < 1e-5
    part_u, _ = results[False]
    assert bool(part_u[1, 0].isnan().all()) and bool(part_u[2, 1].isnan().all())  # no key yet: NaN without GUARD
    assert torch.equal(part_u[[0, 3]], part[[0, 3]])
    out = torch.full((m, d), float("nan"), device=DEVICE)
    out3 = torch.full((m, d), float("nan"), device=DEVICE)
    _merge_probe[(1,)](part.float().to(DEVICE), lse.float().to(DEVICE), out, out3, m, d, splits)
    assert float((out.cpu().double() - ref).abs().max()) < 1e-5
    assert float((out3.cpu().double() - ref).abs().max()) < 1e-5


# (variant, programs) of the GEMV stages beyond the defaults; programs > 0: fewer programs than tiles, looping
VARIANT_PROGRAMS = [("rows", 0), ("dot", 2), ("rows", 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_interpret_gemv_epilogues(dtype: torch.dtype, batch: int) -> None:
    g = torch.Generator().manual_seed(13 + batch)
    shape = SHAPES[0]
    lc = _lc(shape)
    a = torch.randn(batch, 96, generator=g).to(DEVICE, dtype)
    w = (torch.randn(72, 96, generator=g) / 10).to(DEVICE, dtype)
    res = torch.randn(batch, 72, generator=g).to(DEVICE, dtype)
    out = torch.full_like(res, float("nan"))
    ops.gemv_residual(a, w, res, out, lc)
    assert _rel(out, res.float() + a.float() @ w.float().T) < TOL[dtype]
    # 72 columns: the last block of 16 is partial; programs=2: two programs loop over the 5 tiles
    variants = [ops.GemvConfig(v, block_n=16, block_k=32, programs=p) for v, p in VARIANT_PROGRAMS]
    for cfg in variants:
        out_rows = torch.full_like(res, float("nan"))
        ops.gemv_residual(a, w, res, out_rows, replace(lc, tuned=(("down", 8, cfg),)), stage="down")
        assert _rel(out_rows, res.float() + a.float() @ w.float().T) < TOL[dtype], cfg
    x = torch.randn(batch, 64, generator=g).to(DEVICE, dtype)
    nw = (1 + 0.1 * torch.randn(64, generator=g)).to(DEVICE, dtype)
    wgu = (torch.randn(2 * 40, 64, generator=g) / 8).to(DEVICE, dtype)
    gate, up = (rms_norm(x.float(), nw.float(), 1e-5) @ wgu.float().T).split(40, -1)
    rows_gu = [replace(lc, tuned=(("gate_up", 8, cfg),)) for cfg in variants]
    for variant_lc in (lc, *rows_gu):  # 40 columns: the last block of 16 is partial
        act = torch.full((batch, 40), float("nan"), device=DEVICE, dtype=dtype)
        ops.norm_gate_up(x, nw, wgu, act, 1e-5, variant_lc)
        assert _rel(act, F.silu(gate) * up) < TOL[dtype]


@pytest.mark.parametrize("variant", ["dot", "rows", "mrow"])
def test_interpret_gemv_without_residual(variant: str) -> None:
    """``res`` None: ``out = a @ w.T`` (a row-parallel partial under TP), with and without FP8-style row scales."""
    g = torch.Generator().manual_seed(19)
    a = torch.randn(3, 96, generator=g).to(DEVICE)
    w = (torch.randn(72, 96, generator=g) / 10).to(DEVICE)
    scale = (0.5 + torch.rand(72, generator=g)).to(DEVICE)
    lc = replace(_lc(SHAPES[0]), tuned=(("o_proj", 8, ops.GemvConfig(variant, block_n=16, block_k=32, programs=2)),))
    for s in (None, scale):
        out = torch.full((3, 72), float("nan"), device=DEVICE)
        ops.gemv_residual(a, w, None, out, lc, scale=s)
        want = a.double() @ (w.double() * (1.0 if s is None else s.double()[:, None])).T
        assert _rel(out, want) < TOL[torch.float32], (variant, s is not None)


MROW_VARIANTS = ["mrow", "mrow_fma"]


# the interpreter's fast tier: each variant once in each dtype (odd batch, looping programs, or the padded 8);
# the other combinations in the slow tier (every case runs on a GPU)
_MROW_FAST = {("mrow", torch.float32, 6), ("mrow", torch.bfloat16, 2), ("mrow_fma", torch.bfloat16, 8)}
MROW_GEMV_CASES = [
    pytest.param(v, d, b, p, marks=() if (v, d, b) in _MROW_FAST else pytest.mark.slow)
    for v in MROW_VARIANTS for d in DTYPES for b, p in [(2, 0), (6, 3), (8, 0)]
]


@pytest.mark.parametrize(("variant", "dtype", "batch", "programs"), MROW_GEMV_CASES)
def test_interpret_mrow_gemv_matches_float64(variant: str, dtype: torch.dtype, batch: int, programs: int) -> None:
    """The multi-row kernels (``lowlat.kernels.mrow``) on fresh random inputs against float64 torch: GEMV +
    residual, a plain projection, norm + gate-up + SiLU; 72 / 40 output columns (a partial last tile of 16), K 96
    in blocks of 32; programs=3: fewer programs than tiles, looping."""
    g = torch.Generator().manual_seed(31 + batch)
    d64 = torch.float64
    lc = _lc(SHAPES[0])
    cfg = ops.GemvConfig(variant, block_n=16, block_k=32, programs=programs)
    a = torch.randn(batch, 96, generator=g).to(DEVICE, dtype)
    w = (torch.randn(72, 96, generator=g) / 10).to(DEVICE, dtype)
    res = torch.randn(batch, 72, generator=g).to(DEVICE, dtype)
    mlc = replace(lc, tuned=(("down", 8, cfg), ("gate_up", 8, cfg)))
    out = torch.full_like(res, float("nan"))
    ops.gemv_residual(a, w, res, out, mlc, stage="down")
    assert _rel(out, res.to(d64) + a.to(d64) @ w.to(d64).T) < TOL[dtype]
    out = torch.full_like(res, float("nan"))
    ops.gemv_residual(a, w, None, out, mlc, stage="down")
    assert _rel(out, a.to(d64) @ w.to(d64).T) < TOL[dtype]
    x = torch.randn(batch, 64, generator=g).to(DEVICE, dtype)
    nw = (1 + 0.1 * torch.randn(64, generator=g)).to(DEVICE, dtype)
    wgu = (torch.randn(2 * 40, 64, generator=g) / 8).to(DEVICE, dtype)
    gate, up = (rms_norm(x.to(d64), nw.to(d64), 1e-5) @ wgu.to(d64).T).split(40, -1)
    act = torch.full((batch, 40), float("nan"), device=DEVICE, dtype=dtype)
    ops.norm_gate_up(x, nw, wgu, act, 1e-5, mlc)
    assert _rel(act, F.silu(gate) * up) < TOL[dtype]


@pytest.mark.parametrize("variant", MROW_VARIANTS)
@pytest.mark.parametrize(("shape", "dtype"), [(SHAPES[0], DTYPES[0]),
                                             pytest.param(SHAPES[1], DTYPES[1], marks=pytest.mark.slow)])
def test_interpret_mrow_qkv_rope_matches_float64(variant: str, shape: LayerShape, dtype: torch.dtype) -> None:
    """The multi-row qkv kernel (norm + QKV + RoPE + KV write) for 6 rows against float64 torch; other slots
    untouched."""
    g = torch.Generator().manual_seed(41)
    d64 = torch.float64
    w = random_layer(shape, dtype, DEVICE, generator=g)
    meta = decode_meta([5, 1, 9, 3, 12, 7], 64, 16, DEVICE, generator=g)
    kv = random_kv(shape, 64, dtype, DEVICE, generator=g)
    before = KVCache(kv.k.clone(), kv.v.clone())
    x = torch.randn(6, shape.hidden_size, generator=g).to(DEVICE, dtype)
    q = torch.full((6, shape.q_size), float("nan"), device=DEVICE, dtype=dtype)
    lc = replace(_lc(shape), tuned=(("qkv", 8, ops.GemvConfig(variant, block_n=4, block_k=32, programs=5)),))
    ops.qkv_rope(x, w, kv, meta, q, shape, lc)
    qkv = rms_norm(x.to(d64), w.input_norm.to(d64), shape.rms_eps) @ w.qkv.to(d64).T
    rq, rk, rv = qkv.split([shape.q_size, shape.kv_size, shape.kv_size], -1)
    inv = w.rope_inv_freq.to(d64)
    rq = apply_rope(rq.view(6, shape.num_heads, -1), meta.positions, inv).reshape(6, -1)
    rk = apply_rope(rk.view(6, shape.num_kv_heads, -1), meta.positions, inv)
    loc = meta.out_cache_loc
    assert _rel(q, rq) < TOL[dtype]
    assert _rel(kv.k[loc], rk) < TOL[dtype]
    assert _rel(kv.v[loc], rv.view(6, shape.num_kv_heads, -1)) < TOL[dtype]
    others = torch.ones(64, dtype=torch.bool, device=DEVICE)
    others[loc] = False
    assert torch.equal(kv.k[others], before.k[others]) and torch.equal(kv.v[others], before.v[others])


def _build(name: str, shape: LayerShape, weights: list, dtype: torch.dtype, max_tokens: int = 8):  # type: ignore[no-untyped-def]
    if name.startswith("nvidia"):
        from lowlat.plugins.nvidia import build

        built = build(_ctx(shape, weights, dtype, max_tokens))
        if name == "nvidia-splits":  # as on a GPU of 64 SMs with 16-token KV blocks: split-KV attention, the last split
            built.lc = replace(built.lc, num_sms=64, attn_block_n=16, attn_tuned=(), fused_merge=True)  # merging
        if name == "nvidia-rows-splits":  # the same with rows_attention (runs of rows of a request) and a merge launch
            built.lc = replace(built.lc, num_sms=64, attn_block_n=16, attn_tuned=())
        if name == "nvidia-rows-wide":  # rows_attention on a grid of as many splits as 8-token blocks (up to 8)
            built.lc = replace(built.lc, num_sms=64, attn_block_n=16, attn_tuned=(), rows_wide_splits=8, rows_attn_block=8)
        return built
    from lowlat.plugins.amd import build as amd_build

    return amd_build(_ctx(shape, weights, dtype, max_tokens, amd_mode=name.split("-")[1], spin_limit=1 << 16))


# NOTE: on the CPU, amd-staged launches exactly the nvidia kernels (PDL is off), so one case suffices.
# amd-persistent at the larger shape in the slow tier (16 s on 2 busy cores; its small shape and 16-step greedy run stay)
LAYER_CASES: list[object] = [
    pytest.param(p, sh, dt, marks=pytest.mark.slow if (p, sh) == ("amd-persistent", SHAPES[1]) else ())
    for p in ("nvidia", "amd-persistent") for sh, dt in zip(SHAPES, DTYPES, strict=True)]
LAYER_CASES.append(("amd-staged", SHAPES[1], torch.bfloat16))
LAYER_CASES.append(pytest.param("nvidia-splits", SHAPES[0], torch.float32, marks=pytest.mark.slow))


@pytest.mark.parametrize(("plugin", "shape", "dtype"), LAYER_CASES)
def test_interpret_layer_matches_reference(plugin: str, shape: LayerShape, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(14)
    weights = [random_layer(shape, dtype, DEVICE, generator=g) for _ in range(2)]
    built = _build(plugin, shape, weights, dtype)
    meta = decode_meta([7, 30, 1], 64, 32, DEVICE, generator=g)
    kv = random_kv(shape, 64, dtype, DEVICE, generator=g)
    kv_ref = KVCache(kv.k.clone(), kv.v.clone())
    x = torch.randn(3, shape.hidden_size, generator=g).to(DEVICE, dtype)
    assert plugin != "nvidia-splits" or built._splits(3, meta) > 1
    for layer in range(2):  # layer 1 reads layer 0's output buffer: checks ping-pong buffers
        out = built.forward(layer, x, kv, meta)
        ref = reference_decoder_layer(x, weights[layer], kv_ref, meta, shape)
        assert _rel(out, ref) < 3 * TOL[dtype], (plugin, layer)
        assert _rel(kv.k, kv_ref.k) < TOL[dtype] and _rel(kv.v, kv_ref.v) < TOL[dtype]
        x = out.clone()
    if hasattr(built, "check_errors"):
        built.check_errors()


def _verify_meta(prefixes: list[int], rows: int, num_slots: int, max_context: int, g: torch.Generator):  # type: ignore[no-untyped-def]
    """A verify step as decode rows: request i (table row i) at prefix prefixes[i] brings `rows` new tokens;
    row j of it is at position prefix + j with seq_len prefix + j + 1 (its own and the earlier rows' K/V are
    written by the same step). Slots are distinct and scattered."""
    from lowlat.layer import ForwardMeta

    n_req = len(prefixes)
    perm = torch.randperm(num_slots, generator=g)
    table = torch.randint(0, num_slots, (n_req + 2, max_context), generator=g, dtype=torch.int32)
    used = 0
    for i, p in enumerate(prefixes):
        table[i, : p + rows] = perm[used : used + p + rows].to(torch.int32)
        used += p + rows
    req = torch.tensor([i for i in range(n_req) for _ in range(rows)], dtype=torch.int64)
    pos = torch.tensor([p + j for p in prefixes for j in range(rows)], dtype=torch.int64)
    lens = (pos + 1).to(torch.int32)
    loc = table[req, pos].to(torch.int64)
    return ForwardMeta(table.to(DEVICE), req.to(DEVICE), lens.to(DEVICE), pos.to(DEVICE), loc.to(DEVICE),
                       max_seq_len=int(lens.max()))


def _mrow_stack(variant: str, shape: LayerShape, weights: list, dtype: torch.dtype, max_tokens: int):  # type: ignore[no-untyped-def]
    """The nvidia plugin's stack with every GEMV stage on a ``lowlat.kernels.mrow`` kernel (as a tuned table would)."""
    from lowlat.plugins._stack import TritonLayerStack

    cfg = ops.GemvConfig(variant, block_n=16, block_k=32)
    tuned = tuple((stage, 16, replace(cfg, block_n=4) if stage == "qkv" else cfg) for stage in ops.GEMV_STAGES)
    return TritonLayerStack("nvidia", _ctx(shape, weights, dtype, max_tokens), replace(_lc(shape), tuned=tuned))


@pytest.mark.parametrize("plugin", ["nvidia", "amd-staged", "nvidia-mrow", "nvidia-splits", "nvidia-rows-splits",
                                    "nvidia-rows-wide", pytest.param("nvidia-mrow_fma", marks=pytest.mark.slow)])
def test_interpret_verify_rows_match_reference(plugin: str) -> None:
    """Speculative verify: 2 requests x 6 rows as decode rows (each row attends to the rows before it, whose K/V
    the step itself writes) against the reference layer: the rows' outputs, and the K/V written. nvidia-mrow*: the
    GEMV stages on the multi-row kernels; nvidia-splits: split-KV attention with the fused merge; nvidia-rows-splits:
    split-KV rows_attention (a leader program per run of a request's rows) and the merge launch; nvidia-rows-wide: the
    same on a larger grid, whose unused splits return (``LaunchConfig.rows_wide_splits``)."""
    shape, dtype = SHAPES[0], torch.float32
    g = torch.Generator().manual_seed(21)
    weights = [random_layer(shape, dtype, DEVICE, generator=g)]
    if plugin.startswith("nvidia-mrow"):
        built = _mrow_stack(plugin.split("-")[1], shape, weights, dtype, max_tokens=16)
    else:
        built = _build(plugin, shape, weights, dtype, max_tokens=16)
    splits = plugin in ("nvidia-splits", "nvidia-rows-splits", "nvidia-rows-wide")
    meta = _verify_meta([19, 2] if splits else [9, 2], 6, 64, 32, g)  # 25 positions: 2 splits of 16
    kv = random_kv(shape, 64, dtype, DEVICE, generator=g)
    kv_ref = KVCache(kv.k.clone(), kv.v.clone())
    x = torch.randn(12, shape.hidden_size, generator=g).to(DEVICE, dtype)
    assert not splits or built._splits(12, meta) > 1
    assert built.lc.uses_rows_attention(12) == (plugin != "nvidia-splits")
    out = built.forward(0, x, kv, meta)
    ref = reference_decoder_layer(x, weights[0], kv_ref, meta, shape)
    assert _rel(out, ref) < 3 * TOL[dtype]
    assert _rel(kv.k, kv_ref.k) < TOL[dtype] and _rel(kv.v, kv_ref.v) < TOL[dtype]
    # the oracle is causal: a row that saw a later row's K/V would differ from attention over its own prefix
    first = reference_decoder_layer(x[:1], weights[0], KVCache(kv_ref.k.clone(), kv_ref.v.clone()),
                                    replace(meta, req_pool_indices=meta.req_pool_indices[:1], seq_lens=meta.seq_lens[:1],
                                            positions=meta.positions[:1], out_cache_loc=meta.out_cache_loc[:1]), shape)
    assert _rel(out[:1], first) < 3 * TOL[dtype]


@pytest.mark.parametrize("plugin", ["nvidia", "amd-persistent", "amd-staged"])
def test_batch_beyond_the_built_workspaces_is_rejected_before_any_launch(plugin: str) -> None:
    # the amd persistent mode once launched such a batch, writing past its workspaces and sync counters
    shape, dtype = SHAPES[0], DTYPES[0]
    g = torch.Generator().manual_seed(15)
    built = _build(plugin, shape, [random_layer(shape, dtype, DEVICE, generator=g)], dtype, max_tokens=2)
    meta = decode_meta([7, 30, 1], 64, 32, DEVICE, generator=g)
    kv = random_kv(shape, 64, dtype, DEVICE, generator=g)
    before = KVCache(kv.k.clone(), kv.v.clone())
    with pytest.raises(ShapeError, match="at most 2"):
        built.forward(0, torch.randn(3, shape.hidden_size, generator=g).to(DEVICE, dtype), kv, meta)
    assert torch.equal(kv.k, before.k) and torch.equal(kv.v, before.v)
    if hasattr(built, "check_errors"):
        built.check_errors()


# 16 steps in the default tier (contexts up to 20 and 18: three of the interpreter's 8-slot attention blocks);
# the 64-step runs (the interpreter's longest cases, about a minute each on 2 CPU cores) in the slow tier
@pytest.mark.parametrize(("plugin", "num_layers", "steps"), [
    ("nvidia", 2, 16), ("amd-persistent", 1, 16),
    pytest.param("nvidia", 2, 64, marks=pytest.mark.slow), pytest.param("amd-persistent", 1, 64, marks=pytest.mark.slow)])
def test_interpret_greedy_tokens_identical_over_n_steps(plugin: str, num_layers: int, steps: int) -> None:
    shape = LayerShape(hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32)
    model = TinyModel.random(shape, num_layers=num_layers, vocab=89, seed=5)
    model = TinyModel(shape, [_to(w) for w in model.layers], model.embed.to(DEVICE), model.final_norm.to(DEVICE),
                      model.lm_head.to(DEVICE))
    prompts = [[3, 14, 15, 88, 6], [2, 71, 82]]
    built = _build(plugin, shape, model.layers, torch.float32, max_tokens=2)
    want = greedy_decode(model, prompts, steps)
    got = greedy_decode(model, prompts, steps, layer_fn=built.forward)
    assert got == want
    assert len(set(want[0])) > 3  # the decode is not stuck on one token


def _to(w):  # type: ignore[no-untyped-def]
    from dataclasses import fields, replace

    return replace(w, **{f.name: getattr(w, f.name).to(DEVICE) for f in fields(w) if getattr(w, f.name) is not None})


def test_interpret_persistent_spin_is_bounded_and_flags_an_error() -> None:
    """A producer that never reports (its stage counter started far below zero): every wait on it must give up
    after spin_limit polls and raise the error flag, on the CPU and on a GPU alike (no reliance on scheduling);
    after reset() the same stack runs the layer correctly again."""
    from lowlat import KernelError

    shape = SHAPES[0]
    g = torch.Generator().manual_seed(15)
    weights = [random_layer(shape, torch.float32, DEVICE, generator=g)]
    built = _build("amd-persistent", shape, weights, torch.float32)
    built.spin_limit = 50
    meta = decode_meta([4, 9], 32, 16, DEVICE, generator=g)
    kv = random_kv(shape, 32, torch.float32, DEVICE, generator=g)
    x = torch.randn(2, shape.hidden_size, generator=g).to(DEVICE)
    built.sync[2] = -(1 << 20)  # the attention stage's counter: the merges wait on it
    built.forward(0, x, KVCache(kv.k.clone(), kv.v.clone()), meta)
    with pytest.raises(KernelError, match="spin_limit=50"):
        built.check_errors()
    built.reset()
    built.check_errors()
    kv_ref = KVCache(kv.k.clone(), kv.v.clone())
    out = built.forward(0, x, kv, meta)
    built.check_errors()
    assert _rel(out, reference_decoder_layer(x, weights[0], kv_ref, meta, shape)) < 1e-4


def test_interpret_persistent_task_counts_may_change_between_launches() -> None:
    """Batch size and split count change the number of tiles per stage from launch to launch; the
    last program out must leave the counters at zero so the next launch's waits are right."""
    shape = SHAPES[0]
    g = torch.Generator().manual_seed(16)
    weights = [random_layer(shape, torch.float32, DEVICE, generator=g)]
    built = _build("amd-persistent", shape, weights, torch.float32)
    for launch, lens in enumerate([[3], [30, 2, 17], [9, 9]]):
        meta = decode_meta(lens, 64, 32, DEVICE, generator=g)
        kv = random_kv(shape, 64, torch.float32, DEVICE, generator=g)
        kv_ref = KVCache(kv.k.clone(), kv.v.clone())
        x = torch.randn(len(lens), shape.hidden_size, generator=g).to(DEVICE)
        out = built.forward(0, x, kv, meta)
        built.check_errors()
        assert _rel(out, reference_decoder_layer(x, weights[0], kv_ref, meta, shape)) < 1e-4
        assert built.sync[1:6].tolist() == [0] * 5 and int(built.sync[0]) == launch + 1
