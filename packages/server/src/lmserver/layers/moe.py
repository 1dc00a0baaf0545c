"""Mixture-of-experts MLP (Mixtral style): softmax router, top-k, renormalized weights.

The torch-native path here is the reference for fused GPU MoE kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmserver.kernels.dispatch import KernelOps
from lmserver.layers.activation import silu_and_mul


def moe_forward_native(
    x: torch.Tensor,  # (T, hidden)
    router_logits: torch.Tensor,  # (T, num_experts)
    w13: torch.Tensor,  # (E, 2 * inter, hidden): gate rows then up rows
    w2: torch.Tensor,  # (E, hidden, inter)
    top_k: int,
    renormalize: bool = True,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """Routes each token to its top-k experts and sums their gated outputs; returns (T, hidden)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # (T, top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        token_idx, slot = torch.nonzero(experts == e, as_tuple=True)
        h = act(x[token_idx] @ w13[e].t()) @ w2[e].t()
        out.index_add_(0, token_idx, h * weights[token_idx, slot].unsqueeze(-1))
    return out


class MoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.kernels: KernelOps | None = None  # None: torch ops; set once at model build

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); no state is mutated."""
        act = silu_and_mul if self.kernels is None else self.kernels.silu_and_mul
        return moe_forward_native(x, self.gate(x), self.w13, self.w2, self.top_k, act=act)
