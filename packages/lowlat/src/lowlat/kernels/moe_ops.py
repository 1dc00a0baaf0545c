"""Host launchers of the MoE kernels (``lowlat.kernels.moe``): block sizes and grids."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from lowlat.errors import ShapeError
from lowlat.kernels import moe as K
from lowlat.kernels._jit import next_pow2
from lowlat.kernels.ops import GemvConfig, LaunchConfig, _kw, block_m
from lowlat.layer import FP8_DTYPE
from lowlat.moe import MoEShape

ROWS_PER_TILE = 8
MAX_TOKENS = 31  # one int32 bitmap per expert
# Expert kernels' tiles on a GPU (16-row dot tiles, pipelined K loop). H200, Mixtral-8x7B layer, tokens 1-8: the best
# of 36 tiles in lmserver's fused-MoE sweep of the same 16-row expert GEMM (benchmarks/kernels/bench_moe.py).
EXPERT_GATE_UP = GemvConfig("dot", block_n=32, block_k=256, num_warps=4, num_stages=4)
EXPERT_DOWN = GemvConfig("dot", block_n=64, block_k=256, num_warps=4, num_stages=4)
# FP8 (e4m3) experts: at one token the row-wise slot kernels, above it the weight-stationary kernels
# (``expert_gate_up_ws_kernel`` / ``expert_down_ws_kernel``) in fp16 with the rows scaled (``mrow_f16s``), on the tiles the dense FP8 stack measured
# best at 2-8 rows on the H200 for the same matrices (tuning.FP8_TABLES, 8B shape: gate-up
# 2 x 14336 x 4096 64 x 256, down 4096 x 14336 32 x 512; an expert's w13 / w2 have those shapes at Mixtral-8x7B's). A
# config of any multi-row variant runs the weight-stationary kernels (model-dtype weights too), a ``rows`` config the
# row-wise slot kernels (one program per token and choice: meant for one token), a ``dot`` config
# the kernels above. (max tokens, gate-up config, down config): the first entry whose max tokens is >= the step's wins.
# H200, an 8-layer Mixtral-8x7B stack (bench_moe_stack.py --rows-at-one, RESULTS.md issue 33, 2026-12-03): at one
# token the row-wise slot kernels (4 x 2048, 16-byte FP8 loads for gate-up, as the dense FP8 table's one-row
# entries) take 134.4 us per layer against 176.1 on the mrow_f16s tiles (bf16 stack: 219.7); 8 tokens on mrow_f16s:
# 366.6 (bf16 630.1).
EXPERT_TILES_FP8: tuple[tuple[int, GemvConfig, GemvConfig], ...] = (
    (1, GemvConfig("rows", block_n=4, block_k=2048, num_warps=4, num_stages=2, vec=16),
     GemvConfig("rows", block_n=4, block_k=2048, num_warps=4, num_stages=2)),
    (MAX_TOKENS, GemvConfig("mrow_f16s", block_n=64, block_k=256, num_warps=4, num_stages=3),
     GemvConfig("mrow_f16s", block_n=32, block_k=512, num_warps=4, num_stages=3)),
)
# FP8 experts on mrow_f16s tiles (both stages): the token rows scaled by 2^-4 and cast to fp16 once (the router writes
# the normed rows so, the gate-up epilogue its activations; ``MoEWorkspace.hn16`` / ``act16``) and an fp16 MMA on them
# (the sums times 16), instead of the multiply and cast of every activation in every K step (mrow_f16s: per warp, the
# operand replicated; on the dense 8B down stage at 8 rows mrow_f16s took 24.91 us against mrow_f16's 22.72). Not
# measured on the experts: off until bench_moe_stack.py --rows-f16 says otherwise.
EXPERT_ROWS_F16 = False
# Whether the expert kernels read their first weight block before waiting on the router (PDL overlap, but every
# expert's programs read it, routed or not: 1/16 of the unrouted experts' gate-up weights at block_k 256).
EXPERT_PREFETCH = False
# The router's columns per program of ``route_split_kernel`` (0: ``route_kernel``, one program over the whole row).
# H200, 8-layer Mixtral-8x7B stack at one token (bench_moe_stack.py --route-chunks 256,512,128,256:256, RESULTS.md
# issue 33, 2026-12-04): the one-program router took 20.7-20.9 us per layer (15% of the FP8 MoE layer), the split one
# 6.0 at 256 columns per program and 256-column RMS slices (8.0-9.8 at the others); the FP8 stack 136.4 -> 120.9 us
# per layer, bf16 219.4 -> 208.0.
ROUTE_CHUNK = 256
ROUTE_SS_K = 256  # the RMS's columns per unrolled slice in route_split_kernel


MIN_ROUTE_CHUNK = 16  # the smallest ROUTE_CHUNK a workspace has partials for


def route_block_e(num_experts: int, dev: torch.device) -> int:
    """The router's padded expert count (at least 16 on a GPU: a dot's N). Pure."""
    return max(next_pow2(num_experts), 1 if dev.type == "cpu" else 16)


@dataclass
class MoEWorkspace:
    """Buffers of one MoE MLP step, allocated once for ``max_tokens`` (see ``MoEWorkspace.allocate``)."""

    hn: torch.Tensor  # (max_tokens, hidden) normed stream, the model dtype (FP8 experts too)
    ids: torch.Tensor  # (max_tokens, top_k) int32 expert of each choice
    wts: torch.Tensor  # (max_tokens, top_k) float32 renormalized routing weights
    bitmap: torch.Tensor  # (num_experts,) int32: bit t set when token t chose the expert
    act: torch.Tensor  # (num_experts, max_tokens, expert_inter) the model dtype, rows by popcount placement
    y: torch.Tensor  # (num_experts, max_tokens, hidden) float32 expert outputs, same rows
    # ``route_split_kernel``: (splits * max_tokens * block_e,) float32 partial router logits, and its int32 counter
    # (zero between launches)
    route_parts: torch.Tensor
    route_count: torch.Tensor
    # FP8 experts (``allocate(..., fp8=True)``): hn and act times 2^-4 in fp16, for ``EXPERT_ROWS_F16``
    hn16: torch.Tensor | None = None  # (max_tokens, hidden) float16
    act16: torch.Tensor | None = None  # (num_experts, max_tokens, expert_inter) float16

    @classmethod
    def allocate(cls, moe: MoEShape, hidden: int, max_tokens: int, device: torch.device, dtype: torch.dtype,
                 fp8: bool = False) -> MoEWorkspace:
        if max_tokens > MAX_TOKENS:
            raise ShapeError(f"the MoE kernels place at most {MAX_TOKENS} tokens per step (int32 bitmap), got {max_tokens}")
        e, i, k = moe.num_experts, moe.expert_intermediate_size, moe.top_k
        f16 = torch.float16
        return cls(
            hn=torch.empty(max_tokens, hidden, device=device, dtype=dtype),
            ids=torch.empty(max_tokens, k, device=device, dtype=torch.int32),
            wts=torch.empty(max_tokens, k, device=device, dtype=torch.float32),
            bitmap=torch.empty(e, device=device, dtype=torch.int32),
            act=torch.empty(e, max_tokens, i, device=device, dtype=dtype),
            y=torch.empty(e, max_tokens, hidden, device=device, dtype=torch.float32),
            route_parts=torch.empty(triton.cdiv(hidden, MIN_ROUTE_CHUNK) * max_tokens * route_block_e(e, device),
                                    device=device, dtype=torch.float32),
            route_count=torch.zeros(1, device=device, dtype=torch.int32),
            hn16=torch.empty(max_tokens, hidden, device=device, dtype=f16) if fp8 else None,
            act16=torch.empty(e, max_tokens, i, device=device, dtype=f16) if fp8 else None,
        )

    @property
    def max_tokens(self) -> int:
        return int(self.hn.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hn, self.ids, self.wts, self.bitmap, self.act, self.y,
                                                          self.route_parts, self.route_count, self.hn16,
                                                          self.act16) if t is not None)


def moe_mlp(
    x1: torch.Tensor,  # (B, hidden): residual stream after attention
    norm_w: torch.Tensor,  # (hidden,)
    router: torch.Tensor,  # (E, hidden)
    w13: torch.Tensor,  # (E, 2 * inter, hidden)
    w2: torch.Tensor,  # (E, hidden, inter)
    out: torch.Tensor,  # (B, hidden)
    moe: MoEShape,
    eps: float,
    ws: MoEWorkspace,
    lc: LaunchConfig,
    residual: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,  # (E, 2 * inter) float32: FP8 w13's row scales
    w2_scale: torch.Tensor | None = None,  # (E, hidden) float32: FP8 w2's row scales
    up_cfg: GemvConfig | None = None,
    down_cfg: GemvConfig | None = None,
) -> None:
    """``out = x1 + MoE(rmsnorm(x1))``: route, expert gate-up, expert down, combine. Mutates ``out`` and ``ws``.
    ``residual``: added instead of ``x1`` (zeros: the MoE output alone, a rank's partial under TP). FP8 (e4m3)
    ``w13`` / ``w2``: ``w13_scale`` / ``w2_scale`` their per-row scales (the router stays in the model dtype).
    ``up_cfg`` / ``down_cfg``: the expert kernels' tiles (default: ``expert_configs``; benchmarks sweep them)."""
    b, h, dev = x1.shape[0], x1.shape[1], x1.device
    if b > ws.max_tokens:
        raise ShapeError(f"MoE step of {b} tokens exceeds the workspace's {ws.max_tokens}")
    fp8 = w13.dtype == FP8_DTYPE
    if (w13_scale is not None, w2.dtype == FP8_DTYPE, w2_scale is not None) != (fp8, fp8, fp8):
        raise ShapeError("FP8 experts need w13 and w2 in float8_e4m3fn, each with its per-row scales (or none of them)")
    e, i, k = moe.num_experts, moe.expert_intermediate_size, moe.top_k
    f32 = dev.type == "cpu" or x1.dtype == torch.float32
    up, down = expert_configs(dev, lc, fp8, b)
    up, down = up_cfg or up, down_cfg or down
    rows16 = rows_f16(fp8, up, down, ws)
    hn16 = dict(hn16_ptr=ws.hn16, HN16=True) if rows16 else {}
    chunk = ROUTE_CHUNK
    if chunk:
        if chunk < MIN_ROUTE_CHUNK or chunk & (chunk - 1):
            raise ShapeError(f"ROUTE_CHUNK must be a power of two >= {MIN_ROUTE_CHUNK}, got {chunk}")
        splits = triton.cdiv(h, chunk)
        K.route_split_kernel[(splits,)](
            x1, norm_w, router, ws.hn, ws.ids, ws.wts, ws.bitmap, ws.route_parts, ws.route_count, b, eps,
            H=h, E=e, TOP_K=k, MAX_T=ws.max_tokens, BLOCK_M=block_m(b, dev), BLOCK_E=route_block_e(e, dev),
            CHUNK=chunk, SS_K=min(ROUTE_SS_K, next_pow2(h)), BLOCK_S=next_pow2(splits), DOT_F32=f32,
            USE_PDL=lc.use_pdl, **hn16, **_kw(dev, lc),
        )
    else:
        K.route_kernel[(1,)](
            x1, norm_w, router, ws.hn, ws.ids, ws.wts, ws.bitmap, b, eps,
            H=h, E=e, TOP_K=k, BLOCK_M=block_m(b, dev), BLOCK_E=route_block_e(e, dev),
            BLOCK_K=min(lc.gemv_block_k, next_pow2(h)), DOT_F32=f32, USE_PDL=lc.use_pdl, **hn16, **_kw(dev, lc),
        )
    row_tiles = triton.cdiv(b, ROWS_PER_TILE)
    block_r = ROWS_PER_TILE if dev.type == "cpu" else 16  # tl.dot needs 16 rows on a GPU; rows >= 8 stay masked
    common = dict(MAX_T=ws.max_tokens, H=h, INTER=i, ROWS=ROWS_PER_TILE, BLOCK_R=block_r, BLOCK_T=max(2, next_pow2(b)),
                  DOT_F32=f32, USE_PDL=lc.use_pdl, PREFETCH=EXPERT_PREFETCH)
    up_k, down_k = min(up.block_k, next_pow2(h)), min(down.block_k, next_pow2(i))
    if fp8 and not all(cfg.multi_row or cfg.row_wise for cfg in (up, down)):
        raise ShapeError(f"FP8 experts run the weight-stationary or row-wise kernels (a multi-row or rows config), "
                         f"got {up} / {down}")
    # the weight-stationary kernels: the rows are the MMA's narrow side (8 rows, no padding to 16)
    ws_common = {**{n: v for n, v in common.items() if n != "PREFETCH"}, "BLOCK_R": ROWS_PER_TILE, "HAS_SCALE": fp8}
    # the row-wise slot kernels: one program per (token, choice) and column block
    slot_common = dict(MAX_T=ws.max_tokens, H=h, INTER=i, TOP_K=k, USE_PDL=lc.use_pdl, HAS_SCALE=fp8)
    if up.row_wise:
        slots = (b * k, triton.cdiv(i, up.block_n))
        K.expert_gate_up_slot_kernel[slots](
            ws.hn, w13, w13 if w13_scale is None else w13_scale, ws.ids, ws.bitmap, ws.act, BLOCK_N=up.block_n,
            BLOCK_K=up_k, W_VEC=up.vec, PDL_EARLY=lc.pdl_early(slots[0] * slots[1]), **slot_common,
            **_kw(dev, lc, cfg=up),
        )
    elif up.multi_row:
        grid = (e, triton.cdiv(i, up.block_n), row_tiles)
        K.expert_gate_up_ws_kernel[grid](
            ws.hn16 if rows16 else ws.hn, w13, w13 if w13_scale is None else w13_scale, ws.bitmap,
            ws.act16 if rows16 else ws.act, BLOCK_N=up.block_n, BLOCK_K=up_k, MMA=2 if rows16 else up.mma_kind,
            PDL_EARLY=lc.pdl_early(grid[0] * grid[1] * grid[2]), IN16=rows16, OUT16=rows16, **ws_common,
            **_kw(dev, lc, cfg=up),
        )
    else:
        K.expert_gate_up_kernel[(e, triton.cdiv(i, up.block_n), row_tiles)](
            ws.hn, w13, ws.bitmap, ws.act, BLOCK_N=up.block_n, BLOCK_K=up_k,
            LOOP_START=up_k if EXPERT_PREFETCH else 0, **common, **_kw(dev, lc, cfg=up),
        )
    if down.row_wise:
        slots = (b * k, triton.cdiv(h, down.block_n))
        K.expert_down_slot_kernel[slots](
            ws.act, w2, w2 if w2_scale is None else w2_scale, ws.ids, ws.bitmap, ws.y, BLOCK_N=down.block_n,
            BLOCK_K=down_k, W_VEC=down.vec, PDL_EARLY=lc.pdl_early(slots[0] * slots[1]), **slot_common,
            **_kw(dev, lc, cfg=down),
        )
    elif down.multi_row:
        grid = (e, triton.cdiv(h, down.block_n), row_tiles)
        K.expert_down_ws_kernel[grid](
            ws.act16 if rows16 else ws.act, w2, w2 if w2_scale is None else w2_scale, ws.bitmap, ws.y,
            BLOCK_N=down.block_n, BLOCK_K=down_k, MMA=2 if rows16 else down.mma_kind,
            PDL_EARLY=lc.pdl_early(grid[0] * grid[1] * grid[2]), IN16=rows16, **ws_common, **_kw(dev, lc, cfg=down),
        )
    else:
        K.expert_down_kernel[(e, triton.cdiv(h, down.block_n), row_tiles)](
            ws.act, w2, ws.bitmap, ws.y, BLOCK_N=down.block_n, BLOCK_K=down_k,
            LOOP_START=down_k if EXPERT_PREFETCH else 0, **common, **_kw(dev, lc, cfg=down),
        )
    K.combine_kernel[(b, triton.cdiv(h, lc.gemv_block_n))](
        x1 if residual is None else residual, ws.y, ws.ids, ws.wts, ws.bitmap, out, MAX_T=ws.max_tokens, H=h, TOP_K=k, BLOCK_N=lc.gemv_block_n,
        USE_PDL=lc.use_pdl, **_kw(dev, lc),
    )


def expert_configs(dev: torch.device, lc: LaunchConfig, fp8: bool, tokens: int = 1) -> tuple[GemvConfig, GemvConfig]:
    """The expert gate-up and down kernels' tiles on ``dev`` for a step of ``tokens`` tokens (FP8:
    ``EXPERT_TILES_FP8``). Pure."""
    if dev.type == "cpu":  # the interpreter: small blocks (its dots run in float32 whatever the variant)
        cpu = GemvConfig("mrow" if fp8 else "dot", lc.gemv_block_n, lc.gemv_block_k)
        return cpu, cpu
    if not fp8:
        return EXPERT_GATE_UP, EXPERT_DOWN
    return next(((up, down) for max_tokens, up, down in EXPERT_TILES_FP8 if tokens <= max_tokens),
                EXPERT_TILES_FP8[-1][1:])


def rows_f16(fp8: bool, up: GemvConfig, down: GemvConfig, ws: MoEWorkspace) -> bool:
    """Whether a step runs ``EXPERT_ROWS_F16`` (FP8 experts, both stages on ``mrow_f16s`` tiles, a workspace with the
    fp16 rows). Pure."""
    return (EXPERT_ROWS_F16 and fp8 and up.variant == down.variant == "mrow_f16s" and ws.hn16 is not None
            and ws.act16 is not None)
