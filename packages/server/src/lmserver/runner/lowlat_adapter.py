"""Adapter from lmserver's Llama-family model and KV layout to a lowlat plugin layer stack.

``lowlat`` knows nothing of lmserver: this module turns an ``LlamaDecoderLayer`` (fused
``qkv_proj``, ``o_proj``, ``gate_up_proj`` / MoE ``w13``+``w2``, the two RMSNorms, rotary
frequencies) into ``lowlat.LayerWeights`` / ``lowlat.MoELayerWeights`` (views, no copies), the
engine's ``KVPool`` into per-layer ``lowlat.KVCache`` and a decode ``ForwardBatch`` into a
``lowlat.ForwardMeta``. ``decode_forward`` runs the model's decoder layers through a built
plugin (the plugin path of a decode step); the model runner decides when to call it.

FP8: ``Fp8Linear`` projections (an FP8 checkpoint or ``--quantization fp8``) are passed as their e4m3 weights
with per-row scales (``LayerWeights.qkv_scale`` ...; a per-tensor scale is already one value per row); K-group
(128 x 128 block) scales are refused with a reason. FP8 MoE experts (``MoE.w13`` / ``w2`` float8_e4m3fn with
``w13_scale`` (E, 2 * inter) / ``w2_scale`` (E, hidden) per-row scales) are passed as views with their scales
(``MoELayerWeights.w13_scale`` ...), together with the FP8 attention projections; block-scaled experts
(``MoE.group_k`` set), and FP8 in the attention or the experts only, are refused with a reason. An FP8 KV pool is
passed with each layer's K / V scales.

Tensor parallelism: on a sharded model (``lmserver.runner.distributed.shard``) the views are this rank's
shards and the shape counts this rank's heads and intermediate features; the plugin gets the TP
sum through ``BuildContext.all_reduce``. The embedding and final norm used by ``decode_forward``
are the model's own (vocab-parallel embedding included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmserver.forward.batch import ForwardBatch, ForwardMode
from lmserver.forward.kv_pool import KVPool
from lmserver.layers.rotary import compute_inv_freq
from lmserver.models.config import ModelConfig
from lowlat import ForwardMeta, KVCache, LayerShape, LayerWeights, MoELayerWeights, MoEShape
from lowlat.build import Built


class LowlatAdapterError(ValueError):
    """The model or batch cannot be expressed as a lowlat plugin layer (the reason says which part)."""


@dataclass(frozen=True)
class PluginLayers:
    """What ``Session.build`` needs: ``session.build(p.shape, p.weights, device, dtype, moe=p.moe)``."""

    shape: LayerShape
    weights: tuple[LayerWeights, ...] | tuple[MoELayerWeights, ...]
    moe: MoEShape | None


def layer_shape(config: ModelConfig, tp_size: int = 1) -> LayerShape:
    """The lowlat ``LayerShape`` of one decoder layer of ``config`` on one of ``tp_size`` ranks.

    Pure; raises ``TensorParallelError`` when the heads do not split (as sharding does).
    """
    from lmserver.runner.distributed.shard import tp_head_counts

    heads, kv_heads = tp_head_counts(config, tp_size)
    return LayerShape(
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size // tp_size,
        rms_eps=config.rms_norm_eps,
    )


def moe_shape(config: ModelConfig, tp_size: int = 1) -> MoEShape | None:
    """The lowlat ``MoEShape`` of a Mixtral-style config (each expert's intermediate features on one of ``tp_size``
    ranks), or None for a dense model. Pure."""
    if not config.num_experts:
        return None
    return MoEShape(config.num_experts, config.num_experts_per_tok, config.intermediate_size // tp_size)


def _projection(module: Any, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, per-row scale or None) of a linear layer in lowlat's layout; raises ``LowlatAdapterError`` for FP8
    scales per K group. Reads only."""
    from lmserver.layers.fp8_linear import Fp8Linear

    if not isinstance(module, Fp8Linear):
        return module.weight.data, None
    if module.weight_scale.shape[1] != 1:
        raise LowlatAdapterError(
            f"{name}: FP8 weights with scales per {module.group_k}-column group (block-scaled checkpoint); lowlat "
            "kernels read one scale per output row: serve it without the plugin")
    return module.weight.data, module.weight_scale.view(-1)


def _experts(module: Any, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(``w13``, ``w2``, ``w13_scale``, ``w2_scale``: per-row scales, None for model-dtype experts) of an lmserver
    ``MoE`` in lowlat's layout (views); raises ``LowlatAdapterError`` for block-scaled FP8 experts. Reads only."""
    w13_scale, w2_scale = getattr(module, "w13_scale", None), getattr(module, "w2_scale", None)
    if w13_scale is not None or w2_scale is not None:
        group_k = getattr(module, "group_k", None)
        if group_k is not None or w13_scale is None or w2_scale is None or w13_scale.dim() != 2 or w2_scale.dim() != 2:
            block = f"{getattr(module, 'group_n', None)} x {group_k}"
            raise LowlatAdapterError(
                f"{name}: FP8 experts with scales per {block} block (block-scaled checkpoint); lowlat's MoE kernels "
                "read one scale per expert output row: serve it without the plugin")
    return module.w13.data, module.w2.data, w13_scale, w2_scale


def plugin_layers(model: nn.Module, tp_size: int = 1) -> PluginLayers:
    """Views of every decoder layer's weights in lowlat's layout (no copies); reads only.

    ``model`` is an lmserver ``LlamaForCausalLM`` (or a subclass: Mistral, Qwen2 without bias,
    Mixtral), sharded for one of ``tp_size`` ranks when ``tp_size > 1`` (the views then equal
    ``lowlat.tp.shard_layer`` / ``shard_moe_layer`` of the whole layers). Raises
    ``LowlatAdapterError`` for attention biases and per-head q/k norms.
    """
    config: ModelConfig = model.config  # type: ignore[assignment]
    if config.attention_bias or config.qk_norm:
        raise LowlatAdapterError(
            f"{config.architecture}: lowlat layers have no attention bias and no q/k norm "
            f"(attention_bias={config.attention_bias}, qk_norm={config.qk_norm}); serve it without the plugin"
        )
    inner: Any = model.model
    device = inner.layers[0].input_layernorm.weight.device
    inv_freq = compute_inv_freq(config.head_dim, config.rope_parameters).to(device=device, dtype=torch.float32)
    moe = moe_shape(config, tp_size)
    layers: list[Any] = []
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_scale = _projection(attn.qkv_proj, f"layer {i} qkv_proj")
        o_proj, o_proj_scale = _projection(attn.o_proj, f"layer {i} o_proj")
        common: dict[str, Any] = dict(
            input_norm=layer.input_layernorm.weight.data,
            qkv=qkv,
            o_proj=o_proj,
            post_norm=layer.post_attention_layernorm.weight.data,
            rope_inv_freq=inv_freq,
        )
        if moe is None:
            gate_up, gate_up_scale = _projection(mlp.gate_up_proj, f"layer {i} gate_up_proj")
            down, down_scale = _projection(mlp.down_proj, f"layer {i} down_proj")
            layers.append(LayerWeights(gate_up=gate_up, down=down, qkv_scale=qkv_scale, o_proj_scale=o_proj_scale,
                                       gate_up_scale=gate_up_scale, down_scale=down_scale, **common))
        else:
            experts = getattr(mlp, "moe", mlp)  # sharded: lmserver's TPMoE around this rank's experts
            w13, w2, w13_scale, w2_scale = _experts(experts, f"layer {i} experts")
            if (qkv_scale is not None) != (w13_scale is not None):
                fp8, other = ("attention projections", "experts") if qkv_scale is not None else \
                    ("experts", "attention projections")
                raise LowlatAdapterError(
                    f"{config.architecture} layer {i}: FP8 {fp8} with model-dtype {other}: the plugin's MoE stack "
                    "takes FP8 in both or in neither; serve it without the plugin")
            layers.append(MoELayerWeights(router=experts.gate.weight.data, w13=w13, w2=w2, qkv_scale=qkv_scale,
                                          o_proj_scale=o_proj_scale, w13_scale=w13_scale, w2_scale=w2_scale, **common))
    return PluginLayers(layer_shape(config, tp_size), tuple(layers), moe)


def kv_caches(pool: KVPool) -> list[KVCache]:
    """Per-layer views of the engine's KV pool (same storage: plugin writes land in the pool), with each layer's
    K / V scales (used by an FP8 pool)."""
    return [KVCache(k, v, ks, vs)
            for k, v, ks, vs in zip(pool.k_cache, pool.v_cache, pool.k_scale, pool.v_scale, strict=True)]


def forward_meta(batch: ForwardBatch, req_to_token: torch.Tensor, max_seq_len: int = 0,
                 rows_per_request: int = 1) -> ForwardMeta:
    """lowlat metadata of a decode ``batch`` over ``req_to_token``; no host sync, reads only.

    ``max_seq_len`` bounds the sequence lengths (sizes the split-KV work); 0 means the table's
    width (what a CUDA graph must use, since it is captured once for every length).
    ``rows_per_request`` > 1: the rows are a verify step's, up to that many per request.
    """
    if batch.mode != ForwardMode.DECODE:
        raise LowlatAdapterError(f"lowlat plugins cover decode steps only, got a {batch.mode.value} batch")
    return ForwardMeta(
        req_to_token=req_to_token,
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens,
        positions=batch.positions,
        out_cache_loc=batch.out_cache_loc,
        max_seq_len=max_seq_len,
        rows_per_request=rows_per_request,
    )


def decode_forward(
    model: nn.Module,
    built: Built,
    batch: ForwardBatch,
    kvs: Sequence[KVCache],
    req_to_token: torch.Tensor,
    max_seq_len: int = 0,
    rows_per_request: int = 1,
) -> torch.Tensor:
    """Hidden states (bs, hidden) after the final norm, as ``model.forward`` returns them, with every
    decoder layer run by ``built``. Mutates ``kvs`` (the engine's pool: the new tokens' K and V)
    and the plugin's workspaces. ``rows_per_request`` > 1: a verify step's rows (``forward_meta``).

    EAGLE-3: when the model names ``aux_layers``, the residual stream after each of them (a plugin layer's output)
    is left side by side in ``model.model.aux_hidden`` (bs, len(aux_layers) * hidden), as the model's forward
    leaves it."""
    meta = forward_meta(batch, req_to_token, max_seq_len, rows_per_request)
    inner: Any = model.model
    h = inner.embed_tokens(batch.input_ids)  # (bs, hidden)
    aux_layers = sorted(set(getattr(inner, "aux_layers", ())))  # in layer order, as the model's forward
    aux = h.new_empty(h.shape[0], len(aux_layers) * h.shape[1]) if aux_layers else None
    for i in range(len(inner.layers)):
        h = built.forward(i, h, kvs[i], meta)
        if aux is not None and i in aux_layers:  # NOTE: copied now: a plugin may reuse h's storage in later layers
            j = aux_layers.index(i)
            aux[:, j * h.shape[1]:(j + 1) * h.shape[1]].copy_(h)
    if aux is not None:
        inner.aux_hidden = aux
    return inner.norm(h)  # type: ignore[no-any-return]
