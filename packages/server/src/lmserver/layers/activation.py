"""Gated activations over a fused gate-up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `gate_up` = cat([gate, up], -1); shape (..., 2 * d) -> (..., d).

    Rounded as HF's `act_fn(gate) * up` (silu rounded to the dtype, then the product), like the
    Triton kernel `lmserver.kernels.activation.silu_and_mul`. Mutates nothing."""
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]


def silu_and_mul_(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` in place: the result is written over the gate half and returned as that
    (..., d) view (strided; no new buffer). Same rounding. Mutates gate_up."""
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d], inplace=True).mul_(gate_up[..., d:])
