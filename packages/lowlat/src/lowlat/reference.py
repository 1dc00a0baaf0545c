"""The generic torch-native decoder layer: the oracle every plugin is tested against.

Llama-style: RMSNorm, fused QKV, rotary embedding (rotate-half), paged KV write through a
``req_to_token`` table, grouped-query attention, o_proj + residual, RMSNorm, gate-up with
SiLU(gate) * up, down + residual. Matrix products run in the weights' dtype (as a torch model
runner would); norms, rotary embedding and softmax run in float32. FP8 weights (``LayerWeights.fp8``) are
dequantized with their row scales and multiplied in float32; an FP8 KV cache stores ``k * (1 / k_scale)``
saturated at +-448 (``quantize_kv``) and is read back times its scale.

Usable by any torch model runner: ``reference_decoder_layer`` takes the residual stream of the
step's tokens and returns the next one; it writes the new tokens' K and V into the cache.
The decode path (``meta.extend_lens is None``) has no host syncs, so it can be CUDA-graph captured.

Tensor parallelism: given this rank's shards (heads and intermediate features split, ``shape``
counting this rank's) and ``all_reduce`` (an in-place sum over the ranks), the layer sums
o_proj's and down's partial outputs before each residual add, as a row-parallel linear does;
the result equals the unsharded layer up to float summation order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from lowlat.layer import FP8_MAX, ForwardMeta, KVCache, LayerShape, LayerWeights, dequantized


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` in float32, returned in ``x.dtype``. Pure."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x`` (tokens, heads, head_dim) at ``positions``; float32 out."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # (tokens, head_dim // 2)
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` in ``w``'s dtype; FP8 ``w`` (``scale`` its rows' scales): dequantized, in float32 (float64 for a
    float64 ``x``). Returns x's dtype. Pure."""
    if scale is None:
        return F.linear(x, w)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return F.linear(x.to(compute), dequantized(w, scale, compute)).to(x.dtype)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """K or V values as a cache of ``dtype`` stores them: FP8 ``x * (1 / scale)`` in float32 (the reciprocal rounded
    to float32 once, as the kernels take it), saturated at +-448, rounded to nearest even; others ``x`` cast. Pure."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    # NOTE: a product with a Python float (rounded to float32 on CPU and CUDA alike; no device tensor: graph-safe)
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache rows -> float32 values (FP8: times ``scale``). Pure."""
    return x.float() * scale if x.dtype == torch.float8_e4m3fn else x.float()


def write_kv(kv: KVCache, k: torch.Tensor, v: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
    """Store ``k``, ``v`` (tokens, kv_heads, head_dim) at slots ``out_cache_loc`` (quantized for an FP8 cache);
    mutates ``kv``."""
    loc = out_cache_loc.long()
    kv.k[loc] = quantize_kv(k, kv.k_scale, kv.k.dtype)
    kv.v[loc] = quantize_kv(v, kv.v_scale, kv.v.dtype)


def decode_attention(q: torch.Tensor, kv: KVCache, meta: ForwardMeta, scale: float) -> torch.Tensor:
    """Attention of one query token per request over its cached tokens; float32 out. Pure.

    q: (batch, num_heads, head_dim). Gathers ``max_seq_len`` positions per request and masks the
    tail, so there is no host sync (graph-safe).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv.k.shape[1]
    group = num_heads // num_kv_heads
    max_len = meta.max_seq_len or meta.req_to_token.shape[1]
    slots = meta.req_to_token[meta.req_pool_indices.long(), :max_len].long()  # (batch, max_len)
    keys = dequantize_kv(kv.k[slots], kv.k_scale)  # (batch, max_len, kv_heads, head_dim)
    values = dequantize_kv(kv.v[slots], kv.v_scale)
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bshd->bhgs", qg, keys) * scale  # (batch, kv_heads, group, max_len)
    valid = torch.arange(max_len, device=q.device)[None, :] < meta.seq_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bshd->bhgd", probs, values)
    return out.reshape(batch, num_heads, head_dim)


def extend_attention(q: torch.Tensor, kv: KVCache, meta: ForwardMeta, scale: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cache (host loop; not graph-safe). Pure.

    q: (num_tokens, num_heads, head_dim); the new tokens' K and V must already be in the cache.
    """
    assert meta.extend_lens is not None
    num_heads = q.shape[1]
    group = num_heads // kv.k.shape[1]
    outs = []
    start = 0
    for r, (n_new, seq_len) in enumerate(zip(meta.extend_lens.tolist(), meta.seq_lens.tolist(), strict=True)):
        slots = meta.req_to_token[int(meta.req_pool_indices[r]), :seq_len].long()
        keys = dequantize_kv(kv.k[slots], kv.k_scale).repeat_interleave(group, dim=1)  # (seq_len, heads, head_dim)
        values = dequantize_kv(kv.v[slots], kv.v_scale).repeat_interleave(group, dim=1)
        qr = q[start : start + n_new].float()
        scores = torch.einsum("thd,shd->hts", qr, keys) * scale
        q_pos = torch.arange(seq_len - n_new, seq_len, device=q.device)[:, None]
        mask = torch.arange(seq_len, device=q.device)[None, :] > q_pos  # (n_new, seq_len)
        scores = scores.masked_fill(mask[None], float("-inf"))
        outs.append(torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), values))
        start += n_new
    return torch.cat(outs, dim=0)


class AttentionWeights(Protocol):
    """The attention half of a decoder layer's weights (dense ``LayerWeights`` or MoE)."""

    @property
    def input_norm(self) -> torch.Tensor: ...  # (hidden,)
    @property
    def qkv(self) -> torch.Tensor: ...  # (q_size + 2 * kv_size, hidden)
    @property
    def o_proj(self) -> torch.Tensor: ...  # (hidden, q_size)
    @property
    def rope_inv_freq(self) -> torch.Tensor: ...  # (head_dim // 2,) float32


def attention_block(
    x: torch.Tensor,  # (num_tokens, hidden)
    weights: AttentionWeights,
    kv: KVCache,
    meta: ForwardMeta,
    shape: LayerShape,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """RMSNorm, QKV, RoPE, KV write, attention, o_proj + residual; returns x1 (num_tokens, hidden), x.dtype.

    ``all_reduce`` (TP: sum over ranks, in place) is applied to o_proj's output before the add.
    Mutates ``kv`` (writes the new tokens' K and V at ``meta.out_cache_loc``); nothing else.
    """
    n = x.shape[0]
    h = rms_norm(x, weights.input_norm, shape.rms_eps)
    qkv = linear(h, weights.qkv, getattr(weights, "qkv_scale", None))
    q, k, v = qkv.split([shape.q_size, shape.kv_size, shape.kv_size], dim=-1)
    q = apply_rope(q.view(n, shape.num_heads, shape.head_dim), meta.positions, weights.rope_inv_freq)
    k = apply_rope(k.view(n, shape.num_kv_heads, shape.head_dim), meta.positions, weights.rope_inv_freq)
    q = q.to(x.dtype)
    write_kv(kv, k, v.view(n, shape.num_kv_heads, shape.head_dim), meta.out_cache_loc)
    scale = shape.head_dim**-0.5
    if meta.extend_lens is None:
        attn = decode_attention(q, kv, meta, scale)
    else:
        attn = extend_attention(q, kv, meta, scale)
    out = linear(attn.to(x.dtype).reshape(n, shape.q_size), weights.o_proj, getattr(weights, "o_proj_scale", None))
    if all_reduce is not None:
        out = all_reduce(out)
    return (x.float() + out.float()).to(x.dtype)


def reference_decoder_layer(
    x: torch.Tensor,  # (num_tokens, hidden): residual stream entering the layer
    weights: LayerWeights,
    kv: KVCache,
    meta: ForwardMeta,
    shape: LayerShape,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decoder layer; returns the residual stream leaving it (num_tokens, hidden), x.dtype.

    ``all_reduce``: TP only (see the module docstring). Mutates ``kv`` (writes the new tokens'
    K and V at ``meta.out_cache_loc``); nothing else.
    """
    x1 = attention_block(x, weights, kv, meta, shape, all_reduce)
    h2 = rms_norm(x1, weights.post_norm, shape.rms_eps)
    gate, up = linear(h2, weights.gate_up, weights.gate_up_scale).split(shape.intermediate_size, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(x.dtype)
    out = linear(act, weights.down, weights.down_scale)
    if all_reduce is not None:
        out = all_reduce(out)
    return (x1.float() + out.float()).to(x.dtype)
