"""Choosing the layer kernels once: Triton on a GPU, the torch-native references elsewhere.

`select_kernels` is called once when a model runner is built; the returned `KernelOps` holds
the chosen callables (all with the Triton functions' signatures and in-place semantics) and a
`reason` that says why that path was or was not taken. Attention kernels are chosen by the
attention backend registry instead (`lmserver.runner.attention`). Triton is imported only here, and
only when it is chosen.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from lmserver.kernels import reference as ref
from lmserver.kernels.fp8_ref import quantize_fp8_per_token

__all__ = ["KernelOps", "KernelUnavailableError", "native_kernels", "select_kernels"]


class KernelUnavailableError(RuntimeError):
    """The asked-for kernel path cannot run on this device or installation."""


@dataclass(frozen=True)
class KernelOps:
    """The layer kernels of one model runner. Every call mutates exactly what its Triton
    twin's docstring says (e.g. `fused_add_rmsnorm` writes x and residual in place)."""

    backend: Literal["triton", "torch_native"]
    reason: str
    rmsnorm: Callable[..., torch.Tensor]  # (x, weight, eps, out=None) -> out
    fused_add_rmsnorm: Callable[..., None]  # (x, residual, weight, eps), in place
    # (x, weight, eps, residual=None) -> per-token FP8 rows of rmsnorm(x) (with residual: residual <- x + residual
    # in place first, then rmsnorm(residual)): (float8_e4m3fn (T, hidden), float32 scale (T, 1))
    rmsnorm_fp8: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]  # (x, out=None) -> out
    # (gate_up) -> per-token FP8 rows of silu_and_mul(gate_up): (float8_e4m3fn (T, d), float32 scale (T, 1))
    silu_and_mul_fp8: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    apply_rope_inplace: Callable[..., None]  # (positions, q, k, cos_sin_cache), in place
    store_kv: Callable[..., None]  # (k, v, k_cache, v_cache, loc), in place
    apply_token_bitmask_inplace: Callable[..., None]  # (logits, bitmask), in place
    top_k_top_p_min_p_probs: Callable[..., torch.Tensor]  # (logits, temps, top_ks, top_ps, min_ps, out=None)
    # (x, router_logits, w13, w2, top_k, w13_scale=None, w2_scale=None, scale_block=None) -> new (T, hidden) (FP8
    # experts with their scales); None: the MoE layer's own torch paths
    fused_moe: Callable[..., torch.Tensor] | None = None


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    result = ref.rmsnorm_ref(x, weight, eps)
    return result if out is None else out.copy_(result)


def _fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    normed, summed = ref.fused_add_rmsnorm_ref(x, residual, weight, eps)
    residual.copy_(summed)
    x.copy_(normed)


def _rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        return quantize_fp8_per_token(ref.rmsnorm_ref(x, weight, eps))
    normed, summed = ref.fused_add_rmsnorm_ref(x, residual, weight, eps)
    residual.copy_(summed)
    return quantize_fp8_per_token(normed)


def _silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    result = ref.silu_and_mul_ref(x)
    return result if out is None else out.copy_(result)


def _silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_per_token(ref.silu_and_mul_ref(x))


def _rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    q_out, k_out = ref.rope_ref(positions, q, k, cos_sin_cache)
    q.copy_(q_out)
    k.copy_(k_out)


def _bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    logits.copy_(ref.apply_token_bitmask_ref(logits, bitmask))


def _probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    result = ref.top_k_top_p_min_p_probs_ref(logits, temperatures, top_ks, top_ps, min_ps)
    return result if out is None else out.copy_(result)


def native_kernels(reason: str) -> KernelOps:
    """The torch-native references behind the `KernelOps` interface (any device)."""
    return KernelOps(
        backend="torch_native",
        reason=reason,
        rmsnorm=_rmsnorm,
        fused_add_rmsnorm=_fused_add_rmsnorm,
        rmsnorm_fp8=_rmsnorm_fp8,
        silu_and_mul=_silu_and_mul,
        silu_and_mul_fp8=_silu_and_mul_fp8,
        apply_rope_inplace=_rope,
        store_kv=ref.store_kv_ref,
        apply_token_bitmask_inplace=_bitmask,
        top_k_top_p_min_p_probs=_probs,
    )


def _triton_kernels(reason: str) -> KernelOps:
    from lmserver.kernels.activation import silu_and_mul
    from lmserver.kernels.bitmask import apply_token_bitmask_inplace
    from lmserver.kernels.fp8_quant import rmsnorm_quantize_fp8, silu_and_mul_quantize_fp8
    from lmserver.kernels.fused_moe import fused_moe
    from lmserver.kernels.kv_store import store_kv
    from lmserver.kernels.norm import fused_add_rmsnorm, rmsnorm
    from lmserver.kernels.rope import apply_rope_inplace
    from lmserver.kernels.sampling import top_k_top_p_min_p_probs

    return KernelOps(
        backend="triton",
        reason=reason,
        rmsnorm=rmsnorm,
        fused_add_rmsnorm=fused_add_rmsnorm,
        rmsnorm_fp8=rmsnorm_quantize_fp8,
        silu_and_mul=silu_and_mul,
        silu_and_mul_fp8=silu_and_mul_quantize_fp8,
        apply_rope_inplace=apply_rope_inplace,
        store_kv=store_kv,
        apply_token_bitmask_inplace=apply_token_bitmask_inplace,
        top_k_top_p_min_p_probs=top_k_top_p_min_p_probs,
        fused_moe=fused_moe,
    )


def select_kernels(
    device: torch.device | str,
    prefer: Literal["auto", "triton", "torch_native"] = "auto",
    interpret: bool = False,
) -> KernelOps:
    """Pick the layer kernels for `device`, once. Mutates nothing.

    "auto" takes Triton on a CUDA (or ROCm) device when triton is importable, else the
    torch-native references; "triton" raises KernelUnavailableError where it cannot run.
    `interpret=True` says the process runs Triton's CPU interpreter (TRITON_INTERPRET=1 set
    before triton was imported), which lets Triton kernels run on CPU tensors (tests only).
    """
    dev = torch.device(device)
    if prefer not in ("auto", "triton", "torch_native"):
        raise ValueError(f"prefer must be 'auto', 'triton' or 'torch_native', got {prefer!r}")
    if prefer == "torch_native":
        return native_kernels("torch_native asked for")
    has_triton = importlib.util.find_spec("triton") is not None
    runs_here = dev.type == "cuda" or (dev.type == "cpu" and interpret)
    if has_triton and runs_here:
        where = "ROCm" if torch.version.hip else ("CUDA" if dev.type == "cuda" else "the Triton CPU interpreter")
        return _triton_kernels(f"Triton kernels on {where} ({dev})")
    why = "triton is not installed (pip install triton)" if not has_triton else f"Triton kernels need a GPU, not {dev}"
    if prefer == "triton":
        raise KernelUnavailableError(f"cannot use the Triton kernels: {why}; use prefer='torch_native' or 'auto'")
    return native_kernels(f"torch-native references: {why}")
