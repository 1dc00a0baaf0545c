"""ForwardBatch: the tensors of one model forward (what the attention backend plans over).

KV layout (the contract of every attention backend): per layer `k_cache`, `v_cache` of shape
(num_slots, num_kv_heads, head_dim); `req_to_token` (max_running_requests, max_context_len)
int32 slot ids; slot 0 is padding and never holds a real token.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmserver.kernels.fp8_ref import rotate_heads

if TYPE_CHECKING:
    from lmserver.forward.kv_pool import KVPool
    from lmserver.kernels.cascade_decode import CascadeMetadata


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly with a cached prefix, chunked, or mixed with decodes)
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    out_cache_loc: torch.Tensor  # (num_tokens,) int64 KV slots the new tokens are written to
    req_pool_indices: torch.Tensor  # (bs,) int64 rows of req_to_token
    seq_lens: torch.Tensor  # (bs,) int32 lengths including the new tokens
    seq_lens_cpu: list[int]
    req_pool_indices_cpu: list[int] | None = None  # the same rows on the host (None: not built)
    # EXTEND only (None for DECODE)
    extend_prefix_lens: torch.Tensor | None = None  # (bs,) int32 tokens already in the KV cache
    extend_seq_lens: torch.Tensor | None = None  # (bs,) int32 new tokens per request
    extend_start_loc: torch.Tensor | None = None  # (bs,) int32 exclusive cumsum of extend_seq_lens
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    attn_backend: AttentionBackend | None = None
    # DECODE only: rows that share a KV prefix (cascade attention; see runner/attention/shared_prefix.py).
    # Backends without `supports_cascade` ignore it (their result is the same).
    cascade: CascadeMetadata | None = None
    # EXTEND with images / videos: the decoder's input embeddings (token embeddings with the
    # vision rows written over them); None: the model looks up input_ids
    input_embeds: torch.Tensor | None = None  # (num_tokens, hidden)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class AttentionLayer(nn.Module):
    """Per-layer attention parameters; calls the batch's backend (holds no weights)."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q (T, H, D), k and v (T, KV, D) -> (T, H * D). Writes k, v into the KV pool (k, and the
        q it attends with, in the pool's rotated basis when it has one: `KVPool.k_rotation`)."""
        assert batch.attn_backend is not None, "ForwardBatch has no attention backend"
        rotation = batch.attn_backend.kv_pool.k_rotation
        if rotation is not None:
            q, k = rotate_heads(q, rotation), rotate_heads(k, rotation)
        return batch.attn_backend.forward(q, k, v, self)


class AttentionBackend(abc.ABC):
    """Plans once per forward, then computes attention per layer."""

    name: str = "base"
    # False: `plan` cannot run inside a captured CUDA graph; the decode graph runner then runs
    # decode eagerly and logs why (runner/cuda_graph.py).
    supports_cuda_graph: bool = True

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token  # (max_running_requests, max_context_len) int32

    @abc.abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Builds per-forward metadata (index tensors, masks) from `batch`; mutates only self."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        """Stores k, v (T, KV, D) for `layer` and returns attention output (T, H * D)."""
