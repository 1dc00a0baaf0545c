"""EAGLE draft head (EAGLE-1/2 layout): Llama decoder layers that read the target's features.

At draft position i the head takes the target's final-norm hidden state of position i (the
feature its LM head read) and the token of position i + 1: `fc(concat(embed(token), feature))`
runs through the head's decoder layers (the first without its input norm, as EAGLE trains it)
and, without a final norm, is the predicted feature of position i + 1, which the target's LM
head turns into the draft logits. The token embedding and the LM head are the target's unless
the checkpoint brings its own embedding.

Published layout (e.g. the EAGLE-LLaMA3 checkpoints): `config.json` of a Llama model with the
head's layer count, tensors `fc.weight` (hidden, 2 * hidden) with an optional `fc.bias`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
`layers.{i}.{input,post_attention}_layernorm.weight` (layer 0 without `input_layernorm`), and
optionally `embed_tokens.weight`; `model.`-prefixed names are taken as well. `*.safetensors`
or `pytorch_model.bin`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmserver.forward.batch import ForwardBatch
from lmserver.models.config import ModelConfig
from lmserver.models.llama import LlamaMLP, LlamaModel, WeightLoadingError, map_stacked

__all__ = ["Eagle3Head", "EagleHead", "default_aux_layers", "is_eagle3_config", "iter_checkpoint"]


class _DraftHead(nn.Module):
    """What both head layouts share: step features (set per forward, or a graph's static buffer),
    float logits, the head's own parameters (not the target modules it reads) and the loading of
    a published checkpoint into them."""

    config: ModelConfig
    own_embedding: bool

    def __init__(self) -> None:
        super().__init__()
        self.features: torch.Tensor | None = None
        # the features of graph-captured steps (`features` None): rows [:T] of a static buffer the proposer fills
        self.feature_buffer: torch.Tensor | None = None

    def use_kernels(self, kernels: object) -> None:
        """Torch ops only (a head is one or two layers; its cost is an LM head)."""

    def _step_features(self, input_ids: torch.Tensor) -> torch.Tensor:
        features = self.features
        if features is None and self.feature_buffer is not None:
            features = self.feature_buffer[: input_ids.shape[0]]
        assert features is not None and features.shape[0] == input_ids.shape[0], f"{type(self).__name__}.features not set"
        return features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_raw_logits(hidden).float()

    def compute_raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def target_modules(self) -> list[nn.Module]:
        """The target's modules the head reads (their parameters are not the head's)."""
        raise NotImplementedError

    def _checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name (`model.` prefix removed) as the head's parameter name, or None to skip it."""
        raise NotImplementedError

    def head_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The head's own parameters (not the target's modules)."""
        shared = {id(p) for m in self.target_modules() for p in m.parameters()}
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) not in shared:
                yield name, param

    def _loadable(self) -> dict[str, torch.Tensor]:
        return {name: p.data for name, p in self.head_parameters()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies a published checkpoint into the head; raises WeightLoadingError for an unknown
        tensor, a shape mismatch or a head tensor no checkpoint tensor filled."""
        what = type(self).__name__
        tensors = self._loadable()
        filled: dict[str, int] = {}
        for raw_name, tensor in weights:
            name = self._checkpoint_name(raw_name.removeprefix("model."))
            if name is None or "rotary_emb.inv_freq" in name:
                continue
            target, index = map_stacked(name, self.config)
            if target not in tensors:
                raise WeightLoadingError(f"{what} checkpoint tensor {raw_name!r} has no matching parameter")
            dest = tensors[target][index] if index else tensors[target]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise WeightLoadingError(f"shape mismatch for {raw_name!r}: checkpoint {tuple(tensor.shape)}, "
                                         f"head {tuple(dest.shape)}")
            dest.copy_(tensor.to(dest.dtype))
            filled[target] = filled.get(target, 0) + dest.numel()
        missing = [n for n, t in tensors.items() if filled.get(n, 0) < t.numel()]
        if missing:
            raise WeightLoadingError(f"{what} parameters not (fully) loaded from the checkpoint: {missing[:8]}")


class EagleHead(_DraftHead):
    """The head over the target's embedding and LM head (shared modules, not copies).

    `features` must be set to the (T, hidden) target features of a forward's T tokens before
    each forward (the proposer does it), or be None with the first T rows of `feature_buffer`
    holding them (a CUDA-graph step); the forward returns the predicted features (T, hidden).
    """

    def __init__(self, config: ModelConfig, target: nn.Module, max_positions: int, fc_bias: bool = False,
                 own_embedding: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, LlamaMLP, max_positions)
        del self.model.norm  # EAGLE's head has no final norm
        self.model.layers[0].input_layernorm = nn.Identity()
        if not own_embedding:
            self.model.embed_tokens = target.model.embed_tokens  # type: ignore[union-attr, assignment]
        self.lm_head: nn.Module = target.lm_head  # type: ignore[assignment]
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.own_embedding = own_embedding

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        features = self._step_features(input_ids)
        h = self.fc(torch.cat([self.model.embed_tokens(input_ids), features.to(self.fc.weight.dtype)], dim=-1))
        self.model.rope.prepare(positions)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            h, residual = layer(positions, h, residual, batch)
        assert residual is not None
        return h + residual

    def compute_raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # type: ignore[no-any-return]

    def target_modules(self) -> list[nn.Module]:
        return [self.lm_head] + ([] if self.own_embedding else [self.model.embed_tokens])

    def _checkpoint_name(self, name: str) -> str | None:
        if name == "lm_head.weight" or (name == "embed_tokens.weight" and not self.own_embedding):
            return None
        return name if name.startswith("fc.") else "model." + name


def iter_checkpoint(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a head's `*.safetensors` files, else of its `pytorch_model.bin`."""
    folder = Path(folder)
    if any(folder.glob("*.safetensors")):
        from lmserver.models.loader import iter_safetensors

        yield from iter_safetensors(folder)
        return
    bin_file = folder / "pytorch_model.bin"
    if not bin_file.is_file():
        raise WeightLoadingError(f"{folder} has neither *.safetensors nor pytorch_model.bin")
    yield from torch.load(bin_file, map_location="cpu", weights_only=True).items()


def checkpoint_names(folder: str | Path) -> set[str]:
    """The tensor names of a head's checkpoint (reads the safetensors headers, or the .bin)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        names: set[str] = set()
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                names.update(st.keys())
        return names
    return {name for name, _ in iter_checkpoint(folder)}


class _Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer (its parameter names are the published `midlayer.*`)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module, hidden_norm: nn.Module,
                 post_attention_layernorm: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.hidden_norm = input_layernorm, hidden_norm
        self.post_attention_layernorm = post_attention_layernorm


class Eagle3Head(_DraftHead):
    """EAGLE-3 head: the target's residual stream after three of its layers (`aux_layers`, their
    concatenation, (T, 3 * hidden)) goes through `fc` to one feature; one decoder layer whose
    attention reads [input_layernorm(token embedding), hidden_norm(feature)] (2 * hidden wide), then
    the head's own norm and LM head over a reduced draft vocabulary, mapped to target ids by `d2t`
    (target id = draft id + d2t[draft id]). A head step's feature is the layer's output before that
    norm (hidden wide, no fc).

    Published layout (the EAGLE3-* checkpoints): `fc.weight` (hidden, 3 * hidden),
    `midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
    `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`, `norm.weight`,
    `lm_head.weight` (draft vocabulary, hidden), `d2t`, optionally `t2d` and `embed_tokens.weight`.
    """

    def __init__(self, config: ModelConfig, target: nn.Module, max_positions: int, draft_vocab: int,
                 aux_layers: int = 3, own_embedding: bool = False) -> None:
        super().__init__()
        from lmserver.layers.norm import RMSNorm
        from lmserver.layers.rotary import RotaryEmbedding
        from lmserver.models.llama import LlamaAttention, RopeTables

        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.own_embedding = own_embedding
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, h) if own_embedding \
            else target.model.embed_tokens  # type: ignore[union-attr, assignment]
        self.rope = RopeTables(RotaryEmbedding(config.head_dim, max_positions, config.rope_parameters))
        attn = LlamaAttention(config, 0, self.rope)
        attn.qkv_proj = nn.Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=False)
        self.midlayer = _Eagle3Layer(attn, LlamaMLP(config), RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps))
        self.fc = nn.Linear(aux_layers * h, h, bias=False)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.target_vocab = config.vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        features = self._step_features(input_ids).to(self.fc.weight.dtype)
        if features.shape[-1] != self.config.hidden_size:  # the target's layers: one feature through fc
            features = self.fc(features)
        m = self.midlayer
        self.rope.prepare(positions)
        x = torch.cat([m.input_layernorm(self.embed_tokens(input_ids)), m.hidden_norm(features)], dim=-1)
        h = m.self_attn(positions, x, batch) + features
        return h + m.mlp(m.post_attention_layernorm(h))  # type: ignore[no-any-return]

    def compute_raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits placed at their target ids (-inf elsewhere), (T, target vocab)."""
        draft = self.lm_head(self.norm(hidden))
        full = torch.full((hidden.shape[0], self.target_vocab), float("-inf"), dtype=draft.dtype, device=draft.device)
        ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t
        return full.index_copy_(1, ids, draft)

    def target_modules(self) -> list[nn.Module]:
        return [] if self.own_embedding else [self.embed_tokens]

    def _loadable(self) -> dict[str, torch.Tensor]:
        return {**super()._loadable(), "d2t": self.d2t}  # the draft -> target id offsets load like a weight

    def _checkpoint_name(self, name: str) -> str | None:
        return None if name == "t2d" or (name == "embed_tokens.weight" and not self.own_embedding) else name


def is_eagle3_config(raw: dict[str, Any]) -> bool:
    """Whether a draft head's config.json (as a dict) is an EAGLE-3 head: an `*Eagle3*` architecture or a
    `draft_vocab_size`. Pure."""
    return any("Eagle3" in a for a in raw.get("architectures", [])) or "draft_vocab_size" in raw


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose output EAGLE-3 reads when the head's config names none (the
    residual stream after layers 1, L / 2 - 1 and L - 4, as SGLang captures it)."""
    return (1, num_layers // 2 - 1, num_layers - 4)
