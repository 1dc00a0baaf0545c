"""A built decoder-layer stack over Triton kernels: weights checked, workspaces allocated once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from lowlat.build import BuildContext
from lowlat.errors import ShapeError, Unsupported
from lowlat.kernels import ops
from lowlat.layer import FP8_DTYPE, ForwardMeta, KVCache
from lowlat.spec import Step, StepKind
from lowlat.tp import Reducer, context_reducer


def covers_rows(step: Step, ctx: BuildContext, lc: ops.LaunchConfig) -> bool:
    """Decode steps, and verify steps (rows of a request as decode rows at their own positions, at most
    ``ops.MAX_VERIFY_ROWS`` per request), of up to the agreed number of rows; with
    ``LowlatConfig.measured_coverage`` only up to the largest batch the plugin measured faster than the generic
    path at (``LaunchConfig.wins_up_to``, for verify rows ``verify_wins_up_to`` where measured); with
    ``LowlatConfig.measured_only`` none where nothing was measured (``wins_up_to`` 0: no entry). Pure."""
    if unmeasured(ctx, lc):
        return False  # no measurement on this GPU and shape: the generic path keeps every step
    limit = lc.wins_up_to if ctx.config.measured_coverage else 0
    if step.kind == StepKind.VERIFY:
        if step.max_query_len > ops.MAX_VERIFY_ROWS:
            return False
        if ctx.config.measured_coverage and lc.verify_wins_up_to is not None:
            if lc.verify_wins_up_to == 0:
                return False  # measured slower than the generic verify step at every size
            limit = lc.verify_wins_up_to
    elif step.kind != StepKind.DECODE:
        return False
    return step.num_tokens <= ctx.max_batch_size and (limit == 0 or step.num_tokens <= limit)


def unmeasured(ctx: BuildContext, lc: ops.LaunchConfig) -> bool:
    """Whether ``LowlatConfig.measured_only`` is set and this GPU and layer shape have no measured table
    (``LaunchConfig.wins_up_to`` 0): the plugin refuses to build and would take no step. Pure."""
    return ctx.config.measured_only and lc.wins_up_to == 0


def unmeasured_errors(ctx: BuildContext, lc: ops.LaunchConfig) -> tuple[str, ...]:
    """Why a plugin refuses to build under ``LowlatConfig.measured_only`` (``unmeasured``): it would take no step;
    empty otherwise. Pure."""
    if unmeasured(ctx, lc):
        table = ""
        if ctx.moe is not None:
            table = " (FP8 MoE: tuning.FP8_MOE_WINS_UP_TO)" if lc.fp8 else " (MoE: tuning.MOE_WINS_UP_TO)"
        return (f"no measured table for this GPU and layer shape{table} (lowlat.kernels.tuning) and "
                "LowlatConfig.measured_only is set: the generic path keeps every step",)
    return ()


def check_layer(name: str, ctx: BuildContext, i: int, validate: Callable[[], None], layer_fp8: bool, fp8: bool,
                projections: Sequence[torch.Tensor]) -> None:
    """Raises ``Unsupported`` (plugin ``name``) when layer ``i`` fails ``validate`` (its ``validate`` with the
    shapes bound), holds FP8 weights where the stack's others do not or the reverse (``layer_fp8`` against ``fp8``),
    or one of its ``projections`` is not a contiguous tensor of the stack's weight dtype (FP8, else the model dtype)
    on ``ctx.device``. Pure."""
    try:
        validate()
    except ShapeError as exc:
        raise Unsupported(name, (f"layer {i}: {exc}",)) from exc
    if layer_fp8 != fp8:
        raise Unsupported(name, (f"layer {i}: FP8 weights in some layers only (every layer or none)",))
    want = FP8_DTYPE if fp8 else ctx.dtype
    for t in projections:
        if t.device.type != ctx.device.type or t.dtype != want or not t.is_contiguous():
            raise Unsupported(name, (f"layer {i}: weights must be contiguous {want} on {ctx.device}",))


def fp8_weights(ctx: BuildContext) -> bool:
    """Whether the context's layers (dense, or MoE with ``ctx.moe``) hold FP8 weights (the first layer decides; the
    stack checks the rest). Pure."""
    layers = ctx.moe_weights if ctx.moe is not None else ctx.weights
    return bool(layers) and layers[0].fp8


def tp_reducer(name: str, ctx: BuildContext, supports_tp: bool) -> Reducer | None:
    """The reducer of a sharded build (None at TP 1); raises ``Unsupported`` with the reason when the stack does not
    run sharded, has no way to sum over the ranks, or the reducer spans another number of ranks. Pure."""
    tp = ctx.tp_size
    if tp == 1:
        return None
    if not supports_tp:
        raise Unsupported(name, (f"TP {tp}: this stack's kernels run unsharded layers only",))
    reducer = context_reducer(ctx.reducer, ctx.all_reduce, tp)
    if reducer is None:
        raise Unsupported(name, (f"TP {tp} needs BuildContext.all_reduce or reducer to sum the row-parallel "
                                 "projections' partial outputs",))
    if reducer.world_size != tp:
        raise Unsupported(name, (f"the reducer spans {reducer.world_size} ranks, the set-up TP {tp}",))
    return reducer


FP8_MIN_CAPABILITY = (8, 9)  # e4m3 conversions (cvt ... e4m3x2): Ada and Hopper or newer


def fp8_capability_errors(ctx: BuildContext) -> tuple[str, ...]:
    """Why this CUDA device cannot run FP8 weights or an FP8 KV cache (compute capability below 8.9), if it is
    asked to. Pure."""
    cap = ctx.setup.capability
    wants = fp8_weights(ctx) or ctx.kv_dtype == FP8_DTYPE
    if not wants or ctx.device.type != "cuda" or cap is None or cap >= FP8_MIN_CAPABILITY:
        return ()
    return (f"FP8 weights or KV cache need compute capability >= 8.9, the device has {cap[0]}.{cap[1]}",)


class TritonLayerStack:
    """``Built`` for Llama-style decode with the per-stage kernels (``lowlat.kernels.layer``).

    Owns every intermediate buffer, sized for the agreed coverage at build time; ``forward``
    allocates nothing and never syncs the host. Subclasses override ``_attention_and_mlp`` to
    fuse differently (the ``amd`` persistent mode) and may set ``qkv_programs`` (the qkv launch's grid).

    FP8: with ``supports_fp8`` the stack takes FP8 (e4m3) weights with per-row scales (``LayerWeights.fp8``: every
    layer or none; ``lc.fp8`` must say so) and an FP8 KV cache (``BuildContext.kv_dtype``); without it, refuses both.

    Tensor parallelism: with ``supports_tp`` the stack runs this rank's shards (``BuildContext``, ``lowlat.tp``):
    o_proj and down write their partial outputs (no residual), the reducer sums them over the ranks, and one
    launch adds the residual (the next RMSNorm stays fused into the next GEMV's prologue, as at TP 1). A reducer
    with ``fused`` set takes the whole row-parallel step instead (``row_parallel``: the later GPU step).
    """

    qkv_programs: int | None = None  # None: one program per qkv tile (the tuned config's grid)
    supports_fp8 = False
    supports_tp = False

    def __init__(self, name: str, ctx: BuildContext, lc: ops.LaunchConfig) -> None:
        s = ctx.shape
        try:
            ops.check_head_dim(s)
        except ShapeError as exc:
            raise Unsupported(name, (str(exc),)) from exc
        if lc.qkv_block_errors(s):
            raise Unsupported(name, lc.qkv_block_errors(s))
        self.reducer = tp_reducer(name, ctx, self.supports_tp)
        fp8 = fp8_weights(ctx)
        if (fp8 or ctx.kv_dtype == FP8_DTYPE) and not self.supports_fp8:
            raise Unsupported(name, ("FP8 weights or KV cache: this plugin's kernels read model-dtype weights and KV",))
        if fp8_capability_errors(ctx):
            raise Unsupported(name, fp8_capability_errors(ctx))
        if fp8 != lc.fp8:
            raise Unsupported(name, (f"LaunchConfig.fp8={lc.fp8} but the weights are {'' if fp8 else 'not '}FP8",))
        for i, w in enumerate(ctx.weights):
            check_layer(name, ctx, i, partial(w.validate, s), w.fp8, fp8, (w.qkv, w.o_proj, w.gate_up, w.down))
        self.name = name
        self.ctx = ctx
        self.shape = s
        self.lc = lc
        self.weights = ctx.weights
        m, dev, dt = ctx.max_batch_size, ctx.device, ctx.dtype
        self.max_splits = ctx.config.max_attn_splits
        f32 = torch.float32
        self.q = torch.empty(m, s.q_size, device=dev, dtype=dt)
        self.part_o = torch.empty(m, s.num_heads, self.max_splits, s.head_dim, device=dev, dtype=f32)
        self.part_lse = torch.empty(m, s.num_heads, self.max_splits, device=dev, dtype=f32)
        self.attn = torch.empty(m, s.q_size, device=dev, dtype=dt)
        self.x1 = torch.empty(m, s.hidden_size, device=dev, dtype=dt)
        self.act = torch.empty(m, s.intermediate_size, device=dev, dtype=dt)
        self.out = torch.empty(2, m, s.hidden_size, device=dev, dtype=dt)
        # the split-KV attention's counters (one per row and KV head; every launch leaves them zero again)
        self.attn_counts = torch.zeros(m * s.num_kv_heads, device=dev, dtype=torch.int32)
        self._buffers = [self.q, self.part_o, self.part_lse, self.attn, self.x1, self.act, self.out, self.attn_counts]
        # split-K o_proj / down (GemvConfig.split_k in the tuned table): float32 partials and a counter per output tile
        # (every launch leaves them zero again), shared by both stages (one launch's partials are read before the next
        # such launch passes its PDL wait)
        self.split_ws: tuple[torch.Tensor, torch.Tensor] | None = None
        splits = [(cfg.split_k, cfg.block_n) for stage, _, cfg in lc.tuned if stage in ("o_proj", "down") and cfg.split_k > 1]
        if splits:
            self.split_ws = (torch.empty(max(k for k, _ in splits) * m * s.hidden_size, device=dev, dtype=f32),
                             torch.zeros(-(-s.hidden_size // min(n for _, n in splits)), device=dev, dtype=torch.int32))
            self._buffers.extend(self.split_ws)
        if self.reducer is not None:  # the row-parallel partials, summed over the ranks in place
            self.partial = torch.empty(m, s.hidden_size, device=dev, dtype=dt)
            self._buffers.append(self.partial)

    @property
    def workspace_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers)

    @property
    def verify_launch_differs(self) -> bool:
        """``Built``'s optional flag: verify rows launch otherwise than decode rows (``LaunchConfig.verify_attn_warps``)."""
        return self.lc.verify_launch_differs

    def covers(self, step: Step) -> bool:
        return covers_rows(step, self.ctx, self.lc)

    def forward(self, layer: int, x: torch.Tensor, kv: KVCache, meta: ForwardMeta) -> torch.Tensor:
        """Decoder layer ``layer`` for one decode token per request; mutates ``kv`` and workspaces."""
        b = x.shape[0]
        if b > self.ctx.max_batch_size or meta.extend_lens is not None:
            raise ShapeError(f"{self.name}: decode batch of at most {self.ctx.max_batch_size} expected, got {b}")
        w = self.weights[layer]
        ops.qkv_rope(x, w, kv, meta, self.q[:b], self.shape, self.lc, grid_programs=self.qkv_programs,
                     prefetch=w.o_proj)
        out = self.out[layer % 2, :b]
        self._attention_and_mlp(layer, x, kv, meta, out)
        return out

    def _splits(self, b: int, meta: ForwardMeta) -> int:
        max_len = meta.max_seq_len or meta.req_to_token.shape[1]
        return ops.num_splits(b, self.shape, max_len, self.lc, self.max_splits)

    def _attention_and_mlp(self, layer: int, x: torch.Tensor, kv: KVCache, meta: ForwardMeta, out: torch.Tensor) -> None:
        b, w, lc = x.shape[0], self.weights[layer], self.lc
        if lc.uses_rows_attention(b):  # each request's K/V read once for all of its rows (verify steps)
            if lc.rows_wide_splits:  # a larger grid; the counters (unused without fused_merge) hold the used splits
                max_len = meta.max_seq_len or meta.req_to_token.shape[1]
                splits = ops.rows_splits(b, self.shape, max_len, lc, min(lc.rows_wide_splits, self.max_splits), x.device)
                ops.rows_attention(self.q[:b], kv, meta, self.part_o, self.part_lse, self.attn[:b], self.shape, lc,
                                   splits, used=self.attn_counts)
            else:
                ops.rows_attention(self.q[:b], kv, meta, self.part_o, self.part_lse, self.attn[:b], self.shape, lc,
                                   self._splits(b, meta))
        else:
            ops.attention(self.q[:b], kv, meta, self.part_o, self.part_lse, self.attn[:b], self.shape, lc,
                          self._splits(b, meta), counts=self.attn_counts if lc.fused_merge else None)
        # the L2 prefetch of each stage's successor (LaunchConfig.l2_prefetch; the last layer's down: none)
        nxt = self.weights[layer + 1].qkv if layer + 1 < len(self.weights) else None
        self.row_parallel(self.attn[:b], w.o_proj, w.o_proj_scale, x, self.x1[:b], "o_proj", prefetch=w.gate_up)
        ops.norm_gate_up(self.x1[:b], w.post_norm, w.gate_up, self.act[:b], self.shape.rms_eps, lc, scale=w.gate_up_scale,
                         prefetch=w.down)
        self.row_parallel(self.act[:b], w.down, w.down_scale, self.x1[:b], out, "down", prefetch=nxt)

    def row_parallel(self, a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, res: torch.Tensor,
                     out: torch.Tensor, stage: str, prefetch: torch.Tensor | None = None) -> None:
        """``out = res + sum over the TP ranks of a @ w.T`` (o_proj, down; FP8 ``w``: ``scale`` its rows' scales); at
        TP 1 one GEMV with the residual in its epilogue."""
        if self.reducer is None:
            ops.gemv_residual(a, w, res, out, self.lc, stage=stage, scale=scale, prefetch=prefetch, split_ws=self.split_ws)
            return
        if getattr(self.reducer, "fused", False):  # the reducer owns the projection (epilogue-launched reduction)
            self.reducer.row_parallel(a, w, scale, res, out, stage, self.lc)  # type: ignore[attr-defined]
            return
        part = self.partial[: a.shape[0]]
        ops.gemv_residual(a, w, None, part, self.lc, stage=stage, scale=scale, split_ws=self.split_ws)
        self.reducer.all_reduce(part)
        ops.residual_add(res, part, out, self.lc)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Compile and run every kernel per batch size on a scratch KV cache of its own."""
        s, dev = self.shape, self.ctx.device
        for b in batch_sizes:
            slots = 2 * b
            kv = KVCache(
                torch.zeros(slots, s.num_kv_heads, s.head_dim, device=dev, dtype=self.ctx.kv_dtype),
                torch.zeros(slots, s.num_kv_heads, s.head_dim, device=dev, dtype=self.ctx.kv_dtype),
            )
            ar = torch.arange(b, device=dev)
            table = torch.stack([2 * ar, 2 * ar + 1], dim=1).to(torch.int32)
            meta = ForwardMeta(table, ar, torch.full((b,), 2, dtype=torch.int32, device=dev), torch.ones(b, dtype=torch.int64, device=dev),
                               2 * ar + 1, max_seq_len=2)
            x = torch.zeros(b, s.hidden_size, device=dev, dtype=self.ctx.dtype)
            self.forward(0, x, kv, meta)
