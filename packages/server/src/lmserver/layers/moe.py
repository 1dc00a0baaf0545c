"""Mixture-of-experts MLP (Mixtral style): softmax router, top-k, renormalized weights.

The torch-native path here is the reference for fused GPU MoE kernels. It runs each expert on the
tokens that chose it, which needs the chosen experts on the host (a sync, data-dependent shapes), so
it cannot be captured in a CUDA graph; under capture (decode graphs) ``moe_forward_dense`` runs
instead: every expert on every token, weighted 0 where the token did not choose it, which reads
every expert's weights each step. With the Triton kernels (`KernelOps.fused_moe`, any CUDA model in
a kernel dtype) both are replaced by `lmserver.kernels.fused_moe`: no host sync, and only the
chosen experts' weights are read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmserver.kernels.dispatch import KernelOps
from lmserver.kernels.reference import route
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
    weights, experts = route(router_logits, top_k, renormalize, x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        token_idx, slot = torch.nonzero(experts == e, as_tuple=True)
        h = act(x[token_idx] @ w13[e].t()) @ w2[e].t()
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
) -> torch.Tensor:
    """``moe_forward_native``'s result with no host sync and no data-dependent shape (CUDA-graph safe): every
    expert runs on every token and is weighted by the token's routing weight for it, 0 if not chosen."""
    weights, experts = route(router_logits, top_k, renormalize, x.dtype)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        w_e = (weights * (experts == e)).sum(dim=-1, keepdim=True)  # (T, 1): one non-zero term at most
        out += (act(x @ w13[e].t()) @ w2[e].t()) * w_e
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
        if self.kernels is not None and self.kernels.fused_moe is not None:
            return self.kernels.fused_moe(x, self.gate(x), self.w13, self.w2, self.top_k)
        act = silu_and_mul if self.kernels is None else self.kernels.silu_and_mul
        forward = moe_forward_dense if x.is_cuda and torch.cuda.is_current_stream_capturing() else moe_forward_native
        return forward(x, self.gate(x), self.w13, self.w2, self.top_k, act=act)
