"""Torch-native references of every kernel in `lmserver.kernels`: the test oracles.

Each function computes in float32 (elementwise kernels, rounding where Hugging Face's Llama
rounds, so that greedy outputs match it) or float64 (attention), on any device, with the same
argument contract as its Triton twin. They are also the CPU path of the engine.

Shapes follow the KV layout shared with the engine: per layer `k_cache`, `v_cache` of shape
(num_slots, num_kv_heads, head_dim), slot 0 is padding; `req_to_token`
(max_running_requests, max_context_len) int32 holds the slot of each token of each request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "apply_token_bitmask_ref",
    "decode_attention_ref",
    "extend_attention_ref",
    "fused_add_rmsnorm_ref",
    "rmsnorm_ref",
    "rope_ref",
    "silu_and_mul_ref",
    "store_kv_ref",
    "top_k_top_p_min_p_probs_ref",
]


def _attend(
    q: torch.Tensor,  # (num_q, num_heads, head_dim)
    k: torch.Tensor,  # (num_k, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_k, num_kv_heads, head_dim)
    sm_scale: float,
    mask: torch.Tensor | None,  # (num_q, num_k) bool, True = attend
) -> torch.Tensor:  # (num_q, num_heads, head_dim) float64
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * sm_scale
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def decode_attention_ref(
    q: torch.Tensor,  # (bs, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    req_to_token: torch.Tensor,  # (max_running_requests, max_context_len) int32
    req_pool_indices: torch.Tensor,  # (bs,)
    seq_lens: torch.Tensor,  # (bs,) including the new token
    sm_scale: float,
) -> torch.Tensor:  # (bs, num_heads, head_dim), dtype of q
    """Paged decode attention: each query attends to all `seq_lens[b]` cached tokens of its request.

    Mutates nothing.
    """
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        slots = req_to_token[int(req_pool_indices[b]), : int(seq_lens[b])].long()
        out[b] = _attend(q[b : b + 1], k_cache[slots], v_cache[slots], sm_scale, None)[0].to(q.dtype)
    return out


def extend_attention_ref(
    q: torch.Tensor,  # (num_new_tokens, num_heads, head_dim)
    k_extend: torch.Tensor,  # (num_new_tokens, num_kv_heads, head_dim)
    v_extend: torch.Tensor,  # (num_new_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    req_to_token: torch.Tensor,  # (max_running_requests, max_context_len) int32
    req_pool_indices: torch.Tensor,  # (bs,)
    extend_prefix_lens: torch.Tensor,  # (bs,)
    extend_seq_lens: torch.Tensor,  # (bs,) new tokens per request
    extend_start_loc: torch.Tensor,  # (bs,) first row of each request in q
    sm_scale: float,
) -> torch.Tensor:  # (num_new_tokens, num_heads, head_dim), dtype of q
    """Extend (chunked prefill) attention: the new tokens of request b attend to its
    `extend_prefix_lens[b]` cached tokens (read through `req_to_token`) and causally to
    themselves (read from `k_extend`, `v_extend`). Mutates nothing.
    """
    out = torch.empty_like(q)
    for b in range(req_pool_indices.shape[0]):
        prefix, n, start = int(extend_prefix_lens[b]), int(extend_seq_lens[b]), int(extend_start_loc[b])
        if n == 0:
            continue
        slots = req_to_token[int(req_pool_indices[b]), :prefix].long()
        k = torch.cat([k_cache[slots], k_extend[start : start + n]])
        v = torch.cat([v_cache[slots], v_extend[start : start + n]])
        q_pos = prefix + torch.arange(n, device=q.device)
        mask = torch.arange(prefix + n, device=q.device)[None, :] <= q_pos[:, None]
        out[start : start + n] = _attend(q[start : start + n], k, v, sm_scale, mask).to(q.dtype)
    return out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face's Llama computes it (normalize in float32, round to x's dtype,
    then multiply by the weight). x: (num_tokens, hidden). Mutates nothing."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual), the sum rounded to x's dtype first as Hugging
    Face's Llama does. Mutates nothing (the Triton kernel writes both results in place)."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_ref(summed, weight, eps), summed


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for x of shape (num_tokens, 2 * d); silu is rounded to x's
    dtype before the product, as `act_fn(gate) * up` does in Hugging Face. Mutates nothing."""
    d = x.shape[-1] // 2
    gate = torch.nn.functional.silu(x[..., :d].float()).to(x.dtype)
    return (gate.float() * x[..., d:].float()).to(x.dtype)


def rope_ref(
    positions: torch.Tensor,  # (num_tokens,)
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, rotary_dim) float32: [cos | sin] halves
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding on the first `rotary_dim` channels of each
    head, as Hugging Face's Llama applies it, rounding included: cos and sin cast to x's dtype,
    `x * cos + rotate_half(x) * sin` computed in that dtype. Returns new q, k; mutates nothing."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # (num_tokens, rotary_dim / 2)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)

    return rotate(q), rotate(k)


def store_kv_ref(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    loc: torch.Tensor,  # (num_tokens,) slot ids
) -> None:
    """Scatter the new tokens' keys and values into their slots. Mutates k_cache, v_cache."""
    k_cache[loc.long()] = k.to(k_cache.dtype)
    v_cache[loc.long()] = v.to(v_cache.dtype)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (bs, vocab) with every token whose bit is 0 set to -inf; bitmask (bs, ceil(vocab /
    32)) int32, bit i of word w allows token 32 * w + i. Returns a new tensor; mutates nothing."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32)[:, :, None] >> shifts) & 1  # (bs, words, 32)
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # a vocab padded past the mask: the extra tokens are disallowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def top_k_top_p_min_p_probs_ref(
    logits: torch.Tensor,  # (bs, vocab)
    temperatures: torch.Tensor,  # (bs,) > 0
    top_ks: torch.Tensor,  # (bs,) int, >= vocab (or <= 0) disables
    top_ps: torch.Tensor,  # (bs,) in (0, 1], 1 disables
    min_ps: torch.Tensor,  # (bs,) in [0, 1), 0 disables
) -> torch.Tensor:  # (bs, vocab) float32, rows sum to 1
    """Sampling distribution after temperature, top-k, top-p and min-p, renormalized.

    Sort based: keeps the k most probable tokens, the smallest set of most probable tokens whose
    mass reaches top_p (the token that crosses it included), and tokens with probability at
    least min_p times the largest, all measured on the softmax before filtering (SGLang's
    order). Mutates nothing.
    """
    probs = torch.softmax(logits.float() / temperatures.float()[:, None], dim=-1)
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    ks = torch.where(top_ks <= 0, vocab, top_ks.clamp(max=vocab)).to(probs.device)
    keep = rank < ks[:, None]
    mass_before = sorted_probs.double().cumsum(-1) - sorted_probs.double()
    keep &= (mass_before < top_ps.double()[:, None]) | (top_ps[:, None] >= 1)
    keep &= sorted_probs >= min_ps.float()[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True
    filtered = torch.zeros_like(probs).scatter(1, order, sorted_probs * keep)
    return filtered / filtered.sum(-1, keepdim=True)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, top_k) in ``dtype``, expert ids (T, top_k)): softmax, top-k, optionally renormalized."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), experts
