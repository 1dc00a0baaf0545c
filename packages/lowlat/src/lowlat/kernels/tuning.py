"""Measured GEMV kernel choices per GPU and layer shape.

``benchmarks/lowlat/bench_gemv.py`` times every stage's candidates (``dot`` and ``rows`` kernels,
block sizes, warps, stages) on the GPU, each stage as 32 PDL-chained launches over distinct
weights (nothing served from L2), and prints the winners as entries for ``TABLES``. A GPU or shape
without an entry gets ``LaunchConfig``'s defaults.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowlat.kernels.ops import GemvConfig
from lowlat.layer import LayerShape

if TYPE_CHECKING:
    from lowlat.moe import MoEShape

# (GPU name, (hidden, q heads, kv heads, head_dim, intermediate)) -> (stage, max batch, config), ...
ShapeKey = tuple[int, int, int, int, int]
Entry = tuple[str, int, GemvConfig]
TABLES: dict[tuple[str, ShapeKey], tuple[Entry, ...]] = {
    # H200, Llama-3-8B layer, context 512 (benchmarks/RESULTS.md, "lowlat"): batch 1 row-wise in every GEMV stage
    # (fifth session; bench_gemv: qkv 14.66, o_proj 9.52, gate-up 53.61, down 28.00 us, 98% of the copy
    # bandwidth; the 32-layer stack 112.2 us per layer). Batches 2-16: dot kernels with the batch a constexpr
    # (sixth session; batches 2-4 from a 96-config sweep at batch 4: qkv 18.01, o_proj 10.77, gate-up 60.29, down
    # 30.27 us; 5-16 from batch 8: 20.45, 11.30, 63.99, 31.03); the stack 134.5 / 139.8 us per layer at batch 4 / 8
    # with the first batch-4 entries (150.0 / 152.7 before the constant batch)
    ("NVIDIA H200", (4096, 32, 8, 128, 14336)): (
        ("qkv", 1, GemvConfig("rows", 2, 1024, 1, 2)),
        ("o_proj", 1, GemvConfig("rows", 4, 4096, 8, 2)),
        ("gate_up", 1, GemvConfig("rows", 4, 4096, 8, 2)),
        ("down", 1, GemvConfig("rows", 4, 2048, 4, 2)),
        ("down", 4, GemvConfig("dot", 32, 512, 4, 4)),
        ("gate_up", 4, GemvConfig("dot", 32, 128, 4, 3)),
        ("o_proj", 4, GemvConfig("dot", 32, 512, 4, 4)),
        ("qkv", 4, GemvConfig("dot", 32, 256, 4, 3)),
        # batches 5-8 (speculative verify rows: 6 per request, graph of 8): the multi-row kernels where they measured
        # faster than the dot ones (benchmarks/speculative/bench_verify_gemv.py, RESULTS.md issue 34, 2026-12-02:
        # at 8 rows o_proj 10.86 vs 11.17 us, gate-up 60.04 vs 63.60; qkv stays dot, 20.60 vs 23.52; down equal)
        ("o_proj", 8, GemvConfig("mrow", 32, 256, 4, 4)),
        ("gate_up", 8, GemvConfig("mrow", 64, 128, 4, 4)),
        ("qkv", 16, GemvConfig("dot", 32, 256, 4, 3)),
        ("o_proj", 16, GemvConfig("dot", 32, 256, 4, 4)),
        ("gate_up", 16, GemvConfig("dot", 64, 128, 4, 4)),
        ("down", 16, GemvConfig("dot", 32, 512, 4, 3)),
    ),
    # H200, SmolLM2-135M layer, context 512 (benchmarks/RESULTS.md, "lowlat", 2026-11-30, fifth session): best
    # stages at batch 1 qkv 1.60, o_proj 1.18, gate-up 2.57, down 1.83 us (attention 3.1); stack 11.6 us per layer
    ("NVIDIA H200", (576, 9, 3, 64, 1536)): (
        ("qkv", 1, GemvConfig("rows", 2, 1024, 4, 2)),
        ("o_proj", 1, GemvConfig("rows", 2, 1024, 4, 2)),
        ("gate_up", 1, GemvConfig("rows", 8, 1024, 4, 2)),
        ("down", 1, GemvConfig("rows", 4, 2048, 4, 2)),
        ("qkv", 16, GemvConfig("dot", 8, 256, 4, 3)),
        ("o_proj", 16, GemvConfig("dot", 16, 256, 4, 3)),
        ("gate_up", 16, GemvConfig("dot", 32, 256, 4, 3)),
        ("down", 16, GemvConfig("dot", 16, 256, 4, 4)),
    ),
}


# FP8 (e4m3) weights with per-row scales: (GPU name, shape) -> entries as TABLES; a shape without an FP8 entry takes
# its TABLES entries (measured with the model dtype's weights: the same blocks read half the bytes).
FP8_TABLES: dict[tuple[str, ShapeKey], tuple[Entry, ...]] = {
    # H200, Llama-3-8B layer, FP8 weights (per-row scales), context 512 (benchmarks/RESULTS.md issue 33, 2026-12-02,
    # bench_gemv --fp8, 16 layers PDL-chained, us per launch). Batch 1: row-wise, half the bf16 tile's K and 4 warps,
    # 16-byte weight loads with the activations in the tile's layout (vec 16) where that won: qkv 10.16 (vec 8; 10.81
    # with the bf16 entry), o_proj 6.00 (7.15), gate-up 32.54 (37.30), down 16.96 (the bf16 entry; vec 16 17.32): sum
    # 65.7 against 72.2, the 32-layer FP8 stack (FP8 KV) 70.0 against 76.6 us per layer. Batches 2-16 as measured at 8:
    # qkv dot 20.26 (mrow 23.28), o_proj dot 11.16 (mrow 16.17), gate-up mrow 51.69 (dot 56.75), down dot 30.08 (mrow
    # 47.64); stack 138.6 against 152.3 us per layer at batch 8. Batches 2-8 (2026-12-03, bench_gemv --fp8 --batches
    # 8): the multi-row kernels in fp16 (mrow_f16: one e4m3x2 -> f16x2 conversion per two weights, where the dot / mrow
    # kernels widen to bf16 through float32 on the slow conversion pipe), as fast at 8 rows as at one: qkv 16.27 (dot
    # 20.14), o_proj 8.68 (dot 10.88; cuBLAS bf16 8.77), gate-up 32.65 (mrow 52.00), down 22.68 (dot 29.75): sum 80.3
    # against 112.8; the 32-layer stack (FP8 KV) at 8 rows 104.8 against 139.6 us per layer. Split-K (split_k 2-7)
    # lost on o_proj and down (9.69-10.48, 24.54-26.46). mrow_f16 turns rows beyond fp16's range into NaN (H200,
    # 2026-12-03), so the lines at 2-8 rows are mrow_f16s (the rows scaled by 2^-4 first: one float32 multiply per
    # activation; H200 at 8 rows: 16.94 / 9.35 / 32.88 / 24.91 us against mrow_f16's 16.35 / 8.46 / 32.76 / 22.72,
    # 84.1 against 80.3 per layer; rows of ~8e5 stay finite and accurate there)
    ("NVIDIA H200", (4096, 32, 8, 128, 14336)): (
        ("qkv", 1, GemvConfig("rows", 2, 1024, 1, 2, vec=8)),
        ("o_proj", 1, GemvConfig("rows", 4, 2048, 4, 2, vec=16)),
        ("gate_up", 1, GemvConfig("rows", 4, 2048, 4, 2, vec=16)),
        ("down", 1, GemvConfig("rows", 4, 2048, 4, 2)),
        ("qkv", 8, GemvConfig("mrow_f16s", 32, 256, 4, 3)),
        ("o_proj", 8, GemvConfig("mrow_f16s", 32, 256, 4, 4)),
        ("gate_up", 8, GemvConfig("mrow_f16s", 64, 256, 4, 3)),
        ("down", 8, GemvConfig("mrow_f16s", 32, 512, 4, 3)),
        ("qkv", 16, GemvConfig("dot", 32, 256, 4, 3)),
        ("o_proj", 16, GemvConfig("dot", 32, 256, 4, 4)),
        ("gate_up", 16, GemvConfig("mrow", 128, 128, 8, 3)),
        ("down", 16, GemvConfig("dot", 32, 512, 4, 3)),
    ),
}


# FP8 weights: (GPU name, shape) -> LaunchConfig.l2_prefetch, the bytes of the next stage's weights each row-wise GEMV
# launch requests into L2 after its tiles (lowlat.kernels.gemv.l2_prefetch). H200 8B, 32-layer FP8 stack (FP8 KV) at
# batch 1 (benchmarks/RESULTS.md issue 33, 2026-12-02): 70.4 us per layer without, 74.2 / 80.1 / 86.2 with 16 / 32 /
# 64 MiB per launch: no entry (none).
FP8_L2_PREFETCH: dict[tuple[str, ShapeKey], int] = {
}


# FP8 (e4m3) KV caches: (GPU name, shape) -> LaunchConfig.attn_f16 (the decode / verify attention's dots in fp16
# instead of bf16 widened through float32) where measured faster (device_fp8_attn_f16.sh, H200 2026-12-03, commit
# 8599715; benchmarks/RESULTS.md issue 33): 8B, 32-layer FP8 stack (FP8 weights + KV), context 4096, us per layer at
# batch 1 / 8: 80.9 / 150.5 widened to bf16, 79.8 / 140.9 in fp16; attention alone faster in fp16 at every size timed
# (verify 6 + 2 rows, context 4096: 47.8 -> 41.8; decode 8 rows 54.4 -> 45.0), its error against float64 lower
# (1.7e-3 vs 2.1e-3: fp16 keeps 3 more mantissa bits)
ATTN_F16: dict[tuple[str, ShapeKey], bool] = {
    ("NVIDIA H200", (4096, 32, 8, 128, 14336)): True,
}


# (GPU name, shape) -> LaunchConfig.verify_attn_warps (FP8 weights and KV only: nothing else was timed so): the
# attention's warps on steps of several rows per request (speculative verify). H200 8B, FP8 weights + KV, the engine's
# verify step in a graph of 8 rows (6 rows + 2 padding, context 4096; bench_verify_step.py, 2026-12-03, commit
# 3cd7d6e, us per replay): generic 4,460.5; plugin 4,256.1 at 4 warps, 3,769.1 at 8 (rows_attention 44.9 -> 31.5 us
# per layer: its 4-warp sm_90 code spills at 8 rows); decode rows keep 4 (8 rows: 150.5 -> 161.3 us per layer at 8)
VERIFY_ATTN_WARPS: dict[tuple[str, ShapeKey], int] = {
    ("NVIDIA H200", (4096, 32, 8, 128, 14336)): 8,
}


# (GPU name, shape) -> ((max batch, decode attention block_n), ...) (LaunchConfig.attn_tuned): bench_gemv's
# attention sweep, context 512, H200 2026-11-30 (benchmarks/RESULTS.md): block 32 at batch 1 (8B 5.04 us vs
# 6.20 with 64; SmolLM2 3.45 vs 3.95), 128 from batch 4 (8B 7.46 / 10.38 us vs 8.11 / 11.82 at batches 4 / 8)
ATTENTION: dict[tuple[str, ShapeKey], tuple[tuple[int, int], ...]] = {
    ("NVIDIA H200", (4096, 32, 8, 128, 14336)): ((1, 32), (16, 128)),
    ("NVIDIA H200", (576, 9, 3, 64, 1536)): ((1, 32), (16, 128)),
}

# (GPU name, shape) -> LaunchConfig.pdl_release where measured better than "auto" (benchmarks/RESULTS.md)
# H200 SmolLM2, 30-layer stack, context 512, us per layer at batch 1 / 4 / 8: early 15.0 / 23.1 / 24.0,
# auto 16.5 / 23.0 / 24.0, late 18.1 / 25.9 / 26.6 (its grids are small). The 8B layer keeps "auto"
# (124.4 / 147.8 / 150.8, late 123.7 / 146.8 / 151.5, early 129.3 / 180.5 / 184.0).
PDL_RELEASE: dict[tuple[str, ShapeKey], str] = {
    ("NVIDIA H200", (576, 9, 3, 64, 1536)): "early",
}


# (GPU name, shape) -> the largest decode batch at which the nvidia plugin measured faster than the generic
# CUDA-graph path end to end; larger batches run the generic path (LowlatConfig.measured_coverage). H200 8B,
# bench_e2e (benchmarks/RESULTS.md, 2026-11-30): 1.17-1.21x at concurrency 1 with the row-wise table; at 4 and
# 8 0.88-0.96x before the constexpr batch, 1.00x / 1.00x after it, 1.06x / 1.02x with the swept batch-4 entries
# (sixth session; cuBLAS still beats our qkv, 18.0 against 15.5 us at batch 4). Batches 9-16: not measured end to
# end, declined. Shapes without an entry: every covered batch. Dense layer stacks only (MOE_WINS_UP_TO below).
WINS_UP_TO: dict[tuple[str, ShapeKey], int] = {
    ("NVIDIA H200", (4096, 32, 8, 128, 14336)): 8,
}
# (GPU name, shape) -> the most rows of a speculative verify step at which the nvidia plugin measured faster than the
# generic path (the decode graph of those rows, cuBLAS GEMMs); 0: it takes no verify step. Shapes without an entry: as
# WINS_UP_TO. H200 8B: the earlier 0.86x (RESULTS.md, 2026-12-01) was measured on a head_dim-64 variant of the shape,
# which has no tuned table (default dot blocks). On the real shape, with the multi-row kernels at 5-8 rows,
# bench_spec_serving (RESULTS.md issue 34, 2026-12-02; 5 drafts, 6 rows per request): 1.03x per user at concurrency 1
# (graph of 8 rows) and 1.03x at 2 (graph of 16); more rows are beyond the plugin's 16-token coverage. Re-measured
# 2026-12-03 with the stack as built since 65a5d0c (bench_verify_step, one call, graph of 8 rows holding a 6-row verify
# step): generic 4,706.6 us, plugin 4,944.6 (0.95x; rows_attention's 5-split stack 17.1 us per layer), the plugin with
# rows_wide_splits 4,665.3 (1.01x) but 626 vs 660 tok/s in the engine loop (0.95x): declined (0) until a verify stack
# measures faster end to end; decode steps keep WINS_UP_TO.
VERIFY_WINS_UP_TO: dict[tuple[str, ShapeKey], int] = {
    ("NVIDIA H200", (4096, 32, 8, 128, 14336)): 0,
}
# The same with FP8 (e4m3) weights. H200 8B, FP8 weights and FP8 KV through HTTP (bench_fp8_serving, RESULTS.md issue
# 33): with the bf16 tables' tiles (commit 38e717e) 352.8 vs 338.5 tok/s per user at concurrency 1 (1.04x), 187.6 vs
# 224.2 at 8 (0.84x); with FP8_TABLES (0a22b7f) 383.8 vs 338.7 at 1 (1.13x), concurrency 8 not measured end to end (the
# stack at 8 rows, 138.6 us per layer, predicts a step slower than the generic path's): batch 1 only. FP8 verify
# steps: not measured end to end, declined (0) on the same prediction. With the mrow_f16 entries at 2-8 rows
# (2026-12-03) the stack at 8 rows is 104.8 us per layer (~3.35 ms of layers per step against the generic step's
# 4.46 ms at c=8). Measured end to end with mrow_f16s at 2-8 rows (device_fp8_c8.sh, `fp8+plugin-all` vs `fp8`, one
# call): c=1 385.5 vs 319.5 (1.21x), c=8 244.6 vs 214.2 (1.14x); the large-activation check passes on the H200: 8.
# Batches 9-16 stay generic (their dot / mrow lines widen FP8 through float32: not measured as a win).
FP8_WINS_UP_TO: dict[tuple[str, ShapeKey], int] = {
    ("NVIDIA H200", (4096, 32, 8, 128, 14336)): 8,
}
# FP8 verify steps (FP8 weights + KV), the engine's verify step of 6 + 2 rows in a graph of 8 (bench_verify_step.py,
# 2026-12-03, commit 3cd7d6e, us per replay): generic 4,460.5, the plugin 3,769.1 with the fp16 FP8-cache attention
# (ATTN_F16) and 8 warps on verify rows (VERIFY_ATTN_WARPS): 1.18x; 4,256.1 at 4 warps (1.05x). 8 rows; 9-16 as decode.
FP8_VERIFY_WINS_UP_TO: dict[tuple[str, ShapeKey], int] = {
    ("NVIDIA H200", (4096, 32, 8, 128, 14336)): 8,
}
# The same for the MoE stack, keyed also by (experts, top_k, expert intermediate size): a Mixtral layer's attention
# half has Llama-3-8B's key. H200, Mixtral-8x7B layers (4 of them), bench_e2e, eighth session, against lmserver's
# fused MoE kernels (the generic path until then ran every expert under CUDA graphs: the earlier 2.09x at
# concurrency 1 was against that): 1.02x at concurrency 1, 0.98x at 4, 0.96x at 8 (plugin on every batch).
MOE_WINS_UP_TO: dict[tuple[str, ShapeKey, tuple[int, int, int]], int] = {
    ("NVIDIA H200", (4096, 32, 8, 128, 14336), (8, 2, 14336)): 1,
}
# The same with FP8 (e4m3) attention projections and experts (per-row scales; the weight-stationary expert kernels,
# lowlat.kernels.moe). A model-dtype MOE_WINS_UP_TO entry says nothing of FP8: without an entry here the MoE stack
# declines FP8 steps under LowlatConfig.measured_only (the server's GPU default) and takes every covered batch with
# explicit `auto`. Add an entry once measured end to end against the generic FP8 path (benchmarks/lowlat/
# bench_moe_stack.py for the layer, then the serving benchmark). H200, 8-layer Mixtral-8x7B shape through HTTP
# (bench_fp8_serving, FP8 weights and KV, RESULTS.md issue 33, 2026-12-03): with the mrow_f16s expert tiles at every
# batch the plugin gave 662.3 tok/s per user at c=1 against the generic FP8 path's 745.7, and 316.0 against 298.3 at
# c=8; with the row-wise slot kernels at one token (moe_ops.EXPERT_TILES_FP8; the stack at one token 134.4 against
# 176.1 us per layer) and this entry (ec32d0b, the server's defaults): 854.1 at c=1, 312.0 at c=8 (bf16 defaults
# 537.7 / 190.6 in the same call): batches 1-8.
FP8_MOE_WINS_UP_TO: dict[tuple[str, ShapeKey, tuple[int, int, int]], int] = {
    ("NVIDIA H200", (4096, 32, 8, 128, 14336), (8, 2, 14336)): 8,
}


# (GPU name, shape) -> the amd plugin's persistent K2 launch (attention .. down): GEMV tile block_n x block_k, warps,
# pipeline stages, and `programs` the persistent grid (0: one program per compute unit; every program must be
# co-resident). Measured with the 32-layer stack (benchmarks/RESULTS.md, "lowlat", ninth session): H200 8B, us per
# layer at batch 1 / 4 / 8, 32 x 256, 4 warps, 3 stages on 2 programs per SM 184.3 / 161.9 / 167.3 (one per SM
# 194.3 / 182.6 / 195.6; the default 16 x 256 tiles 260.0 / 265.4 / 278.7)
PERSISTENT: dict[tuple[str, ShapeKey], GemvConfig] = {
    ("NVIDIA H200", (4096, 32, 8, 128, 14336)): GemvConfig("dot", 32, 256, 4, 3, programs=2 * 132),
}


def shape_key(shape: LayerShape) -> ShapeKey:
    return (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size)


def tuned_table(device_name: str, shape: LayerShape, fp8: bool = False) -> tuple[Entry, ...]:
    """The measured entries for this GPU and shape (``fp8``: FP8 weights, ``FP8_TABLES`` first), or none."""
    key = (device_name, shape_key(shape))
    return (FP8_TABLES.get(key, ()) if fp8 else ()) or TABLES.get(key, ())


def tuned_l2_prefetch(device_name: str, shape: LayerShape, fp8: bool = False) -> int:
    """The measured L2 prefetch of the row-wise GEMV launches for this GPU and shape (``FP8_L2_PREFETCH`` with FP8
    weights), else 0 (none)."""
    return FP8_L2_PREFETCH.get((device_name, shape_key(shape)), 0) if fp8 else 0


def tuned_verify_attn_warps(device_name: str, shape: LayerShape, fp8: bool) -> int:
    """The attention's warps on verify steps on this GPU and shape with FP8 weights and KV cache (``fp8``;
    ``VERIFY_ATTN_WARPS``), else 0 (``LaunchConfig.verify_attn_warps``: as on decode steps)."""
    return VERIFY_ATTN_WARPS.get((device_name, shape_key(shape)), 0) if fp8 else 0


def tuned_attn_f16(device_name: str, shape: LayerShape) -> bool:
    """Whether the attention on FP8 KV caches runs its dots in fp16 on this GPU and shape (``ATTN_F16``), else
    False (``LaunchConfig.attn_f16``)."""
    return ATTN_F16.get((device_name, shape_key(shape)), False)


def tuned_pdl_release(device_name: str, shape: LayerShape) -> str:
    """The measured PDL release point for this GPU and shape, else "auto" (``LaunchConfig.pdl_release``)."""
    return PDL_RELEASE.get((device_name, shape_key(shape)), "auto")


def tuned_attention(device_name: str, shape: LayerShape) -> tuple[tuple[int, int], ...]:
    """The measured decode-attention blocks for this GPU and shape (``LaunchConfig.attn_tuned``), or none."""
    return ATTENTION.get((device_name, shape_key(shape)), ())


def tuned_wins_up_to(device_name: str, shape: LayerShape, moe: MoEShape | None = None, fp8: bool = False) -> int:
    """The largest decode batch the plugin should take on this GPU and shape (``WINS_UP_TO``; with ``moe``, the MoE
    stack's ``MOE_WINS_UP_TO``, with ``fp8`` weights its ``FP8_MOE_WINS_UP_TO`` only; with ``fp8`` weights,
    ``FP8_WINS_UP_TO`` where it has the shape), 0 = no limit (no entry)."""
    if moe is not None:
        moe_key = (device_name, shape_key(shape), (moe.num_experts, moe.top_k, moe.expert_intermediate_size))
        return (FP8_MOE_WINS_UP_TO if fp8 else MOE_WINS_UP_TO).get(moe_key, 0)
    key = (device_name, shape_key(shape))
    if fp8 and key in FP8_WINS_UP_TO:
        return FP8_WINS_UP_TO[key]
    return WINS_UP_TO.get(key, 0)


def tuned_verify_wins_up_to(device_name: str, shape: LayerShape, fp8: bool = False) -> int | None:
    """The most verify rows the plugin should take on this GPU and shape (``VERIFY_WINS_UP_TO``, with ``fp8`` weights
    ``FP8_VERIFY_WINS_UP_TO`` where it has the shape; 0: none), or None: no entry (the decode limit applies)."""
    key = (device_name, shape_key(shape))
    if fp8 and key in FP8_VERIFY_WINS_UP_TO:
        return FP8_VERIFY_WINS_UP_TO[key]
    return VERIFY_WINS_UP_TO.get(key)


def tuned_persistent(device_name: str, shape: LayerShape) -> GemvConfig | None:
    """The measured persistent K2 launch of the amd plugin for this GPU and shape (``PERSISTENT``), or None."""
    return PERSISTENT.get((device_name, shape_key(shape)))
