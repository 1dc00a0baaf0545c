"""The torch_native attention backend (the CPU's) against a float64 oracle written here: each request's queries over
its cached prefix and its new tokens, causal, grouped-query heads, read from the KV pool by the request table.

Fresh prompts (SDPA's own causal mask), chunks over cached prefixes (an explicit mask), several requests in one step
(one SDPA per request, or one padded SDPA) and decode steps, through `compare_backends` (random stale pool contents:
a backend that reads an unwritten slot fails)."""

from __future__ import annotations

import pytest
import torch

from lmserver.forward.batch import AttentionBackend, AttentionLayer, ForwardBatch, ForwardMode
from lmserver.forward.kv_pool import KVPool
from lmserver.runner.attention.testing import compare_backends
from lmserver.runner.attention.torch_native import TorchNativeBackend


class Float64Attention(AttentionBackend):
    """softmax(q k^T * scale + causal mask) v per request and head, in float64, written without SDPA."""

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        super().__init__(kv_pool, req_to_token)

    def plan(self, batch: ForwardBatch) -> None:
        self.batch = batch

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        batch = self.batch
        self.kv_pool.store(layer.layer_id, batch.out_cache_loc, k, v)
        decode = batch.mode == ForwardMode.DECODE
        news = [1] * batch.batch_size if decode else batch.extend_seq_lens_cpu
        assert news is not None
        group = layer.num_heads // layer.num_kv_heads
        out, start = [], 0
        for row, total, new in zip(batch.req_pool_indices_cpu or [], batch.seq_lens_cpu, news, strict=True):
            slots = self.req_to_token[row, :total].long()
            keys = self.kv_pool.k_cache[layer.layer_id][slots].double().repeat_interleave(group, 1)  # (total, H, D)
            vals = self.kv_pool.v_cache[layer.layer_id][slots].double().repeat_interleave(group, 1)
            qs = q[start : start + new].double()  # (new, H, D)
            scores = torch.einsum("nhd,thd->hnt", qs, keys) * layer.scaling
            q_pos = torch.arange(total - new, total)[:, None]
            scores = scores.masked_fill(torch.arange(total)[None, :] > q_pos, float("-inf"))
            out.append(torch.einsum("hnt,thd->nhd", scores.softmax(-1), vals))
            start += new
        return torch.cat(out).reshape(q.shape[0], -1).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "chunks"), [
    ((4, 4, 16), [[37, 0, 0], [5, 0, 0]]),  # one fresh prompt, then a chunk over its prefix (one request per step)
    ((6, 2, 16), [[30, 5, 17], [0, 40, 1], [9, 0, 3]]),  # grouped heads; fresh, chunked and mixed steps
    ((8, 1, 32), [[1, 64, 2], [64, 1, 1]]),  # one KV head; uneven lengths (the padded SDPA declined)
])
def test_torch_native_matches_float64(shape: tuple[int, int, int], chunks: list[list[int]], dtype: torch.dtype) -> None:
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    compare_backends(Float64Attention, TorchNativeBackend, device="cpu", shape=shape, dtype=dtype, num_slots=400,
                     width=160, chunks=chunks, decode_steps=3, tol=tol)
