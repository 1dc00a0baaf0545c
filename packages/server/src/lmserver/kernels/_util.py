"""Small helpers shared by the Triton kernel wrappers: input checks and launch parameters."""

from __future__ import annotations

import torch

__all__ = [
    "KernelInputError",
    "check_attention_inputs",
    "check_last_dim_contiguous",
    "dot_precision",
    "next_pow2",
    "row_warps",
]


class KernelInputError(ValueError):
    """A kernel was called with tensors of the wrong shape, dtype, device or layout."""


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def row_warps(block: int) -> int:
    """Warps of a one-program-per-row kernel walking `block` columns at a time (the norms, the FP8
    quantizers): 256 columns per warp (8 per thread), 1 to 16."""
    return min(16, max(1, block // 256))


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact float32 ("ieee") for float32 operands, else the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """Raise KernelInputError unless every tensor has a unit stride on its last dimension."""
    for name, t in tensors.items():
        if t.dim() > 0 and t.stride(-1) != 1:
            raise KernelInputError(f"{name} must be contiguous in its last dimension (stride {t.stride()})")


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Validate the (tokens, heads, head_dim) query and (slots, kv_heads, head_dim) caches."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise KernelInputError(
            f"expected q (tokens, num_heads, head_dim) and k_cache == v_cache shape (num_slots, "
            f"num_kv_heads, head_dim); got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
            f"v_cache {tuple(v_cache.shape)}"
        )
    if q.shape[2] != k_cache.shape[2] or q.shape[1] % k_cache.shape[1] != 0:
        raise KernelInputError(
            f"head_dim must match and num_heads ({q.shape[1]}) must be a multiple of num_kv_heads "
            f"({k_cache.shape[1]})"
        )
    if not (q.device == k_cache.device == v_cache.device):
        raise KernelInputError(f"q, k_cache and v_cache must share one device, got {q.device}, {k_cache.device}")
    check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)
