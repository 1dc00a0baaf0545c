"""torch_native attention: SDPA over gathered KV slots. The reference for every GPU backend.

EXTEND (prefill with a cached prefix, chunks, mixed batches) runs one padded SDPA (or one per
request when padding would waste most of the work). DECODE keeps a dense per-batch copy of
the requests' K/V (`_DenseDecode`): gathered from the pool once when the batch changes, then
extended by the one new token per request each step, so a step does not re-gather every
request's whole K/V in every layer. Without a host copy of the rows, or over the memory
budget, DECODE gathers all slots padded to the longest request and masks the padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmserver.forward.batch import AttentionBackend, AttentionLayer, ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from lmserver.forward.kv_pool import KVPool


DENSE_DECODE_BUDGET_BYTES = 512 << 20  # the dense decode K/V copies of all layers together
DENSE_DECODE_HEADROOM = 64  # decode steps a dense copy absorbs before it is re-gathered larger


class _DenseDecode:
    """Per-layer K and V copies (bs, cap, KV, D) of one decode batch, request-major (the first
    bs rows of buffers allocated for `alloc_bs` requests, reused while a batch shrinks).

    Invariant: when `written[l]` is the current step, positions [0, lens[b]) of row b of layer
    l hold request b's K/V; other positions hold finite values (zeros or stale K/V), masked out.
    A layer that missed a step (its forward did not run through this backend, e.g. a plugin
    served the step) is re-gathered from the pool.
    """

    def __init__(self, rows: list[int], cap: int, num_layers: int) -> None:
        self.rows = rows
        self.cap = cap
        self.alloc_bs = len(rows)
        self.k: list[torch.Tensor | None] = [None] * num_layers  # allocated by the layer's first forward
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.written = [-1] * num_layers  # the step each layer's copy is complete for
        self.step = 0
        self.lens: list[int] = []

    def extends(self, rows: list[int], lens: list[int]) -> bool:
        """True when (rows, lens) is this batch one token further (same rows, each length + 1)."""
        return (
            rows == self.rows
            and max(lens) <= self.cap
            and all(n == m + 1 for n, m in zip(lens, self.lens, strict=True))
        )


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    dense_budget_bytes = DENSE_DECODE_BUDGET_BYTES

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        super().__init__(kv_pool, req_to_token)
        self.dense: _DenseDecode | None = None  # kept across forwards (buffers reused)
        self.use_dense = False  # this forward is a decode on `dense`
        self.decode_slots: torch.Tensor | None = None  # (bs * max_len,) pool slots of a decode gather

    def plan(self, batch: ForwardBatch) -> None:
        """Precomputes slot indices and masks shared by all layers; mutates only self."""
        self.batch = batch
        rows = batch.req_pool_indices
        if batch.mode == ForwardMode.DECODE:
            max_len = max(batch.seq_lens_cpu)
            ar = torch.arange(max_len, device=rows.device)
            valid = (ar[None, :] < batch.seq_lens[:, None]).view(batch.batch_size, 1, 1, max_len)
            # additive float mask (cheaper in SDPA than a bool one); every row has >= 1 valid key
            self.decode_mask = torch.zeros(valid.shape, dtype=self.kv_pool.compute_dtype, device=rows.device)
            self.decode_mask.masked_fill_(~valid, float("-inf"))
            self.decode_shape = (batch.batch_size, max_len)
            if self._plan_dense(batch, max_len):
                return
            self.decode_slots = self.req_to_token[rows, :max_len].long().reshape(-1)  # (bs * max_len,)
            return
        self.use_dense = False
        if self.dense is not None:  # NOTE: an EXTEND may give a request's row to another request
            self.dense.rows = []
        assert batch.extend_prefix_lens_cpu is not None and batch.extend_seq_lens_cpu is not None
        self.extend_plan: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        self.padded = self._plan_padded(batch)
        if self.padded:
            return
        start = 0
        for i in range(batch.batch_size):
            prefix, ext = batch.extend_prefix_lens_cpu[i], batch.extend_seq_lens_cpu[i]
            total = prefix + ext
            slots = self.req_to_token[rows[i], :total].long()  # (total,)
            mask: torch.Tensor | None = None  # a fresh prompt: SDPA's own causal mask (upper left = lower right)
            if prefix:
                q_pos = torch.arange(prefix, total, device=rows.device)
                mask = torch.arange(total, device=rows.device)[None, :] <= q_pos[:, None]  # (ext, total)
            self.extend_plan.append((start, ext, slots, mask))
            start += ext

    def _plan_dense(self, batch: ForwardBatch, max_len: int) -> bool:
        """Plans a decode step on the dense copy (extending it or re-gathering it); False when
        there is no host copy of the rows or the copy would exceed the memory budget."""
        self.use_dense = False
        rows_cpu = batch.req_pool_indices_cpu
        if rows_cpu is None:
            return False
        lens = batch.seq_lens_cpu
        dense = self.dense
        if dense is None or not dense.extends(rows_cpu, lens):
            pool = self.kv_pool
            bs, cap = batch.batch_size, max_len + DENSE_DECODE_HEADROOM
            if dense is not None and dense.alloc_bs >= bs and dense.cap >= max_len:
                dense.rows = list(rows_cpu)  # reuse the buffers (stale values are finite)
                dense.written = [-1] * pool.num_layers
            else:
                self.dense = None  # frees the old copy first
                item = torch.empty((), dtype=pool.compute_dtype).element_size()
                if 2 * pool.num_layers * bs * cap * pool.num_kv_heads * pool.head_dim * item > self.dense_budget_bytes:
                    return False
                dense = _DenseDecode(list(rows_cpu), cap, pool.num_layers)
        dense.step += 1
        dense.lens = list(lens)
        self.dense, self.use_dense = dense, True
        # flat (b * cap + lens[b] - 1) position of each request's new token in the dense copy
        self.dense_write = torch.tensor(
            [b * dense.cap + n - 1 for b, n in enumerate(lens)], dtype=torch.int64, device=batch.req_pool_indices.device
        )
        self.decode_slots = None  # the gather index, built by the first layer that needs it
        return True

    def _forward_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        dense = self.dense
        assert dense is not None
        bs, max_len = self.decode_shape
        lid = layer.layer_id
        kd, vd = dense.k[lid], dense.v[lid]
        if kd is None or vd is None:
            shape = (dense.alloc_bs, dense.cap, layer.num_kv_heads, layer.head_dim)
            pool = self.kv_pool
            # NOTE: zeros, not empty: masked positions are multiplied by 0 in SDPA (NaN * 0 = NaN)
            kd = dense.k[lid] = torch.zeros(shape, dtype=pool.compute_dtype, device=q.device)
            vd = dense.v[lid] = torch.zeros(shape, dtype=pool.compute_dtype, device=q.device)
        kd, vd = kd[:bs], vd[:bs]  # contiguous: the leading rows
        if dense.written[lid] == dense.step - 1:  # complete up to the last step: add this token
            flat = (bs * dense.cap, layer.num_kv_heads, layer.head_dim)
            pool = self.kv_pool
            if pool.is_fp8:  # NOTE: the copy holds what the pool holds: the FP8-rounded values
                kq, vq = pool.quantize(lid, k, v)
                k, v = pool.dequantize_k(lid, kq, kd.dtype), pool.dequantize_v(lid, vq, vd.dtype)
            kd.view(flat).index_copy_(0, self.dense_write, k.to(kd.dtype))
            vd.view(flat).index_copy_(0, self.dense_write, v.to(vd.dtype))
        else:  # (re-)gather; the pool already holds this step's k, v
            if self.decode_slots is None:
                self.decode_slots = self.req_to_token[self.batch.req_pool_indices, :max_len].long().reshape(-1)
            shape = (bs, max_len, layer.num_kv_heads, layer.head_dim)
            pool = self.kv_pool
            kd[:, :max_len] = pool.dequantize_k(lid, pool.k_cache[lid].index_select(0, self.decode_slots), kd.dtype).view(shape)
            vd[:, :max_len] = pool.dequantize_v(lid, pool.v_cache[lid].index_select(0, self.decode_slots), vd.dtype).view(shape)
        dense.written[lid] = dense.step
        kk = kd[:, :max_len].transpose(1, 2).to(q.dtype)  # (bs, KV, L, D), strided
        vv = vd[:, :max_len].transpose(1, 2).to(q.dtype)
        return self._decode_sdpa(q, kk, vv, layer)

    def _decode_sdpa(self, q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        """q (bs, H, D) over kk, vv (bs, KV, L, D) -> (bs, H * D).

        The H // KV query heads of a KV head ride as its query rows (q (bs, KV, G, D)), so
        grouped-query attention needs no expanded copy of K and V.
        """
        bs, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        mask = self.decode_mask if self.decode_mask.dtype == q.dtype else self.decode_mask.to(q.dtype)
        qq = q.reshape(bs, layer.num_kv_heads, group, layer.head_dim)
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=layer.scaling)  # (bs, KV, G, D)
        return out.reshape(bs, layer.num_heads * layer.head_dim)

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
        pool, lid = self.kv_pool, layer.layer_id
        kk = pool.dequantize_k(lid, k_cache.index_select(0, self.pad_slots), q.dtype).view(shape).transpose(1, 2)
        vv = pool.dequantize_v(lid, v_cache.index_select(0, self.pad_slots), q.dtype).view(shape).transpose(1, 2)
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
        if batch.mode == ForwardMode.DECODE and self.use_dense:
            return self._forward_dense(q, k, v, layer)
        if batch.mode == ForwardMode.DECODE:
            assert self.decode_slots is not None
            shape = (*self.decode_shape, layer.num_kv_heads, layer.head_dim)
            pool, lid = self.kv_pool, layer.layer_id
            kk = pool.dequantize_k(lid, k_cache.index_select(0, self.decode_slots), q.dtype).view(shape).transpose(1, 2)
            vv = pool.dequantize_v(lid, v_cache.index_select(0, self.decode_slots), q.dtype).view(shape).transpose(1, 2)
            return self._decode_sdpa(q, kk, vv, layer)
        if self.padded:
            return self._forward_padded(q, layer)
        out = torch.empty(num_tokens, layer.num_heads, layer.head_dim, dtype=q.dtype, device=q.device)
        for start, ext, slots, mask in self.extend_plan:
            # NOTE: (1, H, ext, D) with a batch dimension: on the CPU SDPA then takes its flash kernel; 3-d inputs went
            # through the math path, 6x slower with a mask and 12x without (2,048 tokens, 9 heads of 64, 2 cores:
            # 468 ms -> 79 ms masked, 40 ms causal)
            qi = q[start : start + ext].transpose(0, 1)[None]
            ki = self.kv_pool.dequantize_k(layer.layer_id, k_cache.index_select(0, slots), q.dtype).transpose(0, 1)[None]
            vi = self.kv_pool.dequantize_v(layer.layer_id, v_cache.index_select(0, slots), q.dtype).transpose(0, 1)[None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=layer.scaling,
                                                enable_gqa=True)
            out[start : start + ext] = oi[0].transpose(0, 1)
        return out.reshape(num_tokens, layer.num_heads * layer.head_dim)
