"""Mixture-of-experts decoder layer (Mixtral style): data types and the torch-native reference.

The router is a softmax over the experts' logits, each token keeps its ``top_k`` experts and
their probabilities renormalized to sum to one; an expert is ``down(silu(gate) * up)``. The
attention half is the dense layer's (``lowlat.reference``). The reference is the oracle of the
``nvidia`` plugin's MoE kernels (``lowlat.kernels.moe``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowlat.errors import ShapeError
from lowlat.layer import ForwardMeta, KVCache, LayerShape
from lowlat.reference import attention_block, rms_norm


@dataclass(frozen=True)
class MoEShape:
    """Sizes of the MoE MLP of one decoder layer; the attention half is ``LayerShape``."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ShapeError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.expert_intermediate_size < 1:
            raise ShapeError(f"expert_intermediate_size must be positive, got {self.expert_intermediate_size}")


@dataclass(frozen=True)
class MoELayerWeights:
    """One MoE decoder layer's weights (torch ``Linear`` layout ``(out_features, in_features)``)."""

    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # (q_size + 2 * kv_size, hidden)
    o_proj: torch.Tensor  # (hidden, q_size)
    post_norm: torch.Tensor  # (hidden,)
    router: torch.Tensor  # (num_experts, hidden)
    w13: torch.Tensor  # (num_experts, 2 * expert_inter, hidden): gate rows, then up rows
    w2: torch.Tensor  # (num_experts, hidden, expert_inter)
    rope_inv_freq: torch.Tensor  # (head_dim // 2,) float32

    def validate(self, shape: LayerShape, moe: MoEShape) -> None:
        """Raise ``ShapeError`` when a tensor does not match the shapes. Reads only."""
        h, e, i = shape.hidden_size, moe.num_experts, moe.expert_intermediate_size
        expect = {
            "input_norm": (h,),
            "qkv": (shape.qkv_size, h),
            "o_proj": (h, shape.q_size),
            "post_norm": (h,),
            "router": (e, h),
            "w13": (e, 2 * i, h),
            "w2": (e, h, i),
            "rope_inv_freq": (shape.head_dim // 2,),
        }
        for name, want in expect.items():
            got = tuple(getattr(self, name).shape)
            if got != want:
                raise ShapeError(f"MoELayerWeights.{name} has shape {got}, expected {want}")


def route(h: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router, top-k, renormalized. Returns (weights float32, expert ids int64), (T, top_k). Pure."""
    logits = F.linear(h, router)  # (T, E) in the weights' dtype, as a torch runner computes it
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def reference_moe(h: torch.Tensor, w: MoELayerWeights, moe: MoEShape) -> torch.Tensor:
    """The routed expert MLP of the normed stream ``h`` (T, hidden); float32 (T, hidden) out. Pure."""
    weights, experts = route(h, w.router, moe.top_k)
    out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
    for e in torch.unique(experts).tolist():
        tok, slot = torch.nonzero(experts == e, as_tuple=True)
        gate, up = F.linear(h[tok], w.w13[e]).split(moe.expert_intermediate_size, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(h.dtype)
        out.index_add_(0, tok, F.linear(act, w.w2[e]).float() * weights[tok, slot, None])
    return out


def reference_moe_decoder_layer(
    x: torch.Tensor,  # (num_tokens, hidden): residual stream entering the layer
    weights: MoELayerWeights,
    kv: KVCache,
    meta: ForwardMeta,
    shape: LayerShape,
    moe: MoEShape,
) -> torch.Tensor:
    """One MoE decoder layer; returns the residual stream leaving it (num_tokens, hidden), x.dtype.

    Mutates ``kv`` (writes the new tokens' K and V at ``meta.out_cache_loc``); nothing else.
    """
    x1 = attention_block(x, weights, kv, meta, shape)
    h2 = rms_norm(x1, weights.post_norm, shape.rms_eps)
    return (x1.float() + reference_moe(h2, weights, moe)).to(x.dtype)
