"""Architecture name (HF `architectures[0]`) -> model class, plus per-architecture defaults."""

from __future__ import annotations

from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not implemented by lmserver."""


# name -> (module, class, config defaults for fields HF leaves implicit)
_ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("lmserver.models.llama", "LlamaForCausalLM", {}),
    "MistralForCausalLM": ("lmserver.models.llama", "LlamaForCausalLM", {}),
    "Qwen2ForCausalLM": ("lmserver.models.qwen", "Qwen2ForCausalLM", {"attention_bias": True}),
    "Qwen3ForCausalLM": ("lmserver.models.qwen", "Qwen3ForCausalLM", {"qk_norm": True}),
    "MixtralForCausalLM": ("lmserver.models.mixtral", "MixtralForCausalLM", {}),
    # multimodal: the text model's defaults come from `text_config` (see TEXT_ARCHITECTURES)
    "LlavaForConditionalGeneration": ("lmserver.models.llava", "LlavaForConditionalGeneration", {"multimodal": True}),
    "LlavaNextForConditionalGeneration": (
        "lmserver.models.llava_next", "LlavaNextForConditionalGeneration", {"multimodal": True}
    ),
    "LlavaNextVideoForConditionalGeneration": (
        "lmserver.models.llava_next", "LlavaNextVideoForConditionalGeneration", {"multimodal": True}
    ),
}

# `text_config.model_type` of a multimodal checkpoint -> the text architecture whose defaults apply
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def architecture_defaults(arch: str) -> dict[str, Any]:
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    return dict(_ARCHITECTURES[arch][2])


def text_architecture(model_type: str) -> str:
    """The text architecture of a multimodal checkpoint whose `text_config` has `model_type`."""
    if model_type not in TEXT_ARCHITECTURES:
        raise UnsupportedModelError(
            f"text model {model_type!r} of a multimodal checkpoint is not supported; "
            f"supported: {', '.join(sorted(TEXT_ARCHITECTURES))}"
        )
    return TEXT_ARCHITECTURES[model_type]


def get_model_class(arch: str) -> type:
    """The model class for `arch`, imported on demand."""
    import importlib

    architecture_defaults(arch)
    module_name, class_name, _ = _ARCHITECTURES[arch]
    return getattr(importlib.import_module(module_name), class_name)  # type: ignore[no-any-return]
