"""triton attention: paged flash-decoding for DECODE, prefix + causal extend kernel for EXTEND.

Same contract as `torch_native` (its reference): `forward` first stores the new k, v at
`batch.out_cache_loc` of its layer (Triton KV-store kernel), then attends over every slot of
each request. Kernels: `lmserver.kernels.decode_attention`, `lmserver.kernels.extend_attention`.
"""

from __future__ import annotations

import os

import torch

from lmserver.attention.base import AttentionBackend, AttentionLayer
from lmserver.engine.forward_batch import ForwardBatch, ForwardMode
from lmserver.engine.kv_pool import KVPool
from lmserver.kernels.decode_attention import choose_num_kv_splits, decode_attention
from lmserver.kernels.extend_attention import extend_attention
from lmserver.kernels.kv_store import store_kv

__all__ = ["TritonBackend"]


class TritonBackend(AttentionBackend):
    """Triton kernels over the shared KV layout. Holds scratch buffers for the decode split
    reduction, keyed by (batch size, num_heads, head_dim), so repeated decode forwards of one
    batch size reuse them (what a CUDA graph of that size captures)."""

    name = "triton"

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        super().__init__(kv_pool, req_to_token)
        device = req_to_token.device
        # NOTE: TRITON_INTERPRET=1 is Triton's own switch; with it the kernels run on CPU tensors (tests).
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"the triton attention backend needs a CUDA (or ROCm) device, got {device}; "
                "use --attention-backend torch_native"
            )
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self._scratch: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def plan(self, batch: ForwardBatch) -> None:
        """Chooses the decode split count or the extend grid size; mutates only self."""
        self.batch = batch
        if batch.mode == ForwardMode.DECODE:
            self.num_kv_splits = choose_num_kv_splits(batch.batch_size, self.kv_pool.num_kv_heads, self.num_sms)
            return
        assert batch.extend_seq_lens_cpu is not None, "EXTEND batch without extend_seq_lens_cpu"
        self.max_extend_len = max(batch.extend_seq_lens_cpu, default=0)

    def _decode_scratch(self, bs: int, num_heads: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (bs, num_heads, head_dim, self.num_kv_splits)
        if key not in self._scratch:
            self._scratch[key] = (
                torch.empty(bs, num_heads, self.num_kv_splits, head_dim, dtype=torch.float32, device=device),
                torch.empty(bs, num_heads, self.num_kv_splits, dtype=torch.float32, device=device),
            )
        return self._scratch[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        """q (T, H, D), k/v (T, KV, D) -> (T, H * D). Mutates the layer's KV cache (stores k, v)."""
        batch = self.batch
        k_cache = self.kv_pool.k_cache[layer.layer_id]
        v_cache = self.kv_pool.v_cache[layer.layer_id]
        store_kv(k, v, k_cache, v_cache, batch.out_cache_loc)
        num_tokens = q.shape[0]
        out = torch.empty(num_tokens, layer.num_heads, layer.head_dim, dtype=q.dtype, device=q.device)
        if batch.mode == ForwardMode.DECODE:
            part_out, part_lse = self._decode_scratch(batch.batch_size, layer.num_heads, layer.head_dim, q.device)
            decode_attention(
                q, k_cache, v_cache, self.req_to_token, batch.req_pool_indices, batch.seq_lens, layer.scaling,
                out=out, num_kv_splits=self.num_kv_splits, partial_out=part_out, partial_lse=part_lse,
                block_n=128 if q.is_cuda else 16,
            )
        else:
            assert batch.extend_prefix_lens is not None and batch.extend_seq_lens is not None
            assert batch.extend_start_loc is not None
            extend_attention(
                q, k, v, k_cache, v_cache, self.req_to_token, batch.req_pool_indices, batch.extend_prefix_lens,
                batch.extend_seq_lens, batch.extend_start_loc, layer.scaling, self.max_extend_len, out=out,
            )
        return out.reshape(num_tokens, layer.num_heads * layer.head_dim)
