"""Tiny random LLaVA-family model folders for tests (HF transformers writes them; no download).

`make_tiny_llava_folder(path, kind)` writes what a llava-hf checkpoint folder holds: `config.json`
and `model.safetensors` (float32, transformers' `save_pretrained`), the embedded SmolLM2
tokenizer with `<image>` (and `<video>`) added as special tokens, a llava-hf style chat template,
`preprocessor_config.json` (CLIPImageProcessor / LlavaNextImageProcessor fields),
`video_preprocessor_config.json` for video and `processor_config.json`. Deterministic per seed.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

KINDS = ("llava", "llava_next", "llava_next_video")
IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# tower input size per kind (patch 14): LLaVA-1.5 4 x 4 patches; NeXT tiles of 2 x 2 patches
IMAGE_SIZE = {"llava": 56, "llava_next": 28, "llava_next_video": 28}
GRID_PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]

# llava-hf's template (USER: <image>\n... ASSISTANT:), also taking string contents and videos
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'system' -%}{{ message['role'].upper() + ': ' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] + ' ' }}"
    "{%- else -%}"
    "{%- for content in message['content'] -%}"
    "{%- if content['type'] in ('image', 'image_url') -%}{{ '<image>\n' }}"
    "{%- elif content['type'] in ('video', 'video_url') -%}{{ '<video>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'text' -%}{{ content['text'] + ' ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)


# (name, config.json, preprocessor_config.json): published-shape processor configurations the
# preprocessing tests compare with transformers (the last, NeXT anyres, has no device plan)
CLIP_336_TOWER: dict[str, Any] = {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14}
LLAVA_CONFIG: dict[str, Any] = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
                                "vision_config": CLIP_336_TOWER, "vision_feature_select_strategy": "default",
                                "image_token_index": 32000}
ANYRES_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
LLAVA_NEXT_CONFIG: dict[str, Any] = dict(LLAVA_CONFIG, model_type="llava_next",
                                         architectures=["LlavaNextForConditionalGeneration"],
                                         image_grid_pinpoints=ANYRES_PINPOINTS)
CLIP_336_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 336},
    "crop_size": {"height": 336, "width": 336}, "resample": 3, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
    "do_resize": True, "do_center_crop": True, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "do_convert_rgb": True}
PROCESSOR_CONFIGS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("llava-1.5 CLIP", LLAVA_CONFIG, CLIP_336_PREPROCESSOR),
    ("llava pad-to-square", LLAVA_CONFIG,
     dict(CLIP_336_PREPROCESSOR, image_processor_type="LlavaImageProcessor", do_pad=True)),
    ("siglip 384 bilinear", dict(LLAVA_CONFIG, vision_config={"model_type": "siglip_vision_model",
                                                              "image_size": 384, "patch_size": 14}),
     {"image_processor_type": "SiglipImageProcessor", "size": {"height": 384, "width": 384}, "resample": 2,
      "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_normalize": True, "do_rescale": True,
      "rescale_factor": 1 / 255, "do_resize": True}),
    ("old int sizes, crop > resize", dict(LLAVA_CONFIG, vision_config=dict(CLIP_336_TOWER, image_size=240)),
     {"image_processor_type": "CLIPImageProcessor", "size": 224, "crop_size": 240, "resample": 2}),
    ("shortest+longest edge, lanczos, no normalize", LLAVA_CONFIG,
     {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 200, "longest_edge": 260},
      "crop_size": {"height": 224, "width": 224}, "do_normalize": False, "resample": 1}),
    ("llava-next anyres", LLAVA_NEXT_CONFIG,
     dict(CLIP_336_PREPROCESSOR, image_processor_type="LlavaNextImageProcessor",
          image_grid_pinpoints=ANYRES_PINPOINTS)),
]

def random_png(seed: int, width: int = 40, height: int = 56) -> bytes:
    """A PNG of uniformly random RGB pixels, deterministic per seed (PIL writes it)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def tiny_llava_hf_config(
    kind: str, vocab_size: int, image_token_id: int, video_token_id: int | None = None,
    eos_token_id: int = 2, bos_token_id: int = 1, overrides: dict[str, Any] | None = None,
) -> Any:
    """The transformers config (LlavaConfig, LlavaNextConfig, LlavaNextVideoConfig) of a tiny
    model: Llama text (hidden 64, 2 layers, 4 heads, 2 KV heads), CLIP tower (hidden 32, 2
    layers, patch 14). `overrides` updates the top-level fields; its `text_config` /
    `vision_config` dicts update those (a `vision_config` with `model_type` replaces it)."""
    import transformers

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    overrides = dict(overrides or {})
    text = dict(
        model_type="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    text.update(overrides.pop("text_config", {}))
    vision_over = overrides.pop("vision_config", {})
    vision: dict[str, Any] = {} if "model_type" in vision_over else dict(
        model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, image_size=IMAGE_SIZE[kind], patch_size=14, projection_dim=32,
    )
    vision.update(vision_over)
    top: dict[str, Any] = dict(
        text_config=text, vision_config=vision, image_token_index=image_token_id, projector_hidden_act="gelu",
        vision_feature_layer=-2, vision_feature_select_strategy="default", tie_word_embeddings=False,
    )
    if kind != "llava":
        top["image_grid_pinpoints"] = GRID_PINPOINTS
    if kind == "llava_next_video":
        top.update(video_token_index=video_token_id, spatial_pool_mode="average", spatial_pool_stride=2)
    top.update(overrides)
    config_cls = {
        "llava": transformers.LlavaConfig, "llava_next": transformers.LlavaNextConfig,
        "llava_next_video": transformers.LlavaNextVideoConfig,
    }[kind]
    return config_cls(**top)


def tiny_llava_hf_model(config: Any, seed: int = 0) -> Any:
    """A random HF model of `config` (float32, eval) whose norms, biases and image_newline are
    random too, so every weight shows in the outputs."""
    import torch
    import transformers

    model_cls = {
        "llava": transformers.LlavaForConditionalGeneration,
        "llava_next": transformers.LlavaNextForConditionalGeneration,
        "llava_next_video": transformers.LlavaNextVideoForConditionalGeneration,
    }[config.model_type]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("bias") or "norm" in name or "image_newline" in name:
                noise = torch.randn(param.shape, generator=gen) * 0.5
                param.copy_(noise + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return model


def _processor_files(folder: Path, kind: str, image_size: int) -> None:
    image = {
        "crop_size": {"height": image_size, "width": image_size}, "do_center_crop": True, "do_convert_rgb": True,
        "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD, "resample": 3, "rescale_factor": 1 / 255, "size": {"shortest_edge": image_size},
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
    }
    processor: dict[str, Any] = {
        "image_token": IMAGE_TOKEN, "num_additional_image_tokens": 1, "patch_size": 14,
        "vision_feature_select_strategy": "default", "processor_class": "LlavaProcessor",
    }
    if kind != "llava":
        image.update(image_processor_type="LlavaNextImageProcessor", processor_class="LlavaNextProcessor",
                     image_grid_pinpoints=GRID_PINPOINTS, do_pad=True)
        processor["processor_class"] = "LlavaNextProcessor"
    if kind == "llava_next_video":
        image["processor_class"] = processor["processor_class"] = "LlavaNextVideoProcessor"
        processor["video_token"] = VIDEO_TOKEN
        video = {k: v for k, v in image.items() if k not in ("image_grid_pinpoints", "do_pad")}
        video.update(video_processor_type="LlavaNextVideoVideoProcessor")
        (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2))


def make_tiny_llava_folder(
    path: str | Path, kind: str = "llava", seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Writes a tiny random `kind` model folder at `path` (created if missing); returns it.

    `overrides`: config fields (see `tiny_llava_hf_config`). Weights depend on `seed` only.
    """
    from tokenizers import AddedToken

    from lmserver.config import ServerConfig
    from lmserver.testing import load_test_tokenizer

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tok = load_test_tokenizer(ServerConfig())
    special = [IMAGE_TOKEN] + ([VIDEO_TOKEN] if kind == "llava_next_video" else [])
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    video_id = tok.convert_tokens_to_ids(VIDEO_TOKEN) if kind == "llava_next_video" else None
    config = tiny_llava_hf_config(
        kind, len(tok), image_id, video_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        overrides=overrides,
    )
    tiny_llava_hf_model(config, seed).save_pretrained(folder)
    tok.save_pretrained(folder)
    _processor_files(folder, kind, int(config.vision_config.image_size))
    return folder
