"""Mixture-of-experts decoder layer (Mixtral style): data types and the torch-native reference.

The router is a softmax over the experts' logits, each token keeps its ``top_k`` experts and
their probabilities renormalized to sum to one; an expert is ``down(silu(gate) * up)``. The
attention half is the dense layer's (``lowlat.reference``). The reference is the oracle of the
``nvidia`` plugin's MoE kernels (``lowlat.kernels.moe``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from lowlat.errors import ShapeError
from lowlat.layer import FP8_DTYPE, ForwardMeta, KVCache, LayerShape, dequantized, quantize_rows_fp8
from lowlat.reference import attention_block, linear, rms_norm


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
    """One MoE decoder layer's weights (torch ``Linear`` layout ``(out_features, in_features)``).

    FP8: ``qkv``, ``o_proj``, ``w13`` and ``w2`` in ``float8_e4m3fn`` with float32 per-output-row scales (all four or
    none; ``W = w * scale[..., None]``); ``router`` and the norms stay in the model dtype."""

    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # (q_size + 2 * kv_size, hidden)
    o_proj: torch.Tensor  # (hidden, q_size)
    post_norm: torch.Tensor  # (hidden,)
    router: torch.Tensor  # (num_experts, hidden)
    w13: torch.Tensor  # (num_experts, 2 * expert_inter, hidden): gate rows, then up rows
    w2: torch.Tensor  # (num_experts, hidden, expert_inter)
    rope_inv_freq: torch.Tensor  # (head_dim // 2,) float32
    qkv_scale: torch.Tensor | None = None  # (q_size + 2 * kv_size,) float32
    o_proj_scale: torch.Tensor | None = None  # (hidden,) float32
    w13_scale: torch.Tensor | None = None  # (num_experts, 2 * expert_inter) float32
    w2_scale: torch.Tensor | None = None  # (num_experts, hidden) float32

    @property
    def fp8(self) -> bool:
        """Whether the projections and experts hold FP8 (e4m3) weights with per-row scales."""
        return self.w13.dtype == FP8_DTYPE

    def validate(self, shape: LayerShape, moe: MoEShape) -> None:
        """Raise ``ShapeError`` when a tensor does not match the shapes (FP8: ``qkv``, ``o_proj``, ``w13``, ``w2`` all
        FP8, each with float32 per-row scales of its output rows). Reads only."""
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
        if self.router.dtype == FP8_DTYPE:
            raise ShapeError("MoELayerWeights.router must stay in the model dtype (FP8 layers quantize the projections "
                             "and experts only)")
        for name in MOE_PROJECTIONS:
            w, scale = getattr(self, name), getattr(self, f"{name}_scale")
            if (w.dtype == FP8_DTYPE) != self.fp8:
                raise ShapeError(f"MoELayerWeights.{name} is {w.dtype}: FP8 weights need qkv, o_proj, w13 and w2 all "
                                 "in FP8")
            if not self.fp8:
                if scale is not None:
                    raise ShapeError(f"MoELayerWeights.{name}_scale is for FP8 weights, {name} is {w.dtype}")
                continue
            want_s = tuple(w.shape[:-1])
            if scale is None or tuple(scale.shape) != want_s or scale.dtype != torch.float32:
                found = None if scale is None else (scale.dtype, tuple(scale.shape))
                raise ShapeError(f"MoELayerWeights.{name}_scale must be float32 {want_s} per-row scales of the FP8 "
                                 f"weight, got {found}")


MOE_PROJECTIONS = ("qkv", "o_proj", "w13", "w2")


def quantize_moe_layer_fp8(weights: MoELayerWeights) -> MoELayerWeights:
    """``weights`` with qkv, o_proj and every expert's w13 / w2 quantized to FP8 per output row
    (``lowlat.layer.quantize_rows_fp8``); router, norms and rotary table kept. Pure."""
    fields: dict[str, torch.Tensor] = {}
    for name in MOE_PROJECTIONS:
        w = getattr(weights, name)
        q, scale = quantize_rows_fp8(w.reshape(-1, w.shape[-1]))
        fields[name], fields[f"{name}_scale"] = q.view(w.shape), scale.view(w.shape[:-1])
    return replace(weights, **fields)


def dequantized_experts(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Experts' (E, N, K) weights in ``dtype``: FP8 times their row scales (``lowlat.layer.dequantized`` per expert),
    else ``w`` as it is. Pure."""
    if scale is None:
        return w
    return dequantized(w.reshape(-1, w.shape[-1]), scale.reshape(-1), dtype).view(w.shape)


def route(h: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router, top-k, renormalized. Returns (weights float32, expert ids int64), (T, top_k). Pure."""
    logits = F.linear(h, router)  # (T, E) in the weights' dtype, as a torch runner computes it
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def reference_moe(h: torch.Tensor, w: MoELayerWeights, moe: MoEShape) -> torch.Tensor:
    """The routed expert MLP of the normed stream ``h`` (T, hidden); float32 (T, hidden) out (float64 for a float64
    ``h``). FP8 experts: dequantized with their row scales, products in float32 (``lowlat.reference.linear``). Pure."""
    weights, experts = route(h.to(w.router.dtype), w.router, moe.top_k)  # as the model routes (its dtype)
    out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float64 if h.dtype == torch.float64 else torch.float32,
                      device=h.device)
    s13, s2 = w.w13_scale, w.w2_scale
    for e in torch.unique(experts).tolist():
        tok, slot = torch.nonzero(experts == e, as_tuple=True)
        gu = linear(h[tok], w.w13[e].to(h.dtype) if s13 is None else w.w13[e], None if s13 is None else s13[e])
        gate, up = gu.split(moe.expert_intermediate_size, dim=-1)
        act = (F.silu(gate.to(out.dtype)) * up.to(out.dtype)).to(h.dtype)
        y = linear(act, w.w2[e].to(h.dtype) if s2 is None else w.w2[e], None if s2 is None else s2[e])
        out.index_add_(0, tok, y.to(out.dtype) * weights[tok, slot, None].to(out.dtype))
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
