"""Model implementations (Llama/Mistral/SmolLM2, Qwen2, Qwen3, Mixtral) and their registry."""

from lmserver.models.config import ModelConfig
from lmserver.models.registry import UnsupportedModelError, get_model_class, supported_architectures

__all__ = ["ModelConfig", "UnsupportedModelError", "get_model_class", "supported_architectures"]
