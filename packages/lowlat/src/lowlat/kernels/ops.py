"""Host-side launchers of the per-stage kernels: shapes, block sizes, PDL and interpreter choice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton

from lowlat.errors import ShapeError
from lowlat.kernels import gemv as GV
from lowlat.kernels import layer as K
from lowlat.kernels import mrow as MR
from lowlat.kernels import rows_attn as RA
from lowlat.kernels._jit import check_device, next_pow2
from lowlat.layer import ForwardMeta, KVCache, LayerShape
from lowlat.reference import AttentionWeights

if TYPE_CHECKING:
    from lowlat.moe import MoEShape

GEMV_STAGES = ("qkv", "o_proj", "gate_up", "down")
GEMV_VARIANTS = ("dot", "rows", "mrow", "mrow_fma", "mrow_f16", "mrow_f16s", "mrow_w8a8", "mrow_w8a8b")
PDL_RELEASES = ("auto", "early", "late")


@dataclass(frozen=True)
class GemvConfig:
    """One GEMV stage's kernel and blocks. ``variant``: ``dot`` (tensor-core ``tl.dot``, batch padded to
    16 rows), ``rows`` (row-wise reduction, ``lowlat.kernels.gemv``, rows unrolled), or the multi-row kernels of
    ``lowlat.kernels.mrow`` (the weight tile as the left operand, all rows at once): ``mrow`` (tensor cores) and
    ``mrow_fma`` (CUDA cores); with FP8 weights also ``mrow_f16`` / ``mrow_f16s`` (the tiles widened to fp16) and
    ``mrow_w8a8`` / ``mrow_w8a8b`` (the rows quantized to e4m3 per row / per row and K block, FP8 x FP8 MMA; on
    model-dtype weights they run as ``mrow``). For ``qkv``, ``block_n`` is the number of rotary pairs per tile (it must
    divide head_dim / 2)."""

    variant: str = "dot"
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    # 0: one program per output tile; N > 0: at most N programs, each looping over tiles (a grid that
    # fits the GPU at once, so the next launch's programs can be resident early under PDL)
    programs: int = 0
    # rows kernels: at most this many contiguous weight elements per load (0: as Triton infers; 8 with FP8 weights:
    # 8-byte loads in the activation row's register layout, no shared-memory staging; 16: 16-byte FP8 loads with the
    # activation rows loaded in the weight tile's shape, no staging either; lowlat.kernels.gemv)
    vec: int = 0
    # rows kernels at one row: per-element FMAs into a tile-shaped float32 accumulator over all of K, one reduction
    # after the loop (else a reduction across the threads per K step; lowlat.kernels.gemv: measured slower on the H200
    # FP8 8B stages, in no table)
    acc2d: bool = False
    # multi-row kernels of o_proj and down (``mrow_residual_kernel``): > 1 splits K over this many programs per output
    # tile (more programs for a grid of few tiles), the last one of a tile summing the partials; it needs the stack's
    # split workspace (``gemv_residual``'s ``split_ws``) and K a multiple of split_k x block_k (else one program per
    # tile). 0 / 1: none
    split_k: int = 0

    def __post_init__(self) -> None:
        if self.variant not in GEMV_VARIANTS:
            raise ValueError(f"GemvConfig.variant must be one of {GEMV_VARIANTS}, got {self.variant!r}")
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two (a tl.arange extent), got {value}")
        if self.num_warps < 1 or self.num_stages < 1 or self.programs < 0:
            raise ValueError(f"GemvConfig needs num_warps, num_stages >= 1 and programs >= 0, got {self}")
        if self.vec < 0 or self.vec & (self.vec - 1):
            raise ValueError(f"GemvConfig.vec must be 0 or a power of two, got {self.vec}")
        if self.split_k < 0 or (self.split_k > 1 and not self.multi_row):
            raise ValueError(f"GemvConfig.split_k: 0 or a split count of a multi-row variant, got {self}")

    @property
    def row_wise(self) -> bool:
        """Whether the stage runs a ``lowlat.kernels.gemv`` row-wise kernel."""
        return self.variant == "rows"

    @property
    def multi_row(self) -> bool:
        """Whether the stage runs a ``lowlat.kernels.mrow`` kernel."""
        return self.variant.startswith("mrow")

    @property
    def mma(self) -> bool:
        """Whether a ``mrow`` kernel uses the tensor cores."""
        return self.variant in ("mrow", "mrow_f16", "mrow_f16s", "mrow_w8a8", "mrow_w8a8b")

    @property
    def w8a8(self) -> bool:
        """Whether a ``mrow`` kernel quantizes the rows to e4m3 for an FP8 x FP8 MMA (FP8 weights)."""
        return self.variant in ("mrow_w8a8", "mrow_w8a8b")

    @property
    def mma_kind(self) -> int:
        """The ``mrow`` kernels' ``MMA``: 0 CUDA cores, 1 tensor cores, 2 tensor cores in fp16 for FP8 weights, 3 the
        same with the activation rows scaled into fp16's range first (``mrow_f16s``), 4 / 5 FP8 x FP8 with the rows
        quantized per row / per row and K block (``mrow_w8a8`` / ``mrow_w8a8b``)."""
        return {"mrow_f16": 2, "mrow_f16s": 3, "mrow_w8a8": 4, "mrow_w8a8b": 5}.get(self.variant, int(self.mma))

    def mma_for(self, fp8: bool) -> int:
        """``mma_kind`` for a launch on FP8 (``fp8``) or model-dtype weights: W8A8 runs as ``mrow`` (1) on model-dtype
        weights (the fp16 kinds' ``_wx`` falls back to the weights' dtype by itself)."""
        kind = self.mma_kind
        return kind if fp8 or kind < 4 else 1


def _grid(tiles: int, programs: int) -> tuple[tuple[int], bool]:
    """The launch grid for ``tiles`` output tiles on at most ``programs`` programs (0: one per tile), and
    whether the programs loop over tiles."""
    if 0 < programs < tiles:
        return (programs,), True
    return (tiles,), False


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and launch flags for one device (decided once at build)."""

    use_pdl: bool = False
    gemv_block_n: int = 16
    gemv_block_k: int = 256
    qkv_block_p: int = 16
    attn_block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    num_sms: int = 132
    # PDL release point: a kernel lets its dependent launch start right after its wait ("early") or
    # after its main loop ("late"); "auto": early for a grid of at most num_sms programs (all of them
    # resident at once, so dependent blocks cannot hold slots a pending primary block needs), else late
    pdl_release: str = "auto"
    # (stage, max batch, config): the first entry of a stage whose max batch is >= the batch wins
    tuned: tuple[tuple[str, int, GemvConfig], ...] = ()
    # (max batch, attention block_n): the same rule for the decode attention's KV block (else attn_block_n)
    attn_tuned: tuple[tuple[int, int], ...] = ()
    # the largest decode batch the plugin measured faster than the generic path at (0: no limit)
    wins_up_to: int = 0
    # the most rows of a verify step it measured faster at (0: none; None: as wins_up_to)
    verify_wins_up_to: int | None = None
    # FP8 (e4m3) weights with per-row scales (every kernel variant reads them; the tables: ``tuning.FP8_TABLES``)
    fp8: bool = False
    # split-KV attention: the last split program of each row and KV head merges the partials (no merge launch;
    # ``attention``'s ``counts``); False: a merge launch after the attention. Off: on the H200 (8B shape, 32-layer
    # FP8 stack, batch 1) the fused merge took attention + merge from 4.1 + 3.0 to 6.5 us of marginal time per layer
    # but the stack from 70.2 to 71.6 us per layer (the o_proj after it started later); bf16 at 8 rows 135.5 against
    # 137.8 with the per-split merge loop of fec71e2 (benchmarks/RESULTS.md, issue 33, 2026-12-02)
    fused_merge: bool = False
    # decode / verify batches of 2 to this many rows run ``rows_attention`` (each request's K/V read once for all of
    # its rows; 0: never; not with ``fused_merge``) in KV blocks of ``rows_attn_block`` tokens (0: ``attn_block``), on
    # the per-row kernel's split count (the stack's). H200, 8B shape, context 608, attention alone (benchmarks/RESULTS.md
    # issue 34, 2026-12-02): at 8 rows and 5 splits in blocks of 128, verify 6 + 2 rows 14.48 -> 12.44 us per layer,
    # decode of 8 requests 19.14 -> 18.88; more splits help verify rows (10 splits of 64: 10.88, 16 of 32: 9.80) but
    # cost a decode step of 8 requests (22.30, 28.04: the empty splits' programs and a wider merge), and one graph
    # serves both
    rows_attention_up_to: int = 0
    rows_attn_block: int = 0
    # > 0: ``rows_attention`` on a grid of as many splits as its KV blocks allow, at most this many, of which the kernel
    # uses as many as the launch's requests need (the empty splits' programs return, the merge reads the used ones);
    # 0: the per-row kernel's split count (measured above). Not measured end to end yet (issue 34)
    rows_wide_splits: int = 0
    # > 0: the row-wise GEMV launches (qkv, o_proj, gate-up, down) request up to this many bytes of the next stage's
    # weights into L2 after their own tiles (``gemv.l2_prefetch``; the stack passes the qkv launch o_proj's weights,
    # o_proj gate-up's, gate-up down's, down the next layer's qkv), so that the memory keeps streaming through launch
    # tails and the attention; 0: none. H200, FP8 8B stack at batch 1 (benchmarks/RESULTS.md issue 33, 2026-12-02):
    # 70.4 us per layer without, 74.2 / 80.1 / 86.2 with 16 / 32 / 64 MiB: off (tuning.FP8_L2_PREFETCH empty)
    l2_prefetch: int = 0
    # FP8 (e4m3) KV caches: the decode / verify attention's two dots in fp16 (``layer._attend_block``: one
    # ``cvt.rn.f16x2.e4m3x2`` per two K / V elements, q cast once per split to fp16 times 2^-4, p to fp16, float32
    # sums) instead of bf16 widened through float32 (``_dot``); no effect on model-dtype caches. Off until timed on a
    # GPU (``tuning.ATTN_F16``; issues 33 / 34: rows_attention on the H200's FP8 cache 24 us per layer, bf16 12)
    attn_f16: bool = False
    # warps of the decode / verify attention launches (0: num_warps). sm_90 code of the 8B shape's FP8-cache attention
    # at 8 rows and KV blocks of 128 (Triton 3.6, 4 warps): 255 registers and 0 / 88 B of stack (per-row / rows kernel)
    # widened to bf16, 80 / 216 B in fp16; at 8 warps none spills (benchmarks/fp8/GPU_NOTES.md). Measured on decode
    # rows slower at 8 warps (H200 8B FP8 stack, 8 rows, context 4096: 150.5 -> 161.3 us per layer): 0
    attn_warps: int = 0
    # the same for steps whose requests hold several rows (``ForwardMeta.rows_per_request`` > 1: speculative verify
    # steps, which the engine replays in graphs of their own where this differs from ``attn_warps``); 0: attn_warps.
    # H200 8B FP8 verify step of 6 + 2 rows (tuning.VERIFY_ATTN_WARPS): 4,256 us at 4 warps, 3,769 at 8
    verify_attn_warps: int = 0

    @classmethod
    def for_device(cls, device: torch.device, shape: LayerShape, use_pdl: bool, moe: MoEShape | None = None,
                   fp8: bool = False, fp8_kv: bool = False) -> LaunchConfig:
        """GPU: tensor-core friendly blocks plus the measured per-stage table (``lowlat.kernels.tuning``)
        of this GPU and shape (``moe``: the MoE stack's measured coverage; ``fp8``: FP8 weights, their own table;
        ``fp8_kv``: an FP8 KV cache); CPU (interpreter): small blocks that divide the shape."""
        if device.type == "cpu":
            return cls(
                fp8=fp8,
                use_pdl=False,
                gemv_block_n=min(16, next_pow2(shape.hidden_size)),
                gemv_block_k=min(32, next_pow2(shape.hidden_size)),
                qkv_block_p=min(8, shape.head_dim // 2),
                attn_block_n=8,
                num_sms=1,
                rows_attention_up_to=16,
            )
        from lowlat.kernels.tuning import (
            tuned_attention,
            tuned_attn_f16,
            tuned_l2_prefetch,
            tuned_pdl_release,
            tuned_table,
            tuned_verify_attn_warps,
            tuned_verify_wins_up_to,
            tuned_wins_up_to,
        )

        props = torch.cuda.get_device_properties(device)
        return cls(use_pdl=use_pdl, qkv_block_p=min(16, shape.head_dim // 2), num_sms=props.multi_processor_count,
                   tuned=tuned_table(props.name, shape, fp8), pdl_release=tuned_pdl_release(props.name, shape), fp8=fp8,
                   attn_tuned=tuned_attention(props.name, shape), wins_up_to=tuned_wins_up_to(props.name, shape, moe, fp8),
                   verify_wins_up_to=None if moe is not None else tuned_verify_wins_up_to(props.name, shape, fp8),
                   rows_attention_up_to=16, l2_prefetch=tuned_l2_prefetch(props.name, shape, fp8),
                   attn_f16=tuned_attn_f16(props.name, shape),
                   verify_attn_warps=tuned_verify_attn_warps(props.name, shape, fp8 and fp8_kv))

    def __post_init__(self) -> None:
        if self.pdl_release not in PDL_RELEASES:
            raise ValueError(f"LaunchConfig.pdl_release must be one of {PDL_RELEASES}, got {self.pdl_release!r}")

    def pdl_early(self, programs: int) -> bool:
        """Whether a launch of ``programs`` programs releases its dependent launch right after its wait."""
        if self.pdl_release == "auto":
            return programs <= self.num_sms
        return self.pdl_release == "early"

    def attention_warps(self, rows_per_request: int) -> int:
        """Warps of the attention launches of a step whose requests hold up to ``rows_per_request`` rows (0: the
        launch's ``num_warps``). Pure."""
        return (self.verify_attn_warps or self.attn_warps) if rows_per_request > 1 else self.attn_warps

    @property
    def verify_launch_differs(self) -> bool:
        """Whether steps of several rows per request (verify steps) launch the attention otherwise than decode
        steps: a CUDA graph captured for one cannot replay the other's launch. Pure."""
        return self.attention_warps(2) != self.attention_warps(1)

    def uses_rows_attention(self, batch: int) -> bool:
        """Whether a decode / verify batch of ``batch`` rows runs ``rows_attention`` (else ``attention``)."""
        return 2 <= batch <= self.rows_attention_up_to and not self.fused_merge

    def attn_block(self, batch: int) -> int:
        """The decode attention's KV block (tokens per inner step) at ``batch`` rows."""
        return next((block for max_batch, block in self.attn_tuned if batch <= max_batch), self.attn_block_n)

    def qkv_block_errors(self, shape: LayerShape) -> tuple[str, ...]:
        """Why the qkv kernel's rotary-pair blocks (the default and every tuned one) do not fit ``shape``."""
        blocks = {self.qkv_block_p, *(cfg.block_n for stage, _, cfg in self.tuned if stage == "qkv")}
        return tuple(f"head_dim {shape.head_dim} is not a multiple of 2 * {p}" for p in sorted(blocks)
                     if (shape.head_dim // 2) % p)

    def gemv_config(self, stage: str, batch: int) -> GemvConfig:
        """The kernel and blocks of GEMV ``stage`` (one of ``GEMV_STAGES``) at ``batch`` rows."""
        for name, max_batch, cfg in self.tuned:
            if name == stage and batch <= max_batch:
                return cfg
        block_n = self.qkv_block_p if stage == "qkv" else self.gemv_block_n
        return GemvConfig("dot", block_n, self.gemv_block_k, self.num_warps, self.num_stages)


def _prefetch_kw(prefetch: torch.Tensor | None, lc: LaunchConfig, cfg: GemvConfig) -> dict[str, object]:
    """The row-wise kernels' L2 prefetch arguments: up to ``lc.l2_prefetch`` bytes of ``prefetch`` (a contiguous
    tensor; none on the CPU, in other kernels, or without a tensor)."""
    if prefetch is None or lc.l2_prefetch <= 0 or prefetch.device.type != "cuda" or not cfg.row_wise:
        return {}
    nbytes = min(lc.l2_prefetch, prefetch.numel() * prefetch.element_size()) // 16 * 16
    return {"pf_ptr": prefetch, "pf_bytes": nbytes, "PREFETCH": nbytes > 0} if nbytes else {}


def _kw(dev: torch.device, lc: LaunchConfig, pdl: bool = True, cfg: GemvConfig | None = None) -> dict[str, object]:
    check_device(dev)
    if dev.type == "cpu":
        return {}
    kw: dict[str, object] = {"num_warps": cfg.num_warps if cfg else lc.num_warps,
                             "num_stages": cfg.num_stages if cfg else lc.num_stages}
    if lc.use_pdl and pdl:
        kw["launch_pdl"] = True
    return kw


def _attn_kw(dev: torch.device, lc: LaunchConfig, meta: ForwardMeta) -> dict[str, object]:
    """``_kw`` of the attention launches: ``lc.attention_warps`` warps for the step's rows per request where set (a
    GPU)."""
    kw = _kw(dev, lc)
    warps = lc.attention_warps(meta.rows_per_request)
    if warps and dev.type != "cpu":
        kw["num_warps"] = warps
    return kw


def block_m(batch: int, device: torch.device) -> int:
    """Rows per dot tile: the batch padded to a power of two (at least 16 on a GPU, for tl.dot)."""
    return next_pow2(batch) if device.type == "cpu" else max(16, next_pow2(batch))


def mrow_block_m(batch: int, device: torch.device, cfg: GemvConfig) -> int:
    """Rows of a ``mrow`` tile: the batch padded to a power of two (at least 8 for an MMA on a GPU: n = 8; 16 for the
    FP8 x FP8 MMA of ``mrow_w8a8*``: with 8, Triton 3.6 lowers the dot to an fp16 ``mma.sync``, both operands widened)."""
    return max(16 if cfg.w8a8 else 8, next_pow2(batch)) if cfg.mma and device.type != "cpu" else next_pow2(batch)


def num_splits(batch: int, shape: LayerShape, max_seq_len: int, lc: LaunchConfig, max_splits: int) -> int:
    """Split-KV partitions: enough programs to fill the GPU, none shorter than one block. Host-only."""
    want = triton.cdiv(2 * lc.num_sms, max(1, batch * shape.num_kv_heads))
    return max(1, min(max_splits, want, triton.cdiv(max(1, max_seq_len), lc.attn_block(batch))))


def rows_block(batch: int, lc: LaunchConfig, device: torch.device) -> int:
    """``rows_attention``'s KV block at ``batch`` rows (``rows_attn_block``, else ``attn_block``; >= 16 on a GPU for
    ``tl.dot``)."""
    block = lc.rows_attn_block or lc.attn_block(batch)
    return block if device.type == "cpu" else max(16, block)


def rows_splits(batch: int, shape: LayerShape, max_seq_len: int, lc: LaunchConfig, max_splits: int,
                device: torch.device) -> int:
    """As many splits as ``rows_attention``'s KV blocks allow, at most ``max_splits`` (a larger grid than the stack
    launches: the kernel then uses fewer where the launch holds many requests; benchmarks and tests). Host-only."""
    return max(1, min(max_splits, triton.cdiv(max(1, max_seq_len), rows_block(batch, lc, device))))


def check_head_dim(shape: LayerShape) -> None:
    if shape.head_dim & (shape.head_dim - 1):
        raise ShapeError(f"the Triton layer kernels need a power-of-two head_dim, got {shape.head_dim}")


def qkv_rope(
    x: torch.Tensor, w: AttentionWeights, kv: KVCache, meta: ForwardMeta, q_out: torch.Tensor, shape: LayerShape, lc: LaunchConfig,
    grid_programs: int | None = None, prefetch: torch.Tensor | None = None,
) -> None:
    """RMSNorm + QKV + RoPE of ``x`` (B, hidden): writes ``q_out`` (B, q_size) and K/V at out_cache_loc (FP8 weights:
    ``w.qkv_scale``; an FP8 cache: quantized with ``kv``'s scales). ``prefetch``: the next stage's weights
    (``LaunchConfig.l2_prefetch``)."""
    b, dev = x.shape[0], x.device
    scale: torch.Tensor | None = getattr(w, "qkv_scale", None)
    cfg = lc.gemv_config("qkv", b)
    block_p = cfg.block_n  # NOTE: divides head_dim / 2 (LaunchConfig.qkv_block_errors, checked at build)
    tiles = (shape.num_heads + 2 * shape.num_kv_heads) * (shape.head_dim // 2 // block_p)
    grid, _ = _grid(tiles, grid_programs or cfg.programs)  # NOTE: the qkv kernels always loop over tiles
    common = dict(B=b, eps=shape.rms_eps, stride_ks=kv.k.stride(0), stride_kh=kv.k.stride(1), stride_vs=kv.v.stride(0),
                  stride_vh=kv.v.stride(1), inv_k_scale=1.0 / kv.k_scale, inv_v_scale=1.0 / kv.v_scale,
                  HAS_SCALE=scale is not None, KV_FP8=kv.fp8, H=shape.hidden_size, NQ=shape.num_heads, NKV=shape.num_kv_heads,
                  D=shape.head_dim, BLOCK_P=block_p, BLOCK_K=min(cfg.block_k, next_pow2(shape.hidden_size)),
                  USE_PDL=lc.use_pdl, PDL_EARLY=lc.pdl_early(grid[0]), **_kw(dev, lc, cfg=cfg))
    args = (x, w.input_norm, w.qkv, w.qkv if scale is None else scale, w.rope_inv_freq, meta.positions,
            meta.out_cache_loc, q_out, kv.k, kv.v)
    if cfg.row_wise:
        GV.qkv_rope_rows_kernel[grid](*args, BLOCK_M=next_pow2(b), W_VEC=cfg.vec, ACC2D=cfg.acc2d and b == 1,
                                      **_prefetch_kw(prefetch, lc, cfg), **common)
        return
    if cfg.multi_row:
        common.pop("B")
        MR.mrow_qkv_rope_kernel[grid](*args, B=b, BLOCK_M=mrow_block_m(b, dev, cfg), MMA=cfg.mma_for(scale is not None),
                                      DOT_F32=dev.type == "cpu" or x.dtype == torch.float32, **common)
        return
    K.qkv_rope_kernel[grid](*args, BLOCK_M=block_m(b, dev), DOT_F32=dev.type == "cpu" or x.dtype == torch.float32, **common)


# Rows of one request a step may carry (speculative verify: the last token and up to 7 drafts, each row a decode row
# at its own position). The attention launch reads the last MAX_VERIFY_ROWS positions of every row only after its PDL
# wait, since the qkv launch of the same step may have written any of them.
MAX_VERIFY_ROWS = 8


def attention(
    q: torch.Tensor, kv: KVCache, meta: ForwardMeta, part_o: torch.Tensor, part_lse: torch.Tensor,
    out: torch.Tensor, shape: LayerShape, lc: LaunchConfig, splits: int, counts: torch.Tensor | None = None,
) -> None:
    """Split-KV decode attention of ``q`` (B, q_size) into ``out`` (B, q_size), through partials and a
    merge launch, or with ``splits == 1`` in one launch. ``counts``: int32 zeros, at least B * kv_heads of them
    (left zero again by every launch): the split program that finishes last for its row and KV head merges the
    partials itself, one launch in all (``decode_attention_kernel``'s ``FUSED_MERGE``). An FP8 ``kv`` with
    ``lc.attn_f16``: the dots in fp16 (``LaunchConfig.attn_f16``)."""
    b, dev = q.shape[0], q.device
    group = shape.group_size
    grid = (b, shape.num_kv_heads, splits)
    fused = counts is not None and splits > 1
    if counts is not None and fused and (counts.dtype != torch.int32 or counts.numel() < b * shape.num_kv_heads):
        raise ShapeError(f"attention counts: int32, at least {b * shape.num_kv_heads} of them")
    K.decode_attention_kernel[grid](
        q, kv.k, kv.v, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
        part_o, part_lse, out, counts if fused else meta.seq_lens,
        meta.req_to_token.stride(0), kv.k.stride(0), kv.k.stride(1), kv.v.stride(0), kv.v.stride(1),
        shape.head_dim**-0.5 * (kv.k_scale if kv.fp8 else 1.0), kv.v_scale if kv.fp8 else 1.0,
        NQ=shape.num_heads, G=group, D=shape.head_dim,
        BLOCK_G=next_pow2(group) if dev.type == "cpu" else max(16, next_pow2(group)), BLOCK_N=lc.attn_block(b),
        NUM_SPLITS=splits, DOT_F32=dev.type == "cpu" or q.dtype == torch.float32, USE_PDL=lc.use_pdl,
        PDL_EARLY=lc.pdl_early(b * shape.num_kv_heads * splits), FRESH=MAX_VERIFY_ROWS, FUSED_MERGE=fused,
        BLOCK_S=next_pow2(splits), BLOCK_GM=next_pow2(group), KV_F16=lc.attn_f16 and kv.fp8, **_attn_kw(dev, lc, meta),
    )
    if splits == 1 or fused:
        return  # the attention kernel wrote `out` itself
    K.merge_splits_kernel[(b, shape.num_heads)](
        part_o, part_lse, out, NQ=shape.num_heads, D=shape.head_dim, NUM_SPLITS=splits, BLOCK_S=next_pow2(splits),
        USE_PDL=lc.use_pdl, PDL_EARLY=lc.pdl_early(b * shape.num_heads), **_kw(dev, lc),
    )


def rows_attention(
    q: torch.Tensor, kv: KVCache, meta: ForwardMeta, part_o: torch.Tensor, part_lse: torch.Tensor,
    out: torch.Tensor, shape: LayerShape, lc: LaunchConfig, splits: int, used: torch.Tensor | None = None,
) -> None:
    """``attention`` with each run of rows of one request (at most ``rows_attn.ROWS_PER_RUN``, a verify step's rows)
    read against each K/V tile once (``rows_attn.rows_attention_kernel``), then the merge launch (none with
    ``splits == 1``). ``splits``: the grid's (the stack passes ``num_splits``, as for ``attention``); the kernel uses
    fewer where the launch holds more requests than ``2 * num_sms`` programs over KV heads and splits allow.
    ``used``: int32, at least B of them: the unused splits' programs return at once and the merge reads each row's
    used splits only (``rows_attn.rows_merge_kernel``), for grids larger than the per-row one (``rows_wide_splits``)."""
    b, dev = q.shape[0], q.device
    skip = used is not None and splits > 1
    if skip and (used.dtype != torch.int32 or used.numel() < b):  # type: ignore[union-attr]
        raise ShapeError(f"rows_attention used: int32, at least {b} of them")
    group = shape.group_size
    block_gp = next_pow2(group)
    r = RA.ROWS_PER_RUN
    block_m = r * block_gp if dev.type == "cpu" else max(16, r * block_gp)
    RA.rows_attention_kernel[(b, shape.num_kv_heads, splits)](
        q, kv.k, kv.v, meta.req_to_token, meta.req_pool_indices, meta.seq_lens, part_o, part_lse, out,
        used if skip else meta.seq_lens, b, meta.req_to_token.stride(0), kv.k.stride(0), kv.k.stride(1), kv.v.stride(0), kv.v.stride(1),
        shape.head_dim**-0.5 * (kv.k_scale if kv.fp8 else 1.0), kv.v_scale if kv.fp8 else 1.0,
        NQ=shape.num_heads, G=group, D=shape.head_dim, KVH=shape.num_kv_heads, R=r, BLOCK_GP=block_gp, BLOCK_M=block_m,
        BLOCK_B=next_pow2(b), BLOCK_N=rows_block(b, lc, dev),
        NUM_SPLITS=splits, TARGET=2 * lc.num_sms, DOT_F32=dev.type == "cpu" or q.dtype == torch.float32,
        USE_PDL=lc.use_pdl, PDL_EARLY=lc.pdl_early(b * shape.num_kv_heads * splits), FRESH=MAX_VERIFY_ROWS,
        BLOCK_G1=block_gp if dev.type == "cpu" else max(16, block_gp), BLOCK_N1=lc.attn_block(b), SKIP_EMPTY=skip,
        KV_F16=lc.attn_f16 and kv.fp8, **_attn_kw(dev, lc, meta),
    )
    if splits == 1:
        return
    if skip:
        RA.rows_merge_kernel[(b, shape.num_heads)](
            part_o, part_lse, out, used, NQ=shape.num_heads, D=shape.head_dim, NUM_SPLITS=splits,
            BLOCK_S=next_pow2(splits), USE_PDL=lc.use_pdl, PDL_EARLY=lc.pdl_early(b * shape.num_heads), **_kw(dev, lc),
        )
        return
    K.merge_splits_kernel[(b, shape.num_heads)](
        part_o, part_lse, out, NQ=shape.num_heads, D=shape.head_dim, NUM_SPLITS=splits, BLOCK_S=next_pow2(splits),
        USE_PDL=lc.use_pdl, PDL_EARLY=lc.pdl_early(b * shape.num_heads), **_kw(dev, lc),
    )


def split_k_of(cfg: GemvConfig, k: int) -> int:
    """The split count a multi-row GEMV launch of ``cfg`` over K = ``k`` runs with: ``cfg.split_k`` where K is a
    multiple of split_k x its K block, else 1. Pure."""
    block_k = min(cfg.block_k, next_pow2(k))
    return cfg.split_k if cfg.split_k > 1 and cfg.multi_row and k % (cfg.split_k * block_k) == 0 else 1


def split_ws_errors(lc: LaunchConfig, batch: int, n: int, part: torch.Tensor, counts: torch.Tensor) -> tuple[str, ...]:
    """Why ``(part, counts)`` cannot serve the split-K launches of ``lc``'s o_proj / down entries at up to ``batch`` rows
    and N = ``n`` (float32 partials of split_k x batch x n, int32 zero counters, one per output tile). Pure."""
    errors = []
    for stage, _, cfg in lc.tuned:
        if stage in ("o_proj", "down") and cfg.split_k > 1:
            if part.dtype != torch.float32 or part.numel() < cfg.split_k * batch * n:
                errors.append(f"{stage}: split_k {cfg.split_k} needs {cfg.split_k * batch * n} float32 partials")
            if counts.dtype != torch.int32 or counts.numel() < triton.cdiv(n, cfg.block_n):
                errors.append(f"{stage}: split_k needs {triton.cdiv(n, cfg.block_n)} int32 counters")
    return tuple(errors)


def gemv_residual(
    a: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None, out: torch.Tensor, lc: LaunchConfig,
    stage: str = "o_proj", scale: torch.Tensor | None = None, prefetch: torch.Tensor | None = None,
    split_ws: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``out = res + a @ w.T`` for a (B, K), w (N, K), res/out (B, N), with ``stage``'s tuned kernel (FP8 ``w``:
    ``scale`` (N,) its rows' scales). Under PDL ``res`` is read before the wait: it must not be written by the launch
    right before this one. ``res`` None: ``out = a @ w.T`` (a row-parallel partial under TP). ``split_ws``: float32
    partials (at least split_k x B x N) and int32 counters (one per output tile, zero; every launch leaves them zero
    again) for a split-K config (``GemvConfig.split_k``; ``split_ws_errors`` checks them)."""
    b, dev = a.shape[0], a.device
    cfg = lc.gemv_config(stage, b)
    s_arg = w if scale is None else scale
    n, k = w.shape
    grid, loop = _grid(triton.cdiv(n, cfg.block_n), cfg.programs)
    if cfg.multi_row:
        split = split_k_of(cfg, k)
        if split > 1 and split_ws is None:
            raise ShapeError(f"{stage}: split_k {split} needs a split workspace (gemv_residual's split_ws)")
        part, counts = split_ws if split > 1 and split_ws is not None else (out, out)  # NOTE: never read without SPLIT
        if split > 1:  # split programs per tile, tile-major (a tile's splits run side by side); never looping
            grid, loop = (triton.cdiv(n, cfg.block_n) * split,), False
        MR.mrow_residual_kernel[grid](
            a, w, s_arg, res, out, part, counts, B=b, N=n, K=k, BLOCK_M=mrow_block_m(b, dev, cfg), BLOCK_N=cfg.block_n,
            BLOCK_K=min(cfg.block_k, next_pow2(k)), MMA=cfg.mma_for(scale is not None), DOT_F32=dev.type == "cpu" or a.dtype == torch.float32,
            HAS_RES=res is not None, USE_PDL=lc.use_pdl, PDL_EARLY=lc.pdl_early(grid[0]), LOOP=loop,
            HAS_SCALE=scale is not None, SPLIT=split, **_kw(dev, lc, cfg=cfg),
        )
        return
    has_res = res is not None
    r_arg = out if res is None else res  # NOTE: never read without HAS_RES
    if cfg.row_wise:
        GV.gemv_rows_residual_kernel[grid](
            a, w, s_arg, r_arg, out, b, N=n, K=k, BLOCK_M=next_pow2(b), BLOCK_N=cfg.block_n, LOOP=loop,
            HAS_SCALE=scale is not None, W_VEC=cfg.vec, HAS_RES=has_res, ACC2D=cfg.acc2d and b == 1,
            **_prefetch_kw(prefetch, lc, cfg), BLOCK_K=min(cfg.block_k, next_pow2(k)), USE_PDL=lc.use_pdl, PDL_EARLY=lc.pdl_early(grid[0]), **_kw(dev, lc, cfg=cfg),
        )
        return
    K.gemv_residual_kernel[grid](
        a, w, s_arg, r_arg, out, b, N=n, K=k, BLOCK_M=block_m(b, dev), BLOCK_N=cfg.block_n, LOOP=loop,
        HAS_SCALE=scale is not None, HAS_RES=has_res,
        BLOCK_K=min(cfg.block_k, next_pow2(k)), DOT_F32=dev.type == "cpu" or a.dtype == torch.float32,
        USE_PDL=lc.use_pdl, PDL_EARLY=lc.pdl_early(grid[0]), **_kw(dev, lc, cfg=cfg),
    )


RESIDUAL_ADD_BLOCK = 1024  # columns per program of the residual add (on a GPU; the interpreter: 64)


def residual_add(x: torch.Tensor, r: torch.Tensor, out: torch.Tensor, lc: LaunchConfig) -> None:
    """``out = x + r`` (B, N) in float32, stored in ``out``'s dtype: the residual add after a row-parallel
    projection's partials ``r`` were summed over the TP ranks. ``x`` is read before the PDL wait."""
    b, n, dev = x.shape[0], x.shape[1], x.device
    block = min(RESIDUAL_ADD_BLOCK if dev.type != "cpu" else 64, next_pow2(n))
    K.residual_add_kernel[(b, triton.cdiv(n, block))](x, r, out, N=n, BLOCK_N=block, USE_PDL=lc.use_pdl,
                                                       **_kw(dev, lc))


def norm_gate_up(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, act: torch.Tensor, eps: float, lc: LaunchConfig,
                 scale: torch.Tensor | None = None, prefetch: torch.Tensor | None = None) -> None:
    """``act = silu(g) * u`` with ``[g, u] = rmsnorm(x) @ w.T`` for x (B, hidden), w (2I, hidden) (FP8 ``w``:
    ``scale`` (2I,) its rows' scales)."""
    b, dev = x.shape[0], x.device
    cfg = lc.gemv_config("gate_up", b)
    s_arg = w if scale is None else scale
    inter, h = w.shape[0] // 2, w.shape[1]
    grid, loop = _grid(triton.cdiv(inter, cfg.block_n), cfg.programs)
    common = dict(H=h, INTER=inter, BLOCK_N=cfg.block_n, LOOP=loop, BLOCK_K=min(cfg.block_k, next_pow2(h)), USE_PDL=lc.use_pdl,
                  PDL_EARLY=lc.pdl_early(grid[0]), **_kw(dev, lc, cfg=cfg))
    if cfg.row_wise:
        GV.norm_gate_up_rows_kernel[grid](x, norm_w, w, s_arg, act, b, eps, BLOCK_M=next_pow2(b),
                                          HAS_SCALE=scale is not None, W_VEC=cfg.vec, ACC2D=cfg.acc2d and b == 1,
                                          **_prefetch_kw(prefetch, lc, cfg), **common)
        return
    if cfg.multi_row:
        MR.mrow_gate_up_kernel[grid](x, norm_w, w, s_arg, act, eps, B=b, BLOCK_M=mrow_block_m(b, dev, cfg), MMA=cfg.mma_for(scale is not None),
                                     DOT_F32=dev.type == "cpu" or x.dtype == torch.float32, HAS_SCALE=scale is not None,
                                     **common)
        return
    K.norm_gate_up_kernel[grid](x, norm_w, w, s_arg, act, b, eps, BLOCK_M=block_m(b, dev), HAS_SCALE=scale is not None,
                                DOT_F32=dev.type == "cpu" or x.dtype == torch.float32, **common)
