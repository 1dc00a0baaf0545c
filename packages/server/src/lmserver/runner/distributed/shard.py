"""Shards a loaded Llama-family model (Llama, Mistral, Qwen2, Qwen3, Mixtral) in place for one
tensor-parallel rank: attention heads, MLP / expert intermediate features and the vocabulary
are split; norms, RoPE and the MoE router stay replicated. FP8 projections and experts split with
their scales (distributed/layers.py); an FP8 LM head does not.

KV heads: when `num_key_value_heads` is divisible by tp_size each rank holds its share; when
tp_size is a multiple of it, each KV head is replicated on tp_size / num_key_value_heads ranks.
Other head counts raise TensorParallelError naming the constraint.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from lmserver.models.config import ModelConfig
from lmserver.runner.distributed.group import TPGroup
from lmserver.runner.distributed.layers import (
    ParallelLMHead,
    TPMoE,
    VocabParallelEmbedding,
    column_parallel,
    row_parallel,
)


class TensorParallelError(ValueError):
    """The model's head or feature counts (or an FP8 layer's scale groups) cannot be split over tp_size ranks."""


def tp_head_counts(config: ModelConfig, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) per rank; raises TensorParallelError when they do not split."""
    h, kv = config.num_attention_heads, config.num_key_value_heads
    if h % tp_size:
        divisors = [d for d in range(2, h + 1) if h % d == 0]
        raise TensorParallelError(
            f"num_attention_heads ({h}) of this model is not divisible by tp_size ({tp_size}); "
            f"use a tp_size among {divisors}"
        )
    if kv % tp_size and tp_size % kv:
        raise TensorParallelError(
            f"num_key_value_heads ({kv}) and tp_size ({tp_size}) must divide one another "
            "(KV heads are split, or replicated when tp_size is a multiple of them)"
        )
    if config.num_experts == 0 and config.intermediate_size % tp_size:
        raise TensorParallelError(
            f"intermediate_size ({config.intermediate_size}) is not divisible by tp_size ({tp_size})"
        )
    return h // tp_size, max(kv // tp_size, 1)


def check_fp8_splits(model: nn.Module, config: ModelConfig, tp_size: int) -> None:
    """Raises TensorParallelError, before any rank shards, when an FP8 layer of `model` cannot split over `tp_size`
    ranks: a row-parallel projection (o_proj, down_proj) whose scale groups do not fall on the shards' column
    boundaries, or block-scaled experts whose intermediate shards are not whole blocks."""
    from lmserver.layers.fp8_linear import Fp8Linear

    hq, _ = tp_head_counts(config, tp_size)
    layers: Any = model.model.layers  # type: ignore[union-attr]
    for i, layer in enumerate(layers):
        mlp = layer.mlp
        width = {"self_attn.o_proj": hq * config.head_dim}
        if not config.num_experts:
            width["mlp.down_proj"] = config.intermediate_size // tp_size
        for name, shard in width.items():
            proj = layer.get_submodule(name)
            if isinstance(proj, Fp8Linear) and proj.group_k < proj.in_features and shard % proj.group_k:
                raise TensorParallelError(
                    f"layer {i} {name}: FP8 scales per {proj.group_k} input columns cannot split into tp_size "
                    f"{tp_size} shards of {shard} columns; use a tp_size whose shards are whole scale groups")
        block = getattr(mlp, "scale_block", None)
        if config.num_experts and block is not None:
            n = config.intermediate_size // tp_size
            if n % block[0] or n % block[1]:
                raise TensorParallelError(
                    f"layer {i}: FP8 experts with {block[0]} x {block[1]} scale blocks cannot split their "
                    f"intermediate size {config.intermediate_size} into tp_size {tp_size} shards of {n}; use a "
                    "tp_size whose shards are whole blocks")


def _qkv_row_ranges(config: ModelConfig, group: TPGroup) -> list[tuple[int, int]]:
    d, h, kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    hq, hk = tp_head_counts(config, group.size)
    q_size, kv_size = h * d, kv * d
    q0 = group.rank * hq * d
    first_kv = group.rank * hk if kv >= group.size else group.rank // (group.size // kv)
    k0 = q_size + first_kv * d
    v0 = q_size + kv_size + first_kv * d
    return [(q0, q0 + hq * d), (k0, k0 + hk * d), (v0, v0 + hk * d)]


def shard_model_(model: nn.Module, config: ModelConfig, group: TPGroup) -> nn.Module:
    """Replaces `model`'s layers by this rank's shards (mutates and returns `model`)."""
    if group.size == 1:
        return model
    hq, hk = tp_head_counts(config, group.size)
    d = config.head_dim
    inner: Any = model.model  # a Llama-family model: `model.embed_tokens`, `model.layers`, `lm_head`
    if not isinstance(model.lm_head, nn.Linear):  # NOTE: ParallelLMHead shards weights only (no FP8 scales)
        raise TensorParallelError(f"the LM head is {type(model.lm_head).__name__} (an FP8 LM head: "
                                  "--quantize-lm-head or an FP8 checkpoint's lm_head); tensor parallelism shards "
                                  "model-dtype LM heads only; use tp_size 1")
    full_embed = inner.embed_tokens
    model.lm_head = ParallelLMHead(cast(nn.Linear, model.lm_head).weight.data, group)
    inner.embed_tokens = VocabParallelEmbedding(full_embed, group)
    for layer in inner.layers:
        attn = layer.self_attn
        attn.qkv_proj = column_parallel(attn.qkv_proj, _qkv_row_ranges(config, group))
        attn.o_proj = row_parallel(attn.o_proj, (group.rank * hq * d, (group.rank + 1) * hq * d), group)
        attn.num_heads, attn.num_kv_heads = hq, hk
        attn.q_size, attn.kv_size = hq * d, hk * d
        attn.attn.num_heads, attn.attn.num_kv_heads = hq, hk
        if config.num_experts:
            layer.mlp = TPMoE(layer.mlp, group)
        else:
            inter = config.intermediate_size
            n = inter // group.size
            s = group.rank * n
            layer.mlp.gate_up_proj = column_parallel(layer.mlp.gate_up_proj, [(s, s + n), (inter + s, inter + s + n)])
            layer.mlp.down_proj = row_parallel(layer.mlp.down_proj, (s, s + n), group)
    return model
