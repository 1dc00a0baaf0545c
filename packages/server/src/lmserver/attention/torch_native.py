"""torch_native attention: SDPA over gathered KV slots. The reference for every GPU backend.

EXTEND (prefill with a cached prefix, chunks, mixed batches) loops over requests; DECODE
gathers all requests' slots padded to the longest and masks the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmserver.attention.base import AttentionBackend, AttentionLayer
from lmserver.engine.forward_batch import ForwardBatch, ForwardMode


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def plan(self, batch: ForwardBatch) -> None:
        """Precomputes slot indices and masks shared by all layers; mutates only self."""
        self.batch = batch
        rows = batch.req_pool_indices
        if batch.mode == ForwardMode.DECODE:
            max_len = max(batch.seq_lens_cpu)
            self.decode_slots = self.req_to_token[rows, :max_len].long().reshape(-1)  # (bs * max_len,)
            self.decode_shape = (batch.batch_size, max_len)
            ar = torch.arange(max_len, device=rows.device)
            self.decode_mask = (ar[None, :] < batch.seq_lens[:, None]).view(batch.batch_size, 1, 1, max_len)
            return
        assert batch.extend_prefix_lens_cpu is not None and batch.extend_seq_lens_cpu is not None
        self.extend_plan: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        start = 0
        for i in range(batch.batch_size):
            prefix, ext = batch.extend_prefix_lens_cpu[i], batch.extend_seq_lens_cpu[i]
            total = prefix + ext
            slots = self.req_to_token[rows[i], :total].long()  # (total,)
            q_pos = torch.arange(prefix, total, device=rows.device)
            mask = torch.arange(total, device=rows.device)[None, :] <= q_pos[:, None]  # (ext, total)
            self.extend_plan.append((start, ext, slots, mask))
            start += ext

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        """q (T, H, D), k/v (T, KV, D) -> (T, H * D); stores k, v into the pool first."""
        batch = self.batch
        self.kv_pool.store(layer.layer_id, batch.out_cache_loc, k, v)
        k_cache = self.kv_pool.k_cache[layer.layer_id]
        v_cache = self.kv_pool.v_cache[layer.layer_id]
        num_tokens = q.shape[0]
        if batch.mode == ForwardMode.DECODE:
            shape = (*self.decode_shape, layer.num_kv_heads, layer.head_dim)
            kk = k_cache.index_select(0, self.decode_slots).view(shape).transpose(1, 2).to(q.dtype)  # (bs, KV, L, D)
            vv = v_cache.index_select(0, self.decode_slots).view(shape).transpose(1, 2).to(q.dtype)  # (bs, KV, L, D)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), kk, vv, attn_mask=self.decode_mask, scale=layer.scaling, enable_gqa=True
            )  # (bs, H, 1, D)
            return out.reshape(num_tokens, layer.num_heads * layer.head_dim)
        out = torch.empty(num_tokens, layer.num_heads, layer.head_dim, dtype=q.dtype, device=q.device)
        for start, ext, slots, mask in self.extend_plan:
            qi = q[start : start + ext].transpose(0, 1)  # (H, ext, D)
            ki = k_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)  # (KV, total, D)
            vi = v_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)  # (KV, total, D)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
            out[start : start + ext] = oi.transpose(0, 1)
        return out.reshape(num_tokens, layer.num_heads * layer.head_dim)
