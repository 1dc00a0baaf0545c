"""triton attention: paged flash-decoding for DECODE, prefix + causal extend kernel for EXTEND.

Same contract as `torch_native` (its reference): `forward` first stores the new k, v at
`batch.out_cache_loc` of its layer (Triton KV-store kernel), then attends over every slot of
each request. Kernels: `lmserver.kernels.decode_attention`, `lmserver.kernels.extend_attention`.

An FP8 KV pool: k, v are quantized by the pool's torch op (`KVPool.quantize`) and the store
kernel copies the bytes; the attention kernels read FP8 with the layer's scales; the new tokens of
an extend attend to each other's FP8-rounded K / V, as the torch_native reference does. Cascade
decode is off (its shared-prefix kernel reads no FP8 yet).

`TritonCudnnPrefillBackend` (`--attention-backend triton_cudnn`, opt-in) runs a prefill batch of fresh long prompts
(`prefill_sdpa.use_for`) through cuDNN's fused attention on Hopper instead of the extend kernel (290 vs 333 us for a
4,096-token prompt of the 8B shape on the H200), at one cuDNN plan per new prompt length (84 ms at the median):
for workloads of few distinct prompt lengths. Not the default: torch's length-agnostic plans
(`TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`, honoured where the process sets it) need contiguous copies of q / k / v
(43-70 us per layer) and left the FP8 4k prefill 79.4 ms against 63.3 in the engine (2026-12-04, RESULTS.md).
"""

from __future__ import annotations

import logging
import os

import torch

from lmserver.forward.batch import AttentionBackend, AttentionLayer, ForwardBatch, ForwardMode
from lmserver.forward.kv_pool import KVPool
from lmserver.kernels import prefill_sdpa
from lmserver.kernels.cascade_decode import CascadeMetadata, cascade_decode_attention
from lmserver.kernels.decode_attention import choose_num_kv_splits, decode_attention
from lmserver.kernels.extend_attention import extend_attention
from lmserver.kernels.kv_store import store_kv

__all__ = ["TritonBackend", "TritonCudnnPrefillBackend"]

logger = logging.getLogger(__name__)


class TritonBackend(AttentionBackend):
    """Triton kernels over the shared KV layout. Holds scratch buffers for the decode split
    reduction, keyed by (num_heads, head_dim, splits) and shared by every batch size, so
    repeated decode forwards reuse them (what a CUDA graph captures).

    A DECODE batch with `cascade` metadata (from `cascade_metadata(bs)`, one fixed-shape object
    per batch size) runs cascade decode attention: each shared prefix is read once per chunk of
    `CASCADE_CHUNK_ROWS` rows."""

    name = "triton"
    CUDNN_PREFILL = False  # fresh long prompts through cuDNN (`TritonCudnnPrefillBackend`)
    supports_cascade = True
    # an EXTEND plan reads host values only as upper bounds (`max_extend_len` sizes the grid, `has_prefix` picks the
    # kernel) and the kernel reads the real lengths on the device: prefill graphs (runner/prefill_graph.py)
    supports_extend_graph = True
    CASCADE_CHUNK_ROWS = 16  # rows of a group per shared-prefix program (x GQA group = its tl.dot M)
    CASCADE_SHARED_SPLITS = 8  # at most this many splits of a shared prefix
    CASCADE_PROGRAMS_PER_SM = 2  # shared-prefix programs aimed at, per multiprocessor

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
        self._scratch: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._outgrown: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._cascade_meta: dict[int, CascadeMetadata] = {}
        self.cascade: CascadeMetadata | None = None
        self.extend_has_prefix = True  # set by each extend `plan`: False when no request has a cached prefix
        # fresh long prompts through cuDNN's fused attention (`prefill_sdpa`): the opt-in subclass only
        self.cudnn_prefill = self.CUDNN_PREFILL and prefill_sdpa.cudnn_available(device)
        self.extend_sdpa = False  # set by each `plan`: True for an extend batch that `prefill_sdpa.use_for` takes
        if kv_pool.is_fp8:
            self.supports_cascade = False  # NOTE: the instance's value: ModelRunner.enable_cascade reads it

    def cascade_metadata(self, bs: int) -> CascadeMetadata:
        """The cascade metadata of batch size `bs` (made once, then the same object: a CUDA graph
        of that size reads it; `write` it before each replay). Mutates the cache of them."""
        meta = self._cascade_meta.get(bs)
        if meta is None:
            kv_heads = self.kv_pool.num_kv_heads
            target = -(-self.CASCADE_PROGRAMS_PER_SM * self.num_sms // kv_heads)
            # NOTE: chunks of >= 2 rows: at most 2 * bs / 3 of them (groups of 3 with chunk_rows 2)
            meta = CascadeMetadata(bs, max(-(-2 * bs // 3), target), self.CASCADE_SHARED_SPLITS,
                                   self.CASCADE_CHUNK_ROWS, self.req_to_token.device, target_work=target)
            self._cascade_meta[bs] = meta
        return meta

    def plan(self, batch: ForwardBatch) -> None:
        """Chooses the decode split count or the extend grid size; mutates only self."""
        self.batch = batch
        self.cascade = batch.cascade if batch.mode == ForwardMode.DECODE else None
        self.extend_sdpa = False
        if batch.mode == ForwardMode.DECODE:
            self.num_kv_splits = choose_num_kv_splits(batch.batch_size, self.kv_pool.num_kv_heads, self.num_sms)
            return
        assert batch.extend_seq_lens_cpu is not None, "EXTEND batch without extend_seq_lens_cpu"
        self.max_extend_len = max(batch.extend_seq_lens_cpu, default=0)
        # NOTE: no cached prefix anywhere in the batch: the extend kernel reads no cache (with an FP8 cache, the
        # kernel of a model-dtype one: `extend_attention`'s has_prefix)
        prefixes = batch.extend_prefix_lens_cpu
        self.extend_has_prefix = prefixes is None or any(prefixes)
        self.extend_sdpa = self.cudnn_prefill and prefill_sdpa.use_for(batch.extend_seq_lens_cpu, prefixes)

    def _decode_scratch(self, bs: int, num_heads: int, head_dim: int, device: torch.device,
                        splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: one buffer per (heads, head_dim, splits) for every batch size (views [:bs]): the
        # forwards of a stream, CUDA-graph replays included, never overlap. A buffer outgrown by
        # a larger batch is kept alive, since a captured graph may read it.
        key = (num_heads, head_dim, splits)
        have = self._scratch.get(key)
        if have is None or have[0].shape[0] < bs:
            if have is not None:
                self._outgrown.append(have)
            have = (
                torch.empty(bs, num_heads, splits, head_dim, dtype=torch.float32, device=device),
                torch.empty(bs, num_heads, splits, dtype=torch.float32, device=device),
            )
            self._scratch[key] = have
        return have[0][:bs], have[1][:bs]

    def _cudnn_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                       layer: AttentionLayer) -> torch.Tensor | None:
        """A fresh prefill's attention (T, H, D) through `prefill_sdpa`; None (and cuDNN off for this backend, said
        once in the log) where torch refuses the call (no cuDNN kernel for these inputs): the caller runs the Triton
        kernel."""
        assert batch.extend_seq_lens_cpu is not None
        try:
            return prefill_sdpa.causal_prefill(q, k, v, batch.extend_seq_lens_cpu, layer.scaling)
        except RuntimeError as exc:
            logger.warning("cuDNN prefill attention refused (%s); extends use the Triton kernel from now on",
                           str(exc).splitlines()[0][:200])
            self.cudnn_prefill = self.extend_sdpa = False
            return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        """q (T, H, D), k/v (T, KV, D) -> (T, H * D). Mutates the layer's KV cache (stores k, v)."""
        batch = self.batch
        k_cache = self.kv_pool.k_cache[layer.layer_id]
        v_cache = self.kv_pool.v_cache[layer.layer_id]
        pool, lid = self.kv_pool, layer.layer_id
        k_scale, v_scale = (pool.k_scale[lid], pool.v_scale[lid]) if pool.is_fp8 else (1.0, 1.0)
        if pool.is_fp8 and batch.mode == ForwardMode.DECODE and k.is_cuda:  # quantized inside the store (one launch)
            # NOTE: on the GPU only: Triton's interpreter narrows to e4m3 without a rounded-up mantissa's carry
            store_kv(k, v, k_cache, v_cache, batch.out_cache_loc, k_scale=k_scale, v_scale=v_scale)
        elif pool.is_fp8 and k.is_cuda:  # extend attends to the new tokens as the cache holds them: one launch
            k_held, v_held = (torch.empty(k.shape, dtype=q.dtype, device=k.device) for _ in range(2))
            store_kv(k, v, k_cache, v_cache, batch.out_cache_loc, k_scale=k_scale, v_scale=v_scale,
                     k_out=k_held, v_out=v_held)
            k, v = k_held, v_held
        elif pool.is_fp8:  # the same in torch ops (the interpreter's e4m3 narrowing differs, see above)
            kq, vq = pool.quantize(lid, k, v)
            store_kv(kq, vq, k_cache, v_cache, batch.out_cache_loc)
            k, v = pool.dequantize_k(lid, kq, q.dtype), pool.dequantize_v(lid, vq, q.dtype)
        else:
            store_kv(k, v, k_cache, v_cache, batch.out_cache_loc)
        num_tokens = q.shape[0]
        if self.extend_sdpa:  # an extend of fresh long prompts (`plan`)
            sdpa_out = self._cudnn_prefill(q, k, v, batch, layer)
            if sdpa_out is not None:
                return sdpa_out.reshape(num_tokens, layer.num_heads * layer.head_dim)
        out = torch.empty(num_tokens, layer.num_heads, layer.head_dim, dtype=q.dtype, device=q.device)
        if batch.mode == ForwardMode.DECODE and self.cascade is not None:
            splits = self.cascade.num_shared_splits + self.num_kv_splits
            part_out, part_lse = self._decode_scratch(batch.batch_size, layer.num_heads, layer.head_dim, q.device, splits)
            cascade_decode_attention(
                q, k_cache, v_cache, self.req_to_token, batch.req_pool_indices, batch.seq_lens, layer.scaling,
                self.cascade, out=out, num_kv_splits=self.num_kv_splits, partial_out=part_out, partial_lse=part_lse,
                block_n=64 if q.is_cuda else 16, suffix_block_n=128 if q.is_cuda else 16,
            )
        elif batch.mode == ForwardMode.DECODE:
            part_out, part_lse = self._decode_scratch(batch.batch_size, layer.num_heads, layer.head_dim, q.device,
                                                      self.num_kv_splits)
            decode_attention(
                q, k_cache, v_cache, self.req_to_token, batch.req_pool_indices, batch.seq_lens, layer.scaling,
                out=out, num_kv_splits=self.num_kv_splits, partial_out=part_out, partial_lse=part_lse,
                block_n=128 if q.is_cuda else 16, k_scale=k_scale, v_scale=v_scale,
            )
        else:
            assert batch.extend_prefix_lens is not None and batch.extend_seq_lens is not None
            assert batch.extend_start_loc is not None
            extend_attention(
                q, k, v, k_cache, v_cache, self.req_to_token, batch.req_pool_indices, batch.extend_prefix_lens,
                batch.extend_seq_lens, batch.extend_start_loc, layer.scaling, self.max_extend_len, out=out,
                k_scale=k_scale, v_scale=v_scale, has_prefix=self.extend_has_prefix,
            )
        return out.reshape(num_tokens, layer.num_heads * layer.head_dim)


class TritonCudnnPrefillBackend(TritonBackend):
    """`TritonBackend` with fresh prompts of >= `prefill_sdpa.MIN_TOKENS` tokens through cuDNN's fused attention on
    Hopper (elsewhere the same as `triton`): one cuDNN plan per new prompt length, see the module's docstring."""

    name = "triton_cudnn"
    CUDNN_PREFILL = True
    supports_extend_graph = False  # cuDNN plans per prompt length on the host

