"""Fresh-prompt causal attention through torch's SDPA (cuDNN's fused attention on Hopper).

A prefill batch whose requests have no cached prefix is plain causal attention per request over its own new tokens.
On the H200 (benchmarks/RESULTS.md, "lmserver kernels": `bench_prefill_attention.py`, Llama-3-8B heads, bf16)
cuDNN's kernel through `scaled_dot_product_attention(..., enable_gqa=True)` takes 290 us for a 4,096-token prompt
against 333-355 for our Triton extend kernel, 1,053 against 1,269-1,285 at 8,192, 184 against 193 for two prompts of
2,048, and loses at 1,024 (37.3 against 33.0). `use_for` is that rule; `causal_prefill` runs it.

cuDNN builds an execution plan per shape: each new prompt length cost 84 ms at the median on the H200 (1.2 s for the
first). torch's `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1` (its ragged path: plans per power-of-two length, 0.8 ms for a
new length; torch reads the variable once, at its first cuDNN attention call in the process) takes only (tokens,
heads, dim)-contiguous q / k / v: where the process sets it, views (a qkv projection's columns) are copied first,
43-70 us per layer of a 4,096-token 8B prefill, and that prefill measured 79.4 ms against 63.3 (FP8) with it: so
the server offers this path opt-in (`--attention-backend triton_cudnn`), for workloads of few prompt lengths. Each
request is viewed as (1, heads, tokens, dim) (no copy). Reference: `reference.extend_attention_ref` with
zero-length prefixes.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["AVOID_RECOMPILE", "MIN_TOKENS", "MAX_REQUESTS", "causal_prefill", "cudnn_available", "length_agnostic_plans",
           "use_for"]

AVOID_RECOMPILE = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"

MIN_TOKENS = 2048  # every request of the batch at least this long (measured: a win from 2,048, a loss at 1,024)
MAX_REQUESTS = 8  # one SDPA call per request: a batch of many prompts stays on the one-launch Triton kernel


def cudnn_available(device: torch.device) -> bool:
    """cuDNN's fused attention where it was measured: a CUDA device of compute capability 9.x (Hopper)."""
    return (device.type == "cuda" and torch.backends.cudnn.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9)


def length_agnostic_plans() -> bool:
    """Whether the process asked torch for length-agnostic cuDNN attention plans (`AVOID_RECOMPILE` = 1: a
    process-wide torch switch, read by torch at its first cuDNN attention call). Reads the environment only."""
    return os.environ.get(AVOID_RECOMPILE) == "1"


def use_for(extend_lens: list[int], prefix_lens: list[int] | None) -> bool:
    """Whether a prefill batch goes through `causal_prefill`: no cached prefix anywhere, at most `MAX_REQUESTS`
    requests, each of at least `MIN_TOKENS` new tokens. Pure."""
    return (bool(extend_lens) and len(extend_lens) <= MAX_REQUESTS and min(extend_lens) >= MIN_TOKENS
            and (prefix_lens is None or not any(prefix_lens)))


def causal_prefill(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    extend_lens: list[int],  # new tokens per request, packed one after the other in q / k / v
    sm_scale: float,
    out: torch.Tensor | None = None,  # (num_tokens, num_heads, head_dim): written when given
    backend: SDPBackend | None = SDPBackend.CUDNN_ATTENTION,
) -> torch.Tensor:
    """Causal self-attention of each request's tokens (query heads grouped over the KV heads), (num_tokens,
    num_heads, head_dim) in q's dtype. Without `out`, one request's result is SDPA's own output where that is
    already the packed layout (cuDNN allocates it in q's layout: no copy; a 4,096-token copy cost 15.6 us per layer
    on the H200), else a new tensor. `backend` None lets torch choose (the CPU's tests). Mutates `out` only."""
    if sum(extend_lens) != q.shape[0] or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"extend_lens sum to {sum(extend_lens)}, q has {q.shape[0]} rows, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    gqa = q.shape[1] != k.shape[1]
    if length_agnostic_plans():  # that path takes no views (see above)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    start = 0
    with sdpa_kernel(backend) if backend is not None else nullcontext():
        for n in extend_lens:
            rows = slice(start, start + n)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0), k[rows].transpose(0, 1).unsqueeze(0),
                v[rows].transpose(0, 1).unsqueeze(0), is_causal=True, scale=sm_scale, enable_gqa=gqa,
            ).squeeze(0).transpose(0, 1)  # (n, heads, dim)
            if out is None and len(extend_lens) == 1 and o.is_contiguous():
                return o
            if out is None:
                out = torch.empty_like(q, memory_format=torch.contiguous_format)
            out[rows].copy_(o)
            start += n
    assert out is not None
    return out

