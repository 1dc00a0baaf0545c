"""The ``nvidia`` plugin: per-stage Triton kernels chained with programmatic dependent launch.

Each kernel issues its first weight loads, then ``gdc_wait`` (the previous kernel's results are
visible after it), runs its main loop, then ``gdc_launch_dependents`` so the next kernel's blocks
start and prefetch their own weights during this one's epilogue. A grid small enough to be resident at
once releases right after its wait instead (``LaunchConfig.pdl_release``: released early, the dependent
blocks of a larger grid hold SM slots the primary still needs, slower than no PDL on the H200; on
SmolLM2's small grids early release is faster). GEMV blocks per stage and the release point per shape
come from ``lowlat.kernels.tuning``. PDL is used where the
Triton build has ``launch_pdl`` and ``tl.extra.cuda.gdc_*`` and the GPU is Hopper or newer;
elsewhere the same kernels run unchained.
"""

from __future__ import annotations

from typing import Any

from lowlat.build import BuildContext
from lowlat.errors import Unsupported
from lowlat.kernels._jit import pdl_available
from lowlat.kernels.ops import MAX_VERIFY_ROWS, LaunchConfig
from lowlat.layer import FP8_DTYPE
from lowlat.plugins._moe_stack import TritonMoEStack
from lowlat.plugins._stack import TritonLayerStack, fp8_weights, unmeasured_errors
from lowlat.spec import Coverage, PluginSpec, Requirements, StepKind
from lowlat.tp import TP_SIZES

ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM")


def use_pdl(ctx: BuildContext) -> bool:
    """Whether to chain with PDL: config ``pdl`` plus what Triton and the device support."""
    if ctx.config.pdl == "off" or ctx.device.type != "cuda":
        return False
    ok = pdl_available() and (ctx.setup.capability or (0, 0)) >= (9, 0)
    if ctx.config.pdl == "on" and not ok:
        raise Unsupported("nvidia", ("pdl='on' but this Triton build or GPU has no programmatic dependent launch",))
    return ok


class NvidiaLayerStack(TritonLayerStack):
    """The per-stage stack; also serves FP8 (e4m3) weights with per-row scales, an FP8 KV cache, and this rank's
    shards under tensor parallelism (TP 2, 4, 8: partials summed by the build's reducer, ``lowlat.tp``)."""

    supports_fp8 = True
    supports_tp = True


def build(ctx: BuildContext) -> TritonLayerStack | TritonMoEStack:
    """Check the loaded weights and allocate the workspaces (``NvidiaLayerStack``, FP8 weights and KV included, or
    ``TritonMoEStack`` when ``ctx.moe`` is set)."""
    lc = LaunchConfig.for_device(ctx.device, ctx.shape, use_pdl(ctx), moe=ctx.moe, fp8=fp8_weights(ctx),
                                 fp8_kv=ctx.kv_dtype == FP8_DTYPE)
    if unmeasured := unmeasured_errors(ctx, lc):
        raise Unsupported("nvidia", unmeasured)
    if ctx.moe is not None:
        return TritonMoEStack("nvidia", ctx, lc)
    return NvidiaLayerStack("nvidia", ctx, lc)


def check_model(model: Any) -> tuple[str, ...]:
    """Reasons a loaded model cannot use this plugin: attention biases, shared experts."""
    cfg = getattr(model, "config", model)
    reasons = []
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "qkv_bias", False):
        reasons.append("attention projections with bias are not supported")
    if getattr(cfg, "n_shared_experts", 0) or getattr(cfg, "shared_expert_intermediate_size", 0):
        reasons.append("shared experts are not supported (Mixtral-style routed experts only)")
    return tuple(reasons)


spec = PluginSpec(
    name="nvidia",
    version="0.1.0",
    archs=ARCHS,
    requirements=Requirements(
        vendor="nvidia",
        min_capability=(8, 0),
        dtypes=("bfloat16", "float16"),
        kv_dtypes=("bfloat16", "float16", "fp8_e4m3"),
        tp_sizes=TP_SIZES,
        forbidden_features=frozenset({"lora"}),
        max_context=131072,
    ),
    # verify steps: each row is a decode row at its own position (up to MAX_VERIFY_ROWS rows per request)
    coverage=Coverage(step_kinds=frozenset({StepKind.DECODE, StepKind.VERIFY}), max_tokens=16,
                      max_query_len=MAX_VERIFY_ROWS),
    build=build,
    check_model=check_model,
    priority=10,
    description="Triton decode layer: norm+QKV+RoPE+KV write, split-KV GQA attention, fused GEMV epilogues, PDL-chained; "
                "bf16/fp16 or FP8 e4m3 weights (per-row scales), model-dtype or FP8 e4m3 KV cache; TP 1, 2, 4, 8",
)
