"""Rotary position embeddings (NeoX / HF "rotate_half" layout) with default, linear and Llama-3 scaling.

`rope_parameters_from_hf` reads both the transformers>=5 `rope_parameters` dict and the older
`rope_theta` + `rope_scaling` fields.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedRopeError(ValueError):
    """The model's rope scaling type is not implemented."""


def rope_parameters_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Normalizes a HF config dict into {"rope_type", "rope_theta", ...scaling fields}."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeError(
            f"rope scaling type {params['rope_type']!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    return params


def compute_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in float32, scaled per `params["rope_type"]`."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = float(params["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given absolute positions; cos/sin cached for `max_positions`."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, params)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # NOTE: buffers are not persistent: they are rebuilt, never loaded from a checkpoint.
        self.register_buffer("cos_cache", emb.cos(), persistent=False)  # (max_positions, head_dim)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)  # (max_positions, head_dim)

    def cos_sin_cache(self) -> torch.Tensor:
        """(max_positions, head_dim) float32: cos of the head_dim / 2 frequencies, then their sin;
        the table of the fused RoPE kernel (`lmserver.kernels.rope`). A new tensor."""
        half = self.head_dim // 2
        cos: torch.Tensor = self.cos_cache  # type: ignore[assignment]
        sin: torch.Tensor = self.sin_cache  # type: ignore[assignment]
        return torch.cat((cos[:, :half], sin[:, :half]), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns rotated (q, k); q (T, H, D), k (T, KV, D), positions (T,). Inputs are not mutated."""
        cos_cache: torch.Tensor = self.cos_cache  # type: ignore[assignment]
        sin_cache: torch.Tensor = self.sin_cache  # type: ignore[assignment]
        cos = cos_cache[positions].unsqueeze(1).to(q.dtype)  # (T, 1, D)
        sin = sin_cache[positions].unsqueeze(1).to(q.dtype)  # (T, 1, D)
        q_out = q * cos + _rotate_half(q) * sin
        k_out = k * cos + _rotate_half(k) * sin
        return q_out, k_out
