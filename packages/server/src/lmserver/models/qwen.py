"""Qwen2 (bias on q/k/v) and Qwen3 (per-head q/k RMSNorm): the Llama decoder with config flags."""

from __future__ import annotations

from lmserver.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: `ModelConfig.attention_bias` is True by default (see the registry)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: `ModelConfig.qk_norm` is True (q_norm, k_norm over head_dim before RoPE)."""
