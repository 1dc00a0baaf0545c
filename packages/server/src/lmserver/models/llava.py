"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP / SigLIP vision tower, a two-layer
projector, and the Llama-family decoder.

The class subclasses `LlamaForCausalLM`: `model` (embed_tokens, layers, norm) and `lm_head`
stay where the text model has them, so tensor parallelism, the lowlat adapter and the decode
CUDA graphs see a Llama model. The vision tower is transformers' own module
(`AutoModel.from_config(vision_config)`), cut after the last hidden layer the features are
taken from (its post-layernorm, unused, is an identity). The engine embeds a multimodal prompt
with `embed_tokens`, overwrites the image rows with `encode_images` and runs `forward` on those
`input_embeds` (see docs/multimodal.md). LLaVA-NeXT and LLaVA-NeXT-Video live in llava_next.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lmserver.models.config import ModelConfig
from lmserver.models.llama import LlamaForCausalLM
from lmserver.multimodal import token_counts


class MultimodalInputError(ValueError):
    """Pixel values or image sizes that do not fit the model (shape, number of tiles, modality)."""


def hf_llava_config(hf_config: dict[str, Any]) -> Any:
    """The transformers config object (LlavaConfig, ...) of a LLaVA `config.json` dict: the
    vision and text sub-configs with every default filled in."""
    from transformers import AutoConfig

    kwargs = {k: v for k, v in hf_config.items() if k != "model_type"}
    return AutoConfig.for_model(str(hf_config.get("model_type", "llava")), **kwargs)


class LlavaMultiModalProjector(nn.Module):
    """linear_1 -> act -> linear_2 (HF's names, so checkpoint tensors map one to one)."""

    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))  # type: ignore[no-any-return]


# checkpoint prefixes of the two published layouts -> ours (first match wins)
_PREFIXES = [
    ("model.language_model.", "model."),  # transformers 5 modules
    ("language_model.model.", "model."),  # llava-hf hub
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.vision_resampler.", "vision_resampler."),
    ("model.image_newline", "image_newline"),
]
_TOWER_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.")


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """LLaVA-1.5. `encode_images` takes one (3, H, W) tensor per image (H = W = the tower's
    image_size, the processor's crop) and returns its (num_tokens, hidden) rows."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, max_positions=max_positions)
        hf = config.hf_config
        self.hf_vlm_config = hf_llava_config(hf)
        vision_config = self.hf_vlm_config.vision_config
        self.vision_tower = self._build_tower(vision_config)
        layers = self.vision_feature_layers
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision_config.hidden_size * len(layers), config.hidden_size,
            str(hf.get("projector_hidden_act", "gelu")), bool(hf.get("multimodal_projector_bias", True)),
        )
        self.image_token_id: int | None = int(self.hf_vlm_config.image_token_id)
        self.video_token_id: int | None = None
        # replaces `project_tiles`' eager path when set (e.g. CUDA graphs: runner/encoder_graph.py)
        self.tile_encoder: Callable[[torch.Tensor], torch.Tensor] | None = None

    # --- vision tower ---------------------------------------------------------------------

    @property
    def vision_feature_layers(self) -> list[int]:
        """The tower's hidden-state indices the features come from, as HF indexes them
        (0: the embeddings, i: after layer i; negative from the end of the full tower)."""
        layer = self.hf_vlm_config.vision_feature_layer
        return [int(layer)] if isinstance(layer, int) else [int(i) for i in layer]

    def _build_tower(self, vision_config: Any) -> nn.Module:
        from transformers import AutoModel

        tower = AutoModel.from_config(vision_config, dtype=torch.get_default_dtype())
        inner = getattr(tower, "vision_model", tower)  # transformers < 5.20 nests the transformer
        total = int(vision_config.num_hidden_layers)
        self._feature_index = [i if i >= 0 else total + 1 + i for i in self.vision_feature_layers]
        if not all(0 <= i <= total for i in self._feature_index):
            raise ValueError(f"vision_feature_layer {self.vision_feature_layers} is outside a {total}-layer tower")
        self._tower_layers = max(self._feature_index)
        # NOTE: the layers after the last selected one and the post-layernorm (and SigLIP's
        # pooling head) never touch the features: cut, so `last_hidden_state` is that layer's output
        inner.encoder.layers = inner.encoder.layers[: self._tower_layers]
        inner.post_layernorm = nn.Identity()
        if hasattr(inner, "head"):
            inner.use_head = False
            del inner.head
        self._tower_params = {_canonical_tower_name(n): f"vision_tower.{n}" for n, _ in tower.named_parameters()}
        return tower  # type: ignore[no-any-return]

    @property
    def feature_select_strategy(self) -> str:
        return token_counts.select_strategy(self.config.hf_config)

    def vision_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) -> the selected hidden states (N, rows, vision_hidden * layers), the CLS
        row dropped for the `default` strategy (HF's `get_image_features` before the projector)."""
        tower_param = next(self.vision_tower.parameters())
        pixels = pixel_values.to(device=tower_param.device, dtype=tower_param.dtype)
        if len(self._feature_index) == 1:
            feats = self.vision_tower(pixels, return_dict=True).last_hidden_state
        else:
            hidden = self.vision_tower(pixels, output_hidden_states=True, return_dict=True).hidden_states
            feats = torch.cat([hidden[i] for i in self._feature_index], dim=-1)
        if self.feature_select_strategy == "default":
            feats = feats[:, 1:]
        return feats  # type: ignore[no-any-return]

    def project_tiles(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) tiles -> projected features (N, rows, hidden): tower, feature selection,
        projector (through `tile_encoder` when one is installed)."""
        if self.tile_encoder is not None:
            return self.tile_encoder(pixel_values)
        return self.multi_modal_projector(self.vision_features(pixel_values))  # type: ignore[no-any-return]

    def tile_shape(self) -> tuple[int, int, int]:
        """(3, S, S): what `project_tiles` takes per tile."""
        size, _, _ = token_counts.vision_geometry(self.config.hf_config)
        return (3, size, size)

    # --- the model contract (docs/multimodal.md) ---------------------------------------------

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, hidden) embeddings in the model's dtype (a new tensor)."""
        return self.model.embed_tokens(input_ids)  # type: ignore[no-any-return]

    def _text_dtype(self) -> torch.dtype:
        # NOTE: the embedding's: the LM head may be FP8 (--quantize-lm-head), the embedding never is
        return self.model.embed_tokens.weight.dtype  # type: ignore[no-any-return]

    @torch.inference_mode()
    def encode_images(
        self, pixel_values: list[torch.Tensor], image_sizes: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """Per image (3, H, W) its embeddings (num_tokens, hidden) in the text dtype; one tower
        pass for all. `image_sizes` (height, width) of the originals (unused by LLaVA-1.5)."""
        if len(pixel_values) != len(image_sizes):
            raise MultimodalInputError(f"{len(pixel_values)} images but {len(image_sizes)} image sizes")
        if not pixel_values:
            return []
        size, _, _ = token_counts.vision_geometry(self.config.hf_config)
        for i, pixels in enumerate(pixel_values):
            if tuple(pixels.shape) != (3, size, size):
                raise MultimodalInputError(
                    f"image {i}: pixel_values of shape {tuple(pixels.shape)}, this model takes (3, {size}, {size})"
                )
        feats = self.project_tiles(torch.stack(pixel_values))
        return list(feats.to(self._text_dtype()).unbind(0))

    def encode_video(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Frames (F, 3, H, W) -> (num_tokens, hidden); this model takes no video."""
        raise MultimodalInputError(f"{self.config.architecture} takes no video")

    # --- weight loading -------------------------------------------------------------------

    def map_weight(self, name: str) -> tuple[str, tuple[int | slice, ...]] | None:
        """Both published layouts: transformers-5 names (`model.language_model.*`,
        `model.vision_tower.*`, ...) and llava-hf's (`language_model.model.*`,
        `vision_tower.vision_model.*`, ...); tensors of the cut tower layers are skipped."""
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if name.startswith("vision_tower."):
            tail = _canonical_tower_name(name[len("vision_tower.") :])
            if tail in self._tower_params:
                return self._tower_params[tail], ()
            m = _TOWER_LAYER.match(tail)
            if tail.startswith(("post_layernorm.", "head.")) or (m and int(m.group(1)) >= self._tower_layers):
                return None
            return name, ()  # unknown: load_weights reports it
        if name.startswith(("multi_modal_projector.", "vision_resampler.")) or name == "image_newline":
            return name, ()
        return super().map_weight(name)


def _canonical_tower_name(name: str) -> str:
    """A vision-tower parameter name without the `vision_model.` level (older transformers and
    the hub checkpoints have it, transformers 5.20+ does not)."""
    return name[len("vision_model.") :] if name.startswith("vision_model.") else name
