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
        self.padded = self._plan_padded(batch)
        if self.padded:
            return
        start = 0
        for i in range(batch.batch_size):
            prefix, ext = batch.extend_prefix_lens_cpu[i], batch.extend_seq_lens_cpu[i]
            total = prefix + ext
            slots = self.req_to_token[rows[i], :total].long()  # (total,)
            q_pos = torch.arange(prefix, total, device=rows.device)
            mask = torch.arange(total, device=rows.device)[None, :] <= q_pos[:, None]  # (ext, total)
            self.extend_plan.append((start, ext, slots, mask))
            start += ext

    def _plan_padded(self, batch: ForwardBatch) -> bool:
        """Plans one padded SDPA over all requests when padding wastes < half the work.

        NOTE: one large call instead of a call per request: on a busy CPU, many small
        multi-threaded calls spend most of their time in thread barriers.
        """
        assert batch.extend_prefix_lens_cpu is not None and batch.extend_seq_lens_cpu is not None
        ext, pre = batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu
        tot = [p + e for p, e in zip(pre, ext, strict=True)]
        bs, max_ext, max_tot = batch.batch_size, max(ext), max(tot)
        if bs == 1 or bs * max_ext * max_tot > 2 * sum(e * t for e, t in zip(ext, tot, strict=True)):
            return False
        device = batch.req_pool_indices.device
        ext_t = torch.tensor(ext, device=device)
        starts = torch.cumsum(ext_t, 0) - ext_t
        j = torch.arange(max_ext, device=device)
        self.pad_valid = j[None, :] < ext_t[:, None]  # (bs, max_ext)
        self.pad_q_index = (starts[:, None] + j[None, :]).clamp(max=sum(ext) - 1)  # (bs, max_ext)
        self.pad_slots = self.req_to_token[batch.req_pool_indices, :max_tot].long().reshape(-1)  # (bs * max_tot,)
        q_pos = torch.tensor(pre, device=device)[:, None] + j[None, :]  # (bs, max_ext)
        k_pos = torch.arange(max_tot, device=device)
        tot_t = torch.tensor(tot, device=device)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, :] < tot_t[:, None])[:, None, :]
        self.pad_mask = mask[:, None]  # (bs, 1, max_ext, max_tot)
        self.pad_shape = (bs, max_ext, max_tot)
        return True

    def _forward_padded(self, q: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        bs, max_ext, max_tot = self.pad_shape
        k_cache = self.kv_pool.k_cache[layer.layer_id]
        v_cache = self.kv_pool.v_cache[layer.layer_id]
        shape = (bs, max_tot, layer.num_kv_heads, layer.head_dim)
        kk = k_cache.index_select(0, self.pad_slots).view(shape).transpose(1, 2).to(q.dtype)  # (bs, KV, L, D)
        vv = v_cache.index_select(0, self.pad_slots).view(shape).transpose(1, 2).to(q.dtype)  # (bs, KV, L, D)
        qq = q[self.pad_q_index].transpose(1, 2)  # (bs, H, max_ext, D)
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=self.pad_mask, scale=layer.scaling, enable_gqa=True)
        out = out.transpose(1, 2)[self.pad_valid]  # (num_tokens, H, D), request-major like q
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)

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
        if self.padded:
            return self._forward_padded(q, layer)
        out = torch.empty(num_tokens, layer.num_heads, layer.head_dim, dtype=q.dtype, device=q.device)
        for start, ext, slots, mask in self.extend_plan:
            qi = q[start : start + ext].transpose(0, 1)  # (H, ext, D)
            ki = k_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)  # (KV, total, D)
            vi = v_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)  # (KV, total, D)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
            out[start : start + ext] = oi.transpose(0, 1)
        return out.reshape(num_tokens, layer.num_heads * layer.head_dim)
