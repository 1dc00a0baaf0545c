"""flashinfer attention: flashinfer's paged kernels over the shared KV layout (page size 1).

Registered only when the `flashinfer` package imports. API: the `plan()`/`run()` wrappers of
flashinfer >= 0.2.0 (`BatchDecodeWithPagedKVCacheWrapper`, `BatchPrefillWithPagedKVCacheWrapper`);
the 0.1.x `begin_forward`/`forward` API is not supported (plan keywords differ there).

Same contract as `torch_native` (its reference): `forward` first stores the new k, v at
`batch.out_cache_loc` of its layer, then attends over every slot of each request.

Layout mapping: every KV slot is a page of one token, so a layer's cache (num_slots, KV, D) is
viewed as (num_slots, 1, KV, D) in flashinfer's "NHD" layout; request b's page list is
`req_to_token[row_b, :seq_len_b]` (`indices[indptr[b]:indptr[b+1]]`) and its last page holds one
token. DECODE runs the decode wrapper; EXTEND runs the paged prefill wrapper with causal=True
over prefix + new tokens (k, v are stored first): flashinfer aligns a request's queries to the
end of its KV, so new token i of a request with prefix p sees keys [0, p + i].

`plan(batch)` builds the page indices on the device (no host sync) and the indptr on the host;
flashinfer's own `plan` needs the heads, scale and dtype of a layer, so it runs at the first
`forward` of the batch (once per forward unless layers differ in those).

CUDA graphs: flashinfer's `plan` reads host metadata and must run outside a graph (its docs say
it "cannot be used in CUDA graph"), but the decode graph runner calls the backend's `plan`
inside the captured function, so `supports_cuda_graph = False`: the graph runner then decodes
eagerly and logs why (runner/cuda_graph.py).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from lmserver.forward.batch import AttentionBackend, AttentionLayer, ForwardBatch, ForwardMode
from lmserver.forward.kv_pool import KVPool
from lmserver.runner.host_tensors import host_tensor

try:
    import flashinfer
except Exception as e:  # NOTE: a broken install (CUDA or ABI mismatch) may raise other errors
    raise ImportError(f"the flashinfer attention backend needs the flashinfer package: {e}") from e

__all__ = ["FlashInferBackend", "use_tensor_cores_for_decode"]

WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended float workspace, shared by both wrappers
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
REQUIRE_CUDA = True  # NOTE: a test seam: the CPU tests run this backend over a fake flashinfer


def use_tensor_cores_for_decode(num_heads: int, num_kv_heads: int) -> bool:
    """Tensor-core decode (flashinfer's prefill kernel) for GQA groups other than 1, 2 and 4: it
    is faster for large groups and takes any group size (SmolLM2 has 3). Pure."""
    return num_heads // num_kv_heads not in (1, 2, 4)


class FlashInferBackend(AttentionBackend):
    """flashinfer wrappers over the KV pool. Not CUDA-graph capturable (see the module doc)."""

    name = "flashinfer"
    supports_cuda_graph = False

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        super().__init__(kv_pool, req_to_token)
        self.device = req_to_token.device
        if REQUIRE_CUDA and self.device.type != "cuda":
            raise RuntimeError(
                f"the flashinfer attention backend needs a CUDA device, got {self.device}; "
                "use --attention-backend torch_native"
            )
        if kv_pool.dtype not in SUPPORTED_DTYPES:
            raise RuntimeError(
                f"the flashinfer attention backend needs a float16 or bfloat16 KV cache, got {kv_pool.dtype}; "
                "use --dtype bfloat16 or --attention-backend triton"
            )
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode: dict[bool, Any] = {}  # use_tensor_cores -> decode wrapper (made on first use)
        self._prefill: Any = None
        self.batch: ForwardBatch | None = None
        self._planned: tuple[int, float, torch.dtype] | None = None  # (heads, scale, q dtype) of the plan

    def _decode_wrapper(self, tensor_cores: bool) -> Any:
        if tensor_cores not in self._decode:
            self._decode[tensor_cores] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tensor_cores
            )
        return self._decode[tensor_cores]

    def _prefill_wrapper(self) -> Any:
        if self._prefill is None:
            self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        return self._prefill

    def plan(self, batch: ForwardBatch) -> None:
        """Page indices (device), indptrs and last-page lengths (host) of `batch`; mutates only self."""
        self.batch = batch
        self._planned = None
        seq = batch.seq_lens_cpu
        total = sum(seq)
        self.kv_indptr = host_tensor([0, *itertools.accumulate(seq)], torch.int32, self.device)
        self.last_page_len = host_tensor([1] * batch.batch_size, torch.int32, self.device)  # pages of 1 token
        lens = batch.seq_lens.to(torch.int64)
        # flat (table row, column) of every KV token of every request; output_size avoids a host sync
        rows = torch.repeat_interleave(batch.req_pool_indices, lens, output_size=total)
        starts = torch.cumsum(lens, 0) - lens
        cols = torch.arange(total, device=lens.device) - torch.repeat_interleave(starts, lens, output_size=total)
        self.kv_indices = self.req_to_token[rows, cols]  # (total,) int32 slot = page ids
        if batch.mode == ForwardMode.EXTEND:
            assert batch.extend_seq_lens_cpu is not None, "EXTEND batch without extend_seq_lens_cpu"
            self.qo_indptr = host_tensor([0, *itertools.accumulate(batch.extend_seq_lens_cpu)], torch.int32, self.device)

    def _plan_layer(self, layer: AttentionLayer, q_dtype: torch.dtype) -> Any:
        """flashinfer's plan for this batch and `layer`'s heads/scale (once per forward); returns the wrapper."""
        batch = self.batch
        assert batch is not None, "forward before plan"
        kv_heads, head_dim = self.kv_pool.num_kv_heads, self.kv_pool.head_dim
        tensor_cores = use_tensor_cores_for_decode(layer.num_heads, kv_heads)
        wrapper = (self._decode_wrapper(tensor_cores) if batch.mode == ForwardMode.DECODE
                   else self._prefill_wrapper())
        key = (layer.num_heads, layer.scaling, q_dtype)
        if key == self._planned:
            return wrapper
        common: dict[str, Any] = {
            "sm_scale": layer.scaling, "q_data_type": q_dtype, "kv_data_type": self.kv_pool.dtype,
        }
        if batch.mode == ForwardMode.DECODE:
            wrapper.plan(
                self.kv_indptr, self.kv_indices, self.last_page_len, layer.num_heads, kv_heads, head_dim, 1,
                **common,
            )
        else:
            wrapper.plan(
                self.qo_indptr, self.kv_indptr, self.kv_indices, self.last_page_len, layer.num_heads, kv_heads,
                head_dim, 1, causal=True, **common,
            )
        self._planned = key
        return wrapper

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        """q (T, H, D), k/v (T, KV, D) -> (T, H * D). Mutates the layer's KV cache (stores k, v)."""
        batch = self.batch
        assert batch is not None, "forward before plan"
        k_cache = self.kv_pool.k_cache[layer.layer_id]
        v_cache = self.kv_pool.v_cache[layer.layer_id]
        if k_cache.is_cuda:
            from lmserver.kernels.kv_store import store_kv

            store_kv(k, v, k_cache, v_cache, batch.out_cache_loc)
        else:
            self.kv_pool.store(layer.layer_id, batch.out_cache_loc, k, v)
        wrapper = self._plan_layer(layer, q.dtype)
        num_slots = k_cache.shape[0]
        paged = (k_cache.view(num_slots, 1, *k_cache.shape[1:]), v_cache.view(num_slots, 1, *v_cache.shape[1:]))
        out = wrapper.run(q.contiguous(), paged)  # (T, H, D)
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)  # type: ignore[no-any-return]
