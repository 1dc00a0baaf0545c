"""Data types of a Llama-style decoder layer: shapes, weights, KV cache and per-step metadata.

FP8 (e4m3): a projection may hold ``float8_e4m3fn`` weights with one float32 scale per output row
(``W = weight * scale[:, None]``; per-tensor scales are the same value in every row); a ``KVCache`` may hold
``float8_e4m3fn`` K / V with one scale each (the cache stores ``k * (1 / k_scale)`` saturated at +-448, readers
multiply back). ``quantize_layer_fp8`` makes such a layer from a dense one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    # FP8 weights: (out_features,) float32 per-row scales of qkv, o_proj, gate_up, down (all four or none)
    qkv_scale: torch.Tensor | None = None
    o_proj_scale: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        """Whether the four projections hold FP8 (e4m3) weights with per-row scales."""
        return self.qkv.dtype == FP8_DTYPE

    def validate(self, shape: LayerShape) -> None:
        """Raise ``ShapeError`` when a tensor does not match ``shape`` (FP8: every projection FP8 with its
        (out_features,) float32 scales). Reads only."""
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
        for name in PROJECTIONS:
            w, scale = getattr(self, name), getattr(self, f"{name}_scale")
            if (w.dtype == FP8_DTYPE) != self.fp8:
                raise ShapeError(f"LayerWeights.{name} is {w.dtype}: FP8 weights need all four projections in FP8")
            if not self.fp8:
                if scale is not None:
                    raise ShapeError(f"LayerWeights.{name}_scale is for FP8 weights, {name} is {w.dtype}")
                continue
            if scale is None or tuple(scale.shape) != (w.shape[0],) or scale.dtype != torch.float32:
                found = None if scale is None else (scale.dtype, tuple(scale.shape))
                raise ShapeError(f"LayerWeights.{name}_scale must be float32 ({w.shape[0]},) per-row scales of the "
                                 f"FP8 weight, got {found}")


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


def quantize_rows_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (float8_e4m3fn (N, K), float32 (N,) scales): each row's absolute maximum / 448, the row
    divided by it and saturated (round to nearest even, as torch converts). Pure."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
    return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous(), scale.contiguous()


def quantize_layer_fp8(weights: LayerWeights) -> LayerWeights:
    """``weights`` with its four projections quantized to FP8 per output row (norms, rotary table kept). Pure."""
    fields: dict[str, torch.Tensor] = {}
    for name in PROJECTIONS:
        fields[name], fields[f"{name}_scale"] = quantize_rows_fp8(getattr(weights, name))
    return replace(weights, **fields)


def dequantized(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A projection's (N, K) weight in ``dtype``: FP8 times its row scales (computed in float32, float64 for a
    float64 ``dtype``), else ``w`` as it is. Pure."""
    if scale is None:
        return w
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (w.to(compute) * scale.to(compute)[:, None]).to(dtype)


@dataclass(frozen=True)
class KVCache:
    """One layer's paged KV cache, one slot per token. FP8 caches (``float8_e4m3fn``) hold ``k * (1 / k_scale)``
    and ``v * (1 / v_scale)`` saturated at +-448; other dtypes ignore the scales."""

    k: torch.Tensor  # (num_slots, num_kv_heads, head_dim)
    v: torch.Tensor  # (num_slots, num_kv_heads, head_dim)
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def fp8(self) -> bool:
        return self.k.dtype == FP8_DTYPE


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
    # host-side bound on the rows one request holds in this decode-shaped step: > 1 for a speculative verify step's
    # rows, each a decode row at its own position (picks the verify attention's launch: LaunchConfig.verify_attn_warps)
    rows_per_request: int = 1

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
