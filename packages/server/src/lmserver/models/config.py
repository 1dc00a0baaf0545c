"""ModelConfig: the architecture fields the models need, read from a HF `config.json` dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmserver.layers.rotary import rope_parameters_from_hf
from lmserver.models.registry import UnsupportedModelError, architecture_defaults, text_architecture


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
    is_multimodal: bool = False  # takes images / video (LLaVA family); text fields from `text_config`
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds from a HF config dict; raises UnsupportedModelError for unknown architectures.

        A multimodal (LLaVA-family) config takes its text fields from `text_config`, whose
        `model_type` (llama, mistral, qwen2) picks the text defaults; `hf_config` keeps the whole
        dict (the vision fields are read from it).
        """
        archs = hf.get("architectures") or []
        if not archs:
            raise UnsupportedModelError("config.json has no 'architectures' entry; cannot pick a model class")
        arch = archs[0]
        defaults = architecture_defaults(arch)
        multimodal = bool(defaults.get("multimodal", False))
        text = hf
        if multimodal:
            text = complete_text_config(hf.get("text_config") or {})
            defaults = architecture_defaults(text_architecture(str(text.get("model_type", "llama"))))
        num_heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        eos_ids = _eos_ids(text.get("eos_token_id"))
        if multimodal:  # the top level holds generation_config.json's ids (read_model_config)
            eos_ids += tuple(i for i in _eos_ids(hf.get("eos_token_id")) if i not in eos_ids)
        tie = text.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))
        if multimodal:  # HF: the top-level flag, or the text config's
            tie = bool(hf.get("tie_word_embeddings", False)) or bool(tie)
        return cls(
            architecture=arch,
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=int(text["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=int(text.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(tie),
            rope_parameters=rope_parameters_from_hf(text),
            attention_bias=bool(text.get("attention_bias", defaults.get("attention_bias", False))),
            qk_norm=bool(defaults.get("qk_norm", False)),
            num_experts=int(text.get("num_local_experts", 0) or 0),
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0),
            eos_token_ids=eos_ids,
            is_multimodal=multimodal,
            hf_config=dict(hf),
        )


def _eos_ids(eos: Any) -> tuple[int, ...]:
    return tuple(int(i) for i in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


_TEXT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def complete_text_config(text_config: dict[str, Any]) -> dict[str, Any]:
    """A LLaVA `text_config` with the fields it leaves out filled from its transformers config
    class (old checkpoints such as llava-1.5-7b-hf list only a few); complete ones are returned
    as they are (transformers is imported only for partial ones)."""
    if all(key in text_config for key in _TEXT_FIELDS):
        return dict(text_config)
    from transformers import AutoConfig

    model_type = str(text_config.get("model_type", "llama"))
    kwargs = {k: v for k, v in text_config.items() if k != "model_type"}
    try:
        full = AutoConfig.for_model(model_type, **kwargs).to_dict()
    except (KeyError, ValueError) as exc:
        raise UnsupportedModelError(f"text_config of model_type {model_type!r} cannot be read: {exc}") from exc
    return {**full, **text_config}
