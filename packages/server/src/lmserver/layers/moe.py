"""Mixture-of-experts MLP (Mixtral style): softmax router, top-k, renormalized weights.

The torch-native path here is the reference for fused GPU MoE kernels. It runs each expert on the
tokens that chose it, which needs the chosen experts on the host (a sync, data-dependent shapes), so
it cannot be captured in a CUDA graph; under capture (decode graphs) ``moe_forward_dense`` runs
instead: every expert on every token, weighted 0 where the token did not choose it, which reads
every expert's weights each step. With the Triton kernels (`KernelOps.fused_moe`, any CUDA model in
a kernel dtype) both are replaced by `lmserver.kernels.fused_moe`: no host sync, and only the
chosen experts' weights are read.

FP8 (e4m3) experts (`MoE.use_fp8_` from a checkpoint, `MoE.quantize_fp8_` online): ``w13`` (E, 2 * inter,
hidden) and ``w2`` (E, hidden, inter) float8_e4m3fn, with float32 scales

- per row (``group_k`` None): ``w13_scale`` (E, 2 * inter), ``w2_scale`` (E, hidden); W = w * scale[..., None]
  (a checkpoint's per-tensor scales are expanded to its rows);
- per (``group_n`` rows, ``group_k`` columns) block (128 x 128 checkpoints): ``w13_scale`` (E, ceil(2 * inter /
  group_n), ceil(hidden / group_k)), ``w2_scale`` (E, ceil(hidden / group_n), ceil(inter / group_k)).

The torch paths dequantize each expert they run to the activation dtype (the reference, and the CPU path);
the fused kernels read the FP8 bytes. The router (``gate``) stays in the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmserver.kernels.dispatch import KernelOps
from lmserver.kernels.fp8_ref import FP8_DTYPE, FP8_MAX, dequantize_fp8, expand_block_scale, quantize_fp8
from lmserver.kernels.reference import route
from lmserver.layers.activation import silu_and_mul

__all__ = ["MoE", "dequantize_experts", "moe_forward_dense", "moe_forward_native", "quantize_experts"]

_MIN_SCALE = 1e-12  # an all-zero block's scale, as `fp8_ref.quantize_fp8` gives an all-zero row
ExpertScales = tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]  # (w13_scale, w2_scale, block or None)


def quantize_experts(w: torch.Tensor, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) expert weights -> (float8_e4m3fn (E, N, K), float32 scales): one scale per row (E, N) for `block`
    None (`fp8_ref.quantize_fp8`, one expert at a time: a float32 copy of one expert at most), else one per
    (rows, columns) block (E, ceil(N / rows), ceil(K / columns)) as block-scaled checkpoints hold them; each scale
    its row's / block's absolute maximum / 448. Pure."""
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    if block is None:
        scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
        for e in range(w.shape[0]):
            qe, se = quantize_fp8(w[e])
            q[e].copy_(qe)
            scale[e].copy_(se[:, 0])
        return q, scale
    _, n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    scale = torch.empty(w.shape[0], nb, kb, dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        padded = F.pad(w[e].float(), (0, kb * bk - k, 0, nb * bn - n))
        scale[e] = (padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(_MIN_SCALE)
        full = scale[e].repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q[e].copy_((w[e].float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
    return q, scale


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """FP8 weights of one expert (N, K) or of several (E, N, K) with their scales in the `MoE` layout (module
    docstring) -> `dtype`, computed in float32 (float64 for a float64 `dtype`): `fp8_ref.dequantize_fp8` of each
    expert (block scales: their rows expanded by `fp8_ref.expand_block_scale`). Pure."""
    if w.dim() == 3:
        return torch.stack([dequantize_experts(w[e], scale[e], block, dtype) for e in range(w.shape[0])])
    if block is None:
        return dequantize_fp8(w, scale[:, None], w.shape[1], dtype)
    bn, bk = block
    return dequantize_fp8(w, expand_block_scale(scale, w.shape[0], bn), bk, dtype)


def _expert(w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None, e: int,
            dtype: torch.dtype) -> torch.Tensor:
    return w[e] if scale is None else dequantize_experts(w[e], scale[e], block, dtype)


def moe_forward_native(
    x: torch.Tensor,  # (T, hidden)
    router_logits: torch.Tensor,  # (T, num_experts)
    w13: torch.Tensor,  # (E, 2 * inter, hidden): gate rows then up rows
    w2: torch.Tensor,  # (E, hidden, inter)
    top_k: int,
    renormalize: bool = True,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """Routes each token to its top-k experts and sums their gated outputs; returns (T, hidden). ``scales``:
    (w13_scale, w2_scale, block) of FP8 experts, each chosen expert dequantized to x's dtype."""
    s13, s2, block = scales or (None, None, None)
    weights, experts = route(router_logits, top_k, renormalize, x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        token_idx, slot = torch.nonzero(experts == e, as_tuple=True)
        h = act(x[token_idx] @ _expert(w13, s13, block, e, x.dtype).t()) @ _expert(w2, s2, block, e, x.dtype).t()
        out.index_add_(0, token_idx, h * weights[token_idx, slot].unsqueeze(-1))
    return out


def moe_forward_dense(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """``moe_forward_native``'s result with no host sync and no data-dependent shape (CUDA-graph safe): every
    expert runs on every token and is weighted by the token's routing weight for it, 0 if not chosen."""
    s13, s2, block = scales or (None, None, None)
    weights, experts = route(router_logits, top_k, renormalize, x.dtype)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        w_e = (weights * (experts == e)).sum(dim=-1, keepdim=True)  # (T, 1): one non-zero term at most
        out += (act(x @ _expert(w13, s13, block, e, x.dtype).t()) @ _expert(w2, s2, block, e, x.dtype).t()) * w_e
    return out


class MoE(nn.Module):
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # FP8 experts (module docstring): buffers, not parameters (the model's weight loader fills parameters only;
        # the FP8 loader fills and checks the scales, lmserver.models.quantization)
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)
        self.group_n: int | None = None  # block-scaled FP8: rows and columns per scale block; None: per-row scales
        self.group_k: int | None = None
        self.kernels: KernelOps | None = None  # None: torch ops; set once at model build

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale is not None

    @property
    def scale_block(self) -> tuple[int, int] | None:
        """(group_n, group_k) of block-scaled FP8 experts, else None."""
        return None if self.group_k is None or self.group_n is None else (self.group_n, self.group_k)

    def use_fp8_(self, block: tuple[int, int] | None = None) -> None:
        """Makes the experts FP8 and empty, for an FP8 checkpoint to fill (`block`: (group_n, group_k) of block
        scales, None: per-row). Scales start at 0, so a row a checkpoint leaves out stays visibly unloaded.
        Mutates self."""
        dev = self.w13.device
        e, two_inter, hidden = self.w13.shape
        self.w13 = nn.Parameter(torch.empty(self.w13.shape, dtype=FP8_DTYPE, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.w2.shape, dtype=FP8_DTYPE, device=dev), requires_grad=False)
        shapes: tuple[tuple[int, ...], tuple[int, ...]]
        if block is None:
            shapes = ((e, two_inter), (e, hidden))
        else:
            bn, bk = block
            shapes = ((e, -(-two_inter // bn), -(-hidden // bk)), (e, -(-hidden // bn), -(-(two_inter // 2) // bk)))
        self.w13_scale = torch.zeros(shapes[0], dtype=torch.float32, device=dev)
        self.w2_scale = torch.zeros(shapes[1], dtype=torch.float32, device=dev)
        self.group_n, self.group_k = block if block is not None else (None, None)

    def quantize_fp8_(self) -> None:
        """Online FP8: the model-dtype experts quantized per row (absolute maximum / 448). Mutates self."""
        if self.is_fp8:
            raise ValueError("the experts are FP8 already")
        with torch.no_grad():
            q13, s13 = quantize_experts(self.w13.data)
            q2, s2 = quantize_experts(self.w2.data)
        self.w13 = nn.Parameter(q13, requires_grad=False)
        self.w2 = nn.Parameter(q2, requires_grad=False)
        self.w13_scale, self.w2_scale = s13, s2
        self.group_n = self.group_k = None

    def extra_repr(self) -> str:
        fp8 = "" if not self.is_fp8 else f", fp8={'per-row' if self.scale_block is None else self.scale_block}"
        return f"experts={self.num_experts}, top_k={self.top_k}, inter={self.intermediate_size}{fp8}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); no state is mutated."""
        scales: ExpertScales | None = None
        if self.w13_scale is not None and self.w2_scale is not None:
            scales = (self.w13_scale, self.w2_scale, self.scale_block)
        if self.kernels is not None and self.kernels.fused_moe is not None:
            if scales is None:
                return self.kernels.fused_moe(x, self.gate(x), self.w13, self.w2, self.top_k)
            return self.kernels.fused_moe(x, self.gate(x), self.w13, self.w2, self.top_k, w13_scale=scales[0],
                                          w2_scale=scales[1], scale_block=scales[2])
        act = silu_and_mul if self.kernels is None else self.kernels.silu_and_mul
        forward = moe_forward_dense if x.is_cuda and torch.cuda.is_current_stream_capturing() else moe_forward_native
        return forward(x, self.gate(x), self.w13, self.w2, self.top_k, act=act, scales=scales)
