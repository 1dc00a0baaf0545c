"""Data types of a Llama-style decoder layer: shapes, weights, KV cache and per-step metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowlat.errors import ShapeError


@dataclass(frozen=True)
class LayerShape:
    """Sizes of one decoder layer (Llama, Mistral, SmolLM2, Qwen2 without bias)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ShapeError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ShapeError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def weight_bytes(self, element_size: int) -> int:
        """Bytes of one layer's weights (norms included)."""
        h, i = self.hidden_size, self.intermediate_size
        return element_size * (self.qkv_size * h + h * self.q_size + 2 * i * h + h * i + 2 * h)


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights in the torch ``Linear`` layout ``(out_features, in_features)``.

    ``rope_inv_freq`` (head_dim // 2,) float32 is usually shared by every layer; pass a scaled
    table for rope-scaling variants (Llama 3.1 ``llama3`` scaling, linear, ...).
    """

    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # (q_size + 2 * kv_size, hidden): q rows, then k rows, then v rows
    o_proj: torch.Tensor  # (hidden, q_size)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # (2 * intermediate, hidden): gate rows, then up rows
    down: torch.Tensor  # (hidden, intermediate)
    rope_inv_freq: torch.Tensor  # (head_dim // 2,) float32

    def validate(self, shape: LayerShape) -> None:
        """Raise ``ShapeError`` when a tensor does not match ``shape``. Reads only."""
        h, i = shape.hidden_size, shape.intermediate_size
        expect = {
            "input_norm": (h,),
            "qkv": (shape.qkv_size, h),
            "o_proj": (h, shape.q_size),
            "post_norm": (h,),
            "gate_up": (2 * i, h),
            "down": (h, i),
            "rope_inv_freq": (shape.head_dim // 2,),
        }
        for name, want in expect.items():
            got = tuple(getattr(self, name).shape)
            if got != want:
                raise ShapeError(f"LayerWeights.{name} has shape {got}, expected {want}")


@dataclass(frozen=True)
class KVCache:
    """One layer's paged KV cache, one slot per token."""

    k: torch.Tensor  # (num_slots, num_kv_heads, head_dim)
    v: torch.Tensor  # (num_slots, num_kv_heads, head_dim)


@dataclass(frozen=True)
class ForwardMeta:
    """Per-step metadata shared by every layer (plan once, run per layer).

    Tokens are flattened request by request: request ``r`` owns ``extend_lens[r]`` consecutive
    tokens, the last of which sits at sequence position ``seq_lens[r] - 1``. Decode is the case
    ``extend_lens == 1``.
    """

    req_to_token: torch.Tensor  # (max_reqs, max_context) int32: slot of each position of each request
    req_pool_indices: torch.Tensor  # (batch,) int64 or int32: row of req_to_token per request
    seq_lens: torch.Tensor  # (batch,) int32: tokens per request after this step
    positions: torch.Tensor  # (num_tokens,) int64 or int32: sequence position of each new token
    out_cache_loc: torch.Tensor  # (num_tokens,) int64 or int32: slot written for each new token
    extend_lens: torch.Tensor | None = None  # (batch,) int32; None means decode (all ones)
    max_seq_len: int = 0  # host-side bound on seq_lens (sizes split-KV work); 0 = req_to_token width

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def rope_inv_freq(head_dim: int, theta: float = 10000.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The plain rotary frequency table ``theta ** (-2i / head_dim)``, float32 (head_dim // 2,)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    return (1.0 / (theta**exponent)).to(torch.float32)
