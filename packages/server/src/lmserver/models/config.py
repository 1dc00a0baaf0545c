"""ModelConfig: the architecture fields the models need, read from a HF `config.json` dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmserver.layers.rotary import rope_parameters_from_hf


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not implemented by lmserver."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    attention_bias: bool = False  # bias on q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    num_experts: int = 0  # > 0: Mixtral-style MoE MLP
    num_experts_per_tok: int = 0
    eos_token_ids: tuple[int, ...] = ()
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds from a HF config dict; raises UnsupportedModelError for unknown architectures."""
        from lmserver.models.registry import architecture_defaults

        archs = hf.get("architectures") or []
        if not archs:
            raise UnsupportedModelError("config.json has no 'architectures' entry; cannot pick a model class")
        arch = archs[0]
        defaults = architecture_defaults(arch)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
            rope_parameters=rope_parameters_from_hf(hf),
            attention_bias=bool(hf.get("attention_bias", defaults.get("attention_bias", False))),
            qk_norm=bool(defaults.get("qk_norm", False)),
            num_experts=int(hf.get("num_local_experts", 0) or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 0) or 0),
            eos_token_ids=eos_ids,
            hf_config=dict(hf),
        )
