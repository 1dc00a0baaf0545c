"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral), the base of Qwen2/Qwen3/Mixtral.

Fused QKV and gate-up projections; GQA; optional q/k/v bias (Qwen2) and per-head q/k RMSNorm
(Qwen3); tied embeddings. `forward` returns hidden states; `compute_logits` projects the rows
the caller needs.

Two paths, chosen once when the model is built (`use_kernels`): plain torch ops (the default;
norms and RoPE bit-identical to HF in every dtype), or lmserver's fused Triton kernels on a GPU:
residual add + RMSNorm in place, RoPE in place on q and k (views of the QKV output: no cat, no
split, no cos/sin gather), SiLU-and-mul. In an FP8 model's prefill (`Fp8Linear`s taking FP8 rows:
`_scaled_mm`) SiLU-and-mul and the two norms also quantize per token for down_proj, gate_up_proj and
qkv_proj in their own launch (`Fp8Rows`), as those projections would first. The decoder
layers carry the residual stream separately from the layer output (x, residual) on both paths;
the arithmetic is HF's `residual + hidden` either way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from lmserver.forward.batch import AttentionLayer, ForwardBatch
from lmserver.kernels.dispatch import KernelOps
from lmserver.layers.activation import silu_and_mul_
from lmserver.layers.fp8_linear import Fp8Rows, takes_fp8_rows
from lmserver.layers.moe import MoE
from lmserver.layers.norm import RMSNorm
from lmserver.layers.rotary import RotaryEmbedding
from lmserver.models.config import ModelConfig


class WeightLoadingError(ValueError):
    """A checkpoint tensor is unknown, has the wrong shape, or a parameter was never loaded."""


class RopeTables(nn.Module):
    """RoPE rows of one forward, gathered once for all layers (NeoX rotate-half layout).

    rotate_half(x) * sin == cat(x2, x1) * sin_signed with sin_signed = cat(-sin1, sin2), so the
    torch path rotates q and k heads together with one cat, two muls and one add (rounded as HF's
    `x * cos + rotate_half(x) * sin`). The fused path reads `cos_sin` (built by `use_fused`).
    """

    def __init__(self, rotary: RotaryEmbedding) -> None:
        super().__init__()
        half = rotary.head_dim // 2
        sin: torch.Tensor = rotary.sin_cache  # type: ignore[assignment]
        signed = sin.clone()
        signed[:, :half] = -signed[:, :half]
        self.rotary = [rotary]  # NOTE: a list: the module is registered by LlamaModel already
        self.register_buffer("sin_signed", signed, persistent=False)  # (max_positions, head_dim)
        self.half_dim = half
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.cos_sin: torch.Tensor | None
        self.register_buffer("cos_sin", None, persistent=False)  # (max_positions, head_dim) float32, fused path

    def use_fused(self) -> None:
        """Builds the fused kernel's [cos | sin] table once; mutates self."""
        if self.cos_sin is None:
            self.cos_sin = self.rotary[0].cos_sin_cache()

    def prepare(self, positions: torch.Tensor) -> None:
        """Gathers the cos / signed-sin rows of `positions` (T,); mutates self (one per forward)."""
        cos_cache: torch.Tensor = self.rotary[0].cos_cache  # type: ignore[assignment]
        sin_signed: torch.Tensor = self.sin_signed  # type: ignore[assignment]
        self._rows = (positions, cos_cache[positions].unsqueeze(1), sin_signed[positions].unsqueeze(1))

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x (T, heads, D) -> rotated copy; uses the prepared rows when `positions` is theirs."""
        if self._rows is None or self._rows[0] is not positions:
            self.prepare(positions)
        assert self._rows is not None
        _, cos, sin = self._rows
        if cos.dtype != x.dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            self._rows = (positions, cos, sin)  # cast once per forward
        swapped = torch.cat((x[..., self.half_dim :], x[..., : self.half_dim]), dim=-1)
        # NOTE: not addcmul: it would not round the product (an FMA on the CPU), HF does
        return swapped.mul_(sin).add_(x * cos)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rope: RopeTables) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rope = [rope]  # NOTE: a list so the shared per-forward cos/sin rows are not registered per layer
        self.attn = AttentionLayer(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.kernels: KernelOps | None = None  # None: torch ops; set once at model build

    def forward(self, positions: torch.Tensor, x: torch.Tensor | Fp8Rows, batch: ForwardBatch) -> torch.Tensor:
        """x (T, hidden) (or its per-token FP8 rows, for an FP8 qkv_proj that takes them) -> (T, hidden);
        writes this layer's K/V into the pool. Mutates nothing else."""
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        t, h, kv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[:, self.q_size + self.kv_size :].view(t, kv, d)  # (T, KV, D)
        if self.kernels is not None:
            # views of qkv (row stride q_size + 2 * kv_size), rotated in place
            q = qkv[:, : self.q_size].view(t, h, d)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, kv, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            cos_sin = self.rope[0].cos_sin
            assert cos_sin is not None, "use_kernels builds the RoPE table"
            self.kernels.apply_rope_inplace(positions, q, k, cos_sin)
            return self.o_proj(self.attn(q, k, v, batch))  # type: ignore[no-any-return]
        if self.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].reshape(t, h, d))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(t, kv, d))
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(t, h + kv, d)  # q and k heads side by side
        qk = self.rope[0].rotate(positions, qk)  # one rotation for q and k together
        return self.o_proj(self.attn(qk[:, :h], qk[:, h:], v, batch))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.kernels: KernelOps | None = None  # None: torch ops; set once at model build

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """x (T, hidden) (or its per-token FP8 rows, for an FP8 gate_up_proj that takes them) -> (T, hidden)."""
        gate_up = self.gate_up_proj(x)  # (T, 2 * inter)
        if self.kernels is not None:
            if takes_fp8_rows(self.down_proj, gate_up.shape[0]):
                # FP8 prefill: SiLU-and-mul and down_proj's per-token FP8 quantization in one launch
                return self.down_proj(Fp8Rows(*self.kernels.silu_and_mul_fp8(gate_up), gate_up.dtype))  # type: ignore[no-any-return]
            return self.down_proj(self.kernels.silu_and_mul(gate_up))  # type: ignore[no-any-return]
        # NOTE: in place: no new (T, inter) buffer; down_proj reads the strided half
        return self.down_proj(silu_and_mul_(gate_up))  # type: ignore[no-any-return]


def _norm_quantizes_for(norm: nn.Module, consumer: nn.Module, rows: int) -> bool:
    """FP8 prefill: whether `norm` (a kernel-path RMSNorm) hands `consumer` (an `Fp8Linear` that takes
    FP8 rows) its output quantized per token in the norm's own launch (`RMSNorm.forward_fp8`)."""
    return takes_fp8_rows(consumer, rows) and isinstance(norm, RMSNorm) and norm.kernels is not None


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, mlp: nn.Module, rope: RopeTables
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rope)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it added).

        The residual stream is `residual + x` (x alone on the first layer, residual None).
        NOTE: mutates x and residual in place: both are owned by the decoder (the embedding
        output, then tensors made by the layers), read by nothing else.
        """
        t = x.shape[0]
        h: torch.Tensor | Fp8Rows
        if _norm_quantizes_for(self.input_layernorm, self.self_attn.qkv_proj, t):
            h, residual = self.input_layernorm.forward_fp8(x, residual)
        elif residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(positions, h, batch)
        mlp_in = self.mlp.gate_up_proj if isinstance(self.mlp, LlamaMLP) else self.mlp
        if _norm_quantizes_for(self.post_attention_layernorm, mlp_in, t):
            h, residual = self.post_attention_layernorm.forward_fp8(x, residual)
        else:
            h, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, make_mlp, max_positions: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_parameters)
        self.rope = RopeTables(self.rotary)
        self.layers = nn.ModuleList(
            [
                LlamaDecoderLayer(config, i, make_mlp(config), self.rope)
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused = False  # the path `LlamaForCausalLM.use_kernels` chose
        # EAGLE-3 reads the residual stream after these layers: set, each forward leaves them concatenated
        # in `aux_hidden` (T, len(aux_layers) * hidden)
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`input_embeds` (T, hidden), when given, replaces the embedding lookup of `input_ids`;
        NOTE: the decoder owns it then: it becomes the residual stream and is overwritten."""
        h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds  # (T, hidden)
        if not self.fused:
            self.rope.prepare(positions)
        residual: torch.Tensor | None = None
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, h, residual, batch)
            if i in self.aux_layers:  # NOTE: a new tensor: the next layer updates h and residual in place
                aux.append(h + residual)
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        if residual is None:  # no layers
            return self.norm(h)  # type: ignore[no-any-return]
        return self.norm.add_forward(h, residual)[0]


# checkpoint name pattern -> (our parameter name template, shard id); shard ids are `shard_slice` keys.
_STACKED = [
    (re.compile(r"(.*)\.self_attn\.q_proj\.(weight|bias)$"), r"\1.self_attn.qkv_proj.\2", "q"),
    (re.compile(r"(.*)\.self_attn\.k_proj\.(weight|bias)$"), r"\1.self_attn.qkv_proj.\2", "k"),
    (re.compile(r"(.*)\.self_attn\.v_proj\.(weight|bias)$"), r"\1.self_attn.qkv_proj.\2", "v"),
    (re.compile(r"(.*)\.mlp\.gate_proj\.weight$"), r"\1.mlp.gate_up_proj.weight", "gate"),
    (re.compile(r"(.*)\.mlp\.up_proj\.weight$"), r"\1.mlp.gate_up_proj.weight", "up"),
]


def shard_slice(config: ModelConfig, shard: str) -> slice:
    """The rows of a stacked parameter (qkv_proj, gate_up_proj) that checkpoint shard `shard` fills. Pure."""
    c = config
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    return {
        "q": slice(0, q),
        "k": slice(q, q + kv),
        "v": slice(q + kv, q + 2 * kv),
        "gate": slice(0, inter),
        "up": slice(inter, 2 * inter),
    }[shard]


def map_stacked(name: str, config: ModelConfig) -> tuple[str, tuple[int | slice, ...]]:
    """A checkpoint tensor name -> (our parameter name, index into it): q/k/v and gate/up go into
    their stacked parameters, anything else keeps its name. Pure."""
    for pattern, target, shard in _STACKED:
        if pattern.match(name):
            return pattern.sub(target, name), (shard_slice(config, shard),)
    return name, ()


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        positions = max_positions or config.max_position_embeddings
        self.model = LlamaModel(config, self.make_mlp, positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def make_mlp(config: ModelConfig) -> nn.Module:
        return LlamaMLP(config)

    def use_kernels(self, kernels: KernelOps | None) -> None:
        """Routes every RMSNorm, RoPE and SiLU-and-mul through `kernels` (their in-place
        contracts, e.g. the Triton ops of `select_kernels`), or through the torch ops for None.
        Called once when the model is built (`load_model`); mutates the modules. Parameter
        names and layouts do not change."""
        inner = self.model
        if kernels is not None:
            inner.rope.use_fused()
        inner.fused = kernels is not None
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaAttention, LlamaMLP, MoE)):
                module.kernels = kernels

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states (T, hidden) after the final norm; writes this forward's K/V into the pool.

        `input_embeds` (T, hidden) in the model's dtype replaces the token embedding lookup (a
        multimodal prompt's rows); the forward overwrites it (it becomes the residual stream).
        """
        return self.model(input_ids, positions, batch, input_embeds)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> float32 logits (N, vocab)."""
        return self.compute_raw_logits(hidden).float()

    def compute_raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> logits (N, vocab) in the model's dtype (the decode graphs keep these)."""
        return self.lm_head(hidden)  # type: ignore[no-any-return]

    # --- weight loading -------------------------------------------------------------------

    def map_weight(self, name: str) -> tuple[str, tuple[int | slice, ...]] | None:
        """Checkpoint name -> (our parameter name, index into it); None to skip the tensor."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        return map_stacked(name, self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors into the parameters (mutates them); checks names and shapes.

        Raises WeightLoadingError for an unknown tensor, a shape mismatch, or a parameter that no
        tensor filled.
        """
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, tensor in weights:
            mapped = self.map_weight(name)
            if mapped is None:
                continue
            target, index = mapped
            if target not in params:
                raise WeightLoadingError(f"checkpoint tensor {name!r} has no matching parameter ({target!r})")
            dest = params[target].data[index] if index else params[target].data
            if tuple(dest.shape) != tuple(tensor.shape):
                raise WeightLoadingError(
                    f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, model {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dest.dtype))
            filled[target] = filled.get(target, 0) + dest.numel()
        missing = [n for n, p in params.items() if filled.get(n, 0) < p.numel()]
        if self.config.tie_word_embeddings:
            missing = [n for n in missing if n != "lm_head.weight"]
        if missing:
            raise WeightLoadingError(f"parameters not (fully) loaded from the checkpoint: {missing[:8]}")
