"""The token-slot KV pool and the request-to-token table (device memory only, no bookkeeping).

Which slots are free is decided by the scheduler's slot allocator (torch-free); this module only
holds the tensors. Slot 0 is padding: it is never handed out, so stale table entries read zeros.
"""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V caches of shape (num_slots, num_kv_heads, head_dim)."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # NOTE: `empty`, not `zeros`: on CPU untouched pages then cost no memory. Every slot a
        # backend reads is written first (a table row only names slots of computed tokens, or
        # the padding page, which is zeroed here so masked-out reads stay finite).
        self.k_cache = [
            torch.empty(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.v_cache = [
            torch.empty(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)
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
        """Writes k, v (T, KV, D) at slots `loc` (T,) int64 of layer `layer_id`; mutates the caches.

        NOTE: index_copy_, not `cache[loc] = k`: on CPU index_put_ costs time in the size of the
        whole cache (~0.8 ms per call at 10k slots), index_copy_ only in the rows written.
        """
        self.k_cache[layer_id].index_copy_(0, loc, k.to(self.dtype))
        self.v_cache[layer_id].index_copy_(0, loc, v.to(self.dtype))


def make_req_to_token(max_running_requests: int, max_context_len: int, device: torch.device | str) -> torch.Tensor:
    """The request-to-token table (max_running_requests, max_context_len) int32, all padding (0)."""
    return torch.zeros(max_running_requests, max_context_len, dtype=torch.int32, device=device)
