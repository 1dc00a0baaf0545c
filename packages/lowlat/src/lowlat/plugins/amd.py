"""The ``amd`` plugin: the decode layer as two persistent launches in portable Triton.

K1 = RMSNorm + QKV + RoPE + KV write (persistent tile loop); K2 = attention -> split merge ->
o_proj + residual -> RMSNorm + gate-up + SiLU -> down + residual in one launch, stages handing
tiles over through tagged counters with bounded spins (``lowlat.kernels.persistent``).
``staged`` mode runs one launch per stage instead (the per-stage kernels, without PDL).

NOTE: written for AMD Instinct GPUs but never run on AMD hardware; it is tested on the CPU under
the Triton interpreter and on an NVIDIA H200 through Triton's NVIDIA backend.
"""

from __future__ import annotations

from typing import Any

import torch

from lowlat.build import BuildContext
from lowlat.errors import KernelError, Unsupported
from lowlat.kernels import ops
from lowlat.kernels._jit import check_device, next_pow2
from lowlat.kernels.ops import GemvConfig
from lowlat.kernels.persistent import attn_mlp_persistent_kernel
from lowlat.kernels.tuning import tuned_persistent
from lowlat.layer import ForwardMeta, KVCache
from lowlat.plugins._stack import TritonLayerStack, unmeasured_errors
from lowlat.plugins.nvidia import ARCHS
from lowlat.plugins.nvidia import check_model as _nvidia_check_model
from lowlat.spec import FP8_WEIGHTS, Coverage, PluginSpec, Requirements


class AmdLayerStack(TritonLayerStack):
    """``Built`` of the ``amd`` plugin; ``mode`` is ``persistent`` or ``staged``."""

    def __init__(self, ctx: BuildContext, lc: ops.LaunchConfig) -> None:
        super().__init__("amd", ctx, lc)
        self.mode = ctx.config.amd_mode
        self.spin_limit = ctx.config.spin_limit
        # K2's tiles and grid: measured per GPU and shape (tuning.PERSISTENT), else the launch config's blocks on a
        # grid of one program per compute unit; every program must be co-resident (a wait spins on the others)
        tuned = None if ctx.device.type == "cpu" else tuned_persistent(torch.cuda.get_device_name(ctx.device), ctx.shape)
        self.k2 = tuned or GemvConfig("dot", lc.gemv_block_n, lc.gemv_block_k, lc.num_warps, lc.num_stages)
        self.programs = 1 if ctx.device.type == "cpu" else (self.k2.programs or lc.num_sms)
        if self.mode == "persistent":
            self.qkv_programs = 1 if ctx.device.type == "cpu" else lc.num_sms
        self.sync = torch.zeros(8, dtype=torch.int32, device=ctx.device)  # epoch, done, 4 stage counters
        self.error = torch.zeros(1, dtype=torch.int32, device=ctx.device)
        self._buffers += [self.sync, self.error]

    def _attention_and_mlp(self, layer: int, x: torch.Tensor, kv: KVCache, meta: ForwardMeta, out: torch.Tensor) -> None:
        # NOTE: reached through TritonLayerStack.forward, which rejects batches beyond the built workspaces
        if self.mode == "staged":
            super()._attention_and_mlp(layer, x, kv, meta, out)
            return
        b, s, w, lc, dev = x.shape[0], self.shape, self.weights[layer], self.lc, x.device
        check_device(dev)
        splits = self._splits(b, meta)
        k2 = self.k2
        kw = {} if dev.type == "cpu" else {"num_warps": k2.num_warps, "num_stages": k2.num_stages}
        attn_mlp_persistent_kernel[(self.programs,)](
            self.q, kv.k, kv.v, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
            self.part_o, self.part_lse, self.attn,
            x, w.o_proj, self.x1, w.post_norm, w.gate_up, self.act, w.down, out,
            self.sync, self.error,
            b, s.rms_eps, s.head_dim**-0.5, self.spin_limit,
            meta.req_to_token.stride(0), kv.k.stride(0), kv.k.stride(1), kv.v.stride(0), kv.v.stride(1),
            H=s.hidden_size, INTER=s.intermediate_size, NQ=s.num_heads, NKV=s.num_kv_heads, D=s.head_dim,
            NUM_SPLITS=splits, BLOCK_S=next_pow2(splits),
            BLOCK_G=next_pow2(s.group_size) if dev.type == "cpu" else max(16, next_pow2(s.group_size)),
            BLOCK_NA=lc.attn_block(b), BLOCK_M=ops.block_m(b, dev), BLOCK_N=k2.block_n,
            BLOCK_K=min(k2.block_k, next_pow2(min(s.hidden_size, s.q_size, s.intermediate_size))),
            DOT_F32=dev.type == "cpu" or x.dtype == torch.float32, **kw,
        )

    def check_errors(self) -> None:
        """Raise ``KernelError`` if a persistent launch gave up waiting (host sync; not in graphs)."""
        code = int(self.error.item())
        if code:
            raise KernelError(
                f"amd persistent kernel error flag {code}: a stage waited more than spin_limit={self.spin_limit} polls "
                "(grid not co-resident, or a previous launch failed); call reset() before reuse"
            )

    def reset(self) -> None:
        """Zero the counters and the error flag (mutates the plugin's sync state)."""
        self.sync.zero_()
        self.error.zero_()


def check_model(model: Any) -> tuple[str, ...]:
    """Reasons a loaded model cannot use this plugin: the ``nvidia`` ones, plus MoE layers."""
    cfg = getattr(model, "config", model)
    reasons = list(_nvidia_check_model(model))
    if getattr(cfg, "num_local_experts", 0) or getattr(cfg, "num_experts", 0):
        reasons.append("mixture-of-experts layers are not supported by the amd plugin (the nvidia plugin has them)")
    return tuple(reasons)


def build(ctx: BuildContext) -> AmdLayerStack:
    """Check the loaded weights and allocate the workspaces and sync counters."""
    if ctx.moe is not None:
        raise Unsupported("amd", ("mixture-of-experts layers are not supported by the amd plugin",))
    lc = ops.LaunchConfig.for_device(ctx.device, ctx.shape, use_pdl=False)
    if unmeasured := unmeasured_errors(ctx, lc):
        raise Unsupported("amd", unmeasured)
    return AmdLayerStack(ctx, lc)


spec = PluginSpec(
    name="amd",
    version="0.1.0",
    archs=ARCHS,
    requirements=Requirements(
        vendor="amd",
        amd_archs=("gfx90a", "gfx942", "gfx950"),
        dtypes=("bfloat16", "float16"),
        kv_dtypes=("bfloat16", "float16"),
        tp_sizes=(1,),
        forbidden_features=frozenset({"lora", "speculative", FP8_WEIGHTS}),
        max_context=131072,
    ),
    coverage=Coverage(max_tokens=16),
    build=build,
    check_model=check_model,
    priority=10,
    description="portable Triton: persistent K1 (norm+QKV+RoPE+KV) and K2 (attention..down) with tagged hand-over",
)

__all__ = ["AmdLayerStack", "build", "spec"]
