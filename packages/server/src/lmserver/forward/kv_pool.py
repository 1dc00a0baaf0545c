"""The token-slot KV pool and the request-to-token table (device memory only, no bookkeeping).

Which slots are free is decided by the scheduler's slot allocator (torch-free); this module only
holds the tensors. Slot 0 is padding: it is never handed out, so stale table entries read zeros.

FP8 KV cache (`kv_cache_dtype` float8_e4m3fn): the caches hold K / k_scale and V / v_scale
saturated at +-448, one scale per layer for K and one for V (per tensor, as SGLang and vLLM
keep them: 1.0, or the checkpoint's `k_scale` / `v_scale`); readers multiply back
(`dequantize_k` / `dequantize_v`, or the Triton kernels' `k_scale` / `v_scale` arguments).

K in a rotated basis (`rotate_k`, on for an FP8 cache by `runner.resolve.kv_cache_options`): the
cache holds k @ R per head, R = `fp8_ref.hadamard(head_dim)` (orthonormal, symmetric), and every
reader attends with q @ R: `AttentionLayer` rotates q and k before the backend sees them, so scores
are unchanged and no attention kernel knows of R. Why: e4m3 keeps 3 mantissa bits per value, and a
score q . k of this model rides on a few channels that q and k share, whose rounding errors then
dominate it; after R every channel carries a share of them and the errors average out (embedded
SmolLM2, FP8 K: mean KL 0.0081 -> 0.0047 nats; benchmarks/RESULTS.md, FP8 (issue 33)). No bytes
are added (the scales stay per layer); the cost is two (head_dim x head_dim) products per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmserver.kernels.fp8_ref import FP8_DTYPE, hadamard, quantize_kv_fp8


class KVPool:
    """Per-layer K and V caches of shape (num_slots, num_kv_heads, head_dim).

    `dtype` is the storage dtype, `compute_dtype` the model's (what readers attend in): the
    same unless `kv_cache_dtype` (FP8) is given."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: torch.dtype | None = None,
        k_scales: Sequence[float] | None = None,  # (num_layers,) FP8 only; default 1.0
        v_scales: Sequence[float] | None = None,
        rotate_k: bool = False,  # store K (and attend with q) in the Hadamard basis (module docstring)
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.compute_dtype = dtype
        self.dtype = kv_cache_dtype or dtype
        self.is_fp8 = self.dtype == FP8_DTYPE
        if not self.is_fp8 and (k_scales is not None or v_scales is not None):
            raise ValueError("k_scales / v_scales are for an FP8 KV cache (kv_cache_dtype float8_e4m3fn)")
        self.k_scale = [float(s) for s in k_scales] if k_scales is not None else [1.0] * num_layers
        self.v_scale = [float(s) for s in v_scales] if v_scales is not None else [1.0] * num_layers
        if len(self.k_scale) != num_layers or len(self.v_scale) != num_layers:
            raise ValueError(f"k_scales and v_scales need one value per layer ({num_layers})")
        # (head_dim, head_dim) in the compute dtype, or None: K stored as computed
        self.k_rotation = hadamard(head_dim, dtype, device) if rotate_k else None
        # NOTE: `empty`, not `zeros`: on CPU untouched pages then cost no memory. Every slot a
        # backend reads is written first (a table row only names slots of computed tokens, or
        # the padding page, which is zeroed here so masked-out reads stay finite).
        self.k_cache = [
            torch.empty(num_slots, num_kv_heads, head_dim, dtype=self.dtype, device=device) for _ in range(num_layers)
        ]
        self.v_cache = [
            torch.empty(num_slots, num_kv_heads, head_dim, dtype=self.dtype, device=device) for _ in range(num_layers)
        ]
        self.zero_padding(padding_slots=1)

    def zero_padding(self, padding_slots: int) -> None:
        """Zeroes slots [0, padding_slots) of every layer (the padding page); mutates the caches."""
        for cache in (*self.k_cache, *self.v_cache):
            cache[:padding_slots].zero_()

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V for one token across all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes k, v (T, KV, D) at slots `loc` (T,) int64 of layer `layer_id` (quantized for an
        FP8 cache); mutates the caches.

        NOTE: index_copy_, not `cache[loc] = k`: on CPU index_put_ costs time in the size of the
        whole cache (~0.8 ms per call at 10k slots), index_copy_ only in the rows written.
        """
        k, v = self.quantize(layer_id, k, v)
        k_cache, v_cache = self.k_cache[layer_id], self.v_cache[layer_id]
        if self.is_fp8:  # NOTE: index_copy_ has no float8 kernel on CPU: copy the bytes
            k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
        k_cache.index_copy_(0, loc, k)
        v_cache.index_copy_(0, loc, v)

    def quantize(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v as the cache stores them (FP8: divided by the layer's scales, saturated). Pure."""
        if self.is_fp8:
            return quantize_kv_fp8(k, self.k_scale[layer_id]), quantize_kv_fp8(v, self.v_scale[layer_id])
        return k.to(self.dtype), v.to(self.dtype)

    def dequantize_k(self, layer_id: int, k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows of K (any shape) -> `dtype` values (scaled back for FP8). Pure."""
        if not self.is_fp8:
            return k.to(dtype)
        s = self.k_scale[layer_id]
        return k.to(dtype) if s == 1.0 else (k.float() * s).to(dtype)

    def dequantize_v(self, layer_id: int, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows of V (any shape) -> `dtype` values (scaled back for FP8). Pure."""
        if not self.is_fp8:
            return v.to(dtype)
        s = self.v_scale[layer_id]
        return v.to(dtype) if s == 1.0 else (v.float() * s).to(dtype)


def make_req_to_token(max_running_requests: int, max_context_len: int, device: torch.device | str) -> torch.Tensor:
    """The request-to-token table (max_running_requests, max_context_len) int32, all padding (0)."""
    return torch.zeros(max_running_requests, max_context_len, dtype=torch.int32, device=device)
