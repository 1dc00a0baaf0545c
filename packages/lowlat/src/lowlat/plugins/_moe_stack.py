"""A built MoE decoder-layer stack: the dense stack's attention kernels + the MoE kernels."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from lowlat.build import BuildContext
from lowlat.errors import ShapeError, Unsupported
from lowlat.kernels import moe_ops, ops
from lowlat.layer import ForwardMeta, KVCache
from lowlat.plugins._stack import check_layer, covers_rows, fp8_capability_errors, fp8_weights, tp_reducer
from lowlat.spec import Step


class TritonMoEStack:
    """``Built`` for Mixtral-style decode: norm+QKV+RoPE+KV write, split-KV attention, o_proj +
    residual, then route -> expert gate-up -> expert down -> combine (``lowlat.kernels.moe``).

    Owns every intermediate buffer, sized for the agreed coverage at build; ``forward`` allocates
    nothing and never syncs the host. Tensor parallelism: this rank's shards (``lowlat.tp.shard_moe_layer``: each
    expert's intermediate features split); o_proj's partial and the MoE output (combined without the residual)
    are summed by the reducer, then the residual is added (``TritonLayerStack.row_parallel``'s order).

    FP8 (``MoELayerWeights.fp8``, every layer or none; ``lc.fp8`` must say so): qkv and o_proj run the dense stack's
    FP8 kernels (``LaunchConfig``'s FP8 table), the experts the weight-stationary FP8 kernels
    (``lowlat.kernels.moe``); the router and the workspaces stay in the model dtype.
    """

    def __init__(self, name: str, ctx: BuildContext, lc: ops.LaunchConfig) -> None:
        s, moe = ctx.shape, ctx.moe
        if moe is None:
            raise Unsupported(name, ("TritonMoEStack needs BuildContext.moe",))
        try:
            ops.check_head_dim(s)
        except ShapeError as exc:
            raise Unsupported(name, (str(exc),)) from exc
        if lc.qkv_block_errors(s):
            raise Unsupported(name, lc.qkv_block_errors(s))
        if fp8_capability_errors(ctx):
            raise Unsupported(name, fp8_capability_errors(ctx))
        if ctx.max_batch_size > moe_ops.MAX_TOKENS:
            raise Unsupported(name, (f"MoE kernels place at most {moe_ops.MAX_TOKENS} tokens per step, coverage asks "
                                     f"{ctx.max_batch_size}",))
        self.reducer = tp_reducer(name, ctx, supports_tp=True)
        fp8 = fp8_weights(ctx)
        if fp8 != lc.fp8:
            raise Unsupported(name, (f"LaunchConfig.fp8={lc.fp8} but the weights are {'' if fp8 else 'not '}FP8",))
        for i, w in enumerate(ctx.moe_weights):
            check_layer(name, ctx, i, partial(w.validate, s, moe), w.fp8, fp8, (w.qkv, w.o_proj, w.w13, w.w2))
            if w.router.device.type != ctx.device.type or w.router.dtype != ctx.dtype or not w.router.is_contiguous():
                raise Unsupported(name, (f"layer {i}: the router must be contiguous {ctx.dtype} on {ctx.device}",))
            scales = [t for t in (w.qkv_scale, w.o_proj_scale, w.w13_scale, w.w2_scale) if t is not None]
            if any(t.device.type != ctx.device.type or not t.is_contiguous() for t in scales):
                raise Unsupported(name, (f"layer {i}: FP8 scales must be contiguous on {ctx.device}",))
        if any(cfg.split_k > 1 for stage, _, cfg in lc.tuned if stage == "o_proj"):
            raise Unsupported(name, ("a split-K o_proj entry needs a split workspace the MoE stack does not allocate",))
        self.name = name
        self.ctx = ctx
        self.shape = s
        self.moe = moe
        self.lc = lc
        self.weights = ctx.moe_weights
        m, dev, dt = ctx.max_batch_size, ctx.device, ctx.dtype
        self.max_splits = ctx.config.max_attn_splits
        f32 = torch.float32
        self.q = torch.empty(m, s.q_size, device=dev, dtype=dt)
        self.part_o = torch.empty(m, s.num_heads, self.max_splits, s.head_dim, device=dev, dtype=f32)
        self.part_lse = torch.empty(m, s.num_heads, self.max_splits, device=dev, dtype=f32)
        self.attn = torch.empty(m, s.q_size, device=dev, dtype=dt)
        self.x1 = torch.empty(m, s.hidden_size, device=dev, dtype=dt)
        self.out = torch.empty(2, m, s.hidden_size, device=dev, dtype=dt)
        self.ws = moe_ops.MoEWorkspace.allocate(moe, s.hidden_size, m, dev, dt, fp8=fp8)
        self._buffers = [self.q, self.part_o, self.part_lse, self.attn, self.x1, self.out]
        if self.reducer is not None:  # partials summed over the ranks in place; zeros: the combine's residual
            self.partial = torch.empty(m, s.hidden_size, device=dev, dtype=dt)
            self.zeros = torch.zeros(m, s.hidden_size, device=dev, dtype=dt)
            self._buffers += [self.partial, self.zeros]

    @property
    def workspace_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers) + self.ws.nbytes

    @property
    def verify_launch_differs(self) -> bool:
        """``Built``'s optional flag: verify rows launch otherwise than decode rows (``LaunchConfig.verify_attn_warps``)."""
        return self.lc.verify_launch_differs

    def covers(self, step: Step) -> bool:
        return covers_rows(step, self.ctx, self.lc)

    def forward(self, layer: int, x: torch.Tensor, kv: KVCache, meta: ForwardMeta) -> torch.Tensor:
        """MoE decoder layer ``layer`` for one decode token per request; mutates ``kv`` and workspaces."""
        b, lc, s = x.shape[0], self.lc, self.shape
        if b > self.ctx.max_batch_size or meta.extend_lens is not None:
            raise ShapeError(f"{self.name}: decode batch of at most {self.ctx.max_batch_size} expected, got {b}")
        w = self.weights[layer]
        ops.qkv_rope(x, w, kv, meta, self.q[:b], s, lc)
        max_len = meta.max_seq_len or meta.req_to_token.shape[1]
        splits = ops.num_splits(b, s, max_len, lc, self.max_splits)
        ops.attention(self.q[:b], kv, meta, self.part_o, self.part_lse, self.attn[:b], s, lc, splits)
        out = self.out[layer % 2, :b]
        if self.reducer is None:
            ops.gemv_residual(self.attn[:b], w.o_proj, x, self.x1[:b], lc, scale=w.o_proj_scale)
            moe_ops.moe_mlp(self.x1[:b], w.post_norm, w.router, w.w13, w.w2, out, self.moe, s.rms_eps, self.ws, lc,
                            w13_scale=w.w13_scale, w2_scale=w.w2_scale)
            return out
        part = self.partial[:b]
        ops.gemv_residual(self.attn[:b], w.o_proj, None, part, lc, scale=w.o_proj_scale)
        self.reducer.all_reduce(part)
        ops.residual_add(x, part, self.x1[:b], lc)
        moe_ops.moe_mlp(self.x1[:b], w.post_norm, w.router, w.w13, w.w2, part, self.moe, s.rms_eps, self.ws, lc,
                        residual=self.zeros[:b], w13_scale=w.w13_scale, w2_scale=w.w2_scale)
        self.reducer.all_reduce(part)
        ops.residual_add(self.x1[:b], part, out, lc)
        return out

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Compile and run every kernel per batch size on a scratch KV cache of its own."""
        s, dev = self.shape, self.ctx.device
        for b in batch_sizes:
            kv = KVCache(
                torch.zeros(2 * b, s.num_kv_heads, s.head_dim, device=dev, dtype=self.ctx.kv_dtype),
                torch.zeros(2 * b, s.num_kv_heads, s.head_dim, device=dev, dtype=self.ctx.kv_dtype),
            )
            ar = torch.arange(b, device=dev)
            table = torch.stack([2 * ar, 2 * ar + 1], dim=1).to(torch.int32)
            meta = ForwardMeta(table, ar, torch.full((b,), 2, dtype=torch.int32, device=dev),
                               torch.ones(b, dtype=torch.int64, device=dev), 2 * ar + 1, max_seq_len=2)
            self.forward(0, torch.zeros(b, s.hidden_size, device=dev, dtype=self.ctx.dtype), kv, meta)
