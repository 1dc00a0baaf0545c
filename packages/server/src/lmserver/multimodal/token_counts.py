"""How many embedding rows a LLaVA-family model produces per image / video (pure Python, no torch).

The functions read a model folder's `config.json` dict (`ModelConfig.hf_config`) and follow
HF transformers' LLaVA / LLaVA-NeXT / LLaVA-NeXT-Video modeling code (`select_best_resolution`,
`get_anyres_image_grid_shape`, `unpad_image`, the video pooler); `lmserver.models.llava` uses
the same helpers, so `num_image_tokens` equals the rows `encode_images` returns.
"""

from __future__ import annotations

from typing import Any

# vision tower model_type -> (image_size, patch_size) defaults of its HF config class, and
# whether its sequence starts with a CLS token
_TOWER_DEFAULTS: dict[str, tuple[int, int, bool]] = {
    "clip_vision_model": (224, 32, True),
    "siglip_vision_model": (224, 16, False),
}
_LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
_NEXT_MODEL_TYPES = ("llava_next", "llava_next_video")


class TokenCountError(ValueError):
    """The config (or the image size) does not describe a supported LLaVA-family input."""


def vision_geometry(hf_config: dict[str, Any]) -> tuple[int, int, bool]:
    """(image_size, patch_size, has_cls) of the vision tower of a LLaVA `config.json` dict."""
    vision = hf_config.get("vision_config") or {}
    model_type = vision.get("model_type", "clip_vision_model")
    if model_type not in _TOWER_DEFAULTS:
        raise TokenCountError(
            f"vision tower {model_type!r} is not supported; supported: {', '.join(sorted(_TOWER_DEFAULTS))}"
        )
    size, patch, has_cls = _TOWER_DEFAULTS[model_type]
    return int(vision.get("image_size", size)), int(vision.get("patch_size", patch)), has_cls


def select_strategy(hf_config: dict[str, Any]) -> str:
    strategy = str(hf_config.get("vision_feature_select_strategy", "default"))
    if strategy not in ("default", "full"):
        raise TokenCountError(f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}")
    return strategy


def grid_pinpoints(hf_config: dict[str, Any]) -> list[tuple[int, int]]:
    """The anyres resolutions (height, width) of a LLaVA-NeXT config."""
    points = hf_config.get("image_grid_pinpoints") or _LLAVA_NEXT_PINPOINTS
    return [(int(h), int(w)) for h, w in points]


def tokens_per_tile(hf_config: dict[str, Any]) -> int:
    """Rows one vision-tower input (a whole image, an anyres tile, a video frame) yields."""
    image_size, patch_size, has_cls = vision_geometry(hf_config)
    rows = (image_size // patch_size) ** 2 + (1 if has_cls else 0)
    return rows - 1 if select_strategy(hf_config) == "default" else rows


def select_best_resolution(original_size: tuple[int, int], possible: list[tuple[int, int]]) -> tuple[int, int]:
    """HF's `select_best_resolution`: the (height, width) among `possible` that keeps the most of
    an image of `original_size` (height, width) and wastes the least."""
    original_height, original_width = original_size
    best_fit = possible[0]
    max_effective, min_wasted = 0, float("inf")
    for height, width in possible:
        scale = min(width / original_width, height / original_height)
        down_w, down_h = int(original_width * scale), int(original_height * scale)
        effective = min(down_w * down_h, original_width * original_height)
        wasted = width * height - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            max_effective, min_wasted, best_fit = effective, wasted, (height, width)
    return best_fit


def anyres_grid_shape(image_size: tuple[int, int], hf_config: dict[str, Any]) -> tuple[int, int]:
    """(rows, columns) of anyres tiles for an image of `image_size` (height, width)."""
    tile = vision_geometry(hf_config)[0]
    height, width = select_best_resolution(image_size, grid_pinpoints(hf_config))
    return height // tile, width // tile


def num_anyres_patches(hf_config: dict[str, Any], image_size: tuple[int, int]) -> int:
    """Vision-tower inputs of one LLaVA-NeXT image: the base image plus its tiles (HF's
    `image_size_to_num_patches`); the first dim of the processor's `pixel_values`."""
    rows, cols = anyres_grid_shape(image_size, hf_config)
    return rows * cols + 1


def unpad_bounds(current: tuple[int, int], original_size: tuple[int, int]) -> tuple[int, int, int, int]:
    """HF's `unpad_image` as index bounds: (top, bottom, left, right) of the part of a feature map
    of `current` (height, width) that covers an image of `original_size` (height, width)."""
    current_height, current_width = current
    original_height, original_width = original_size
    if original_width / original_height > current_width / current_height:
        new_height = int(round(original_height * (current_width / original_width), 7))
        padding = (current_height - new_height) // 2
        return padding, current_height - padding, 0, current_width
    new_width = int(round(original_width * (current_height / original_height), 7))
    padding = (current_width - new_width) // 2
    return 0, current_height, padding, current_width - padding


def _check_size(image_size: tuple[int, int]) -> tuple[int, int]:
    height, width = int(image_size[0]), int(image_size[1])
    if height <= 0 or width <= 0:
        raise TokenCountError(f"image size must be positive (height, width), got {image_size!r}")
    return height, width


def num_image_tokens(hf_config: dict[str, Any], image_size: tuple[int, int]) -> int:
    """Embedding rows of one image of `image_size` (height, width) of the original image.

    LLaVA-1.5: one tower pass (the size does not matter). LLaVA-NeXT(-Video): the base image,
    then the unpadded tiles with one `image_newline` row after each feature row.
    """
    size = _check_size(image_size)
    per_tile = tokens_per_tile(hf_config)
    if hf_config.get("model_type") not in _NEXT_MODEL_TYPES:
        return per_tile
    tile, patch, _ = vision_geometry(hf_config)
    side = tile // patch
    rows, cols = anyres_grid_shape(size, hf_config)
    top, bottom, left, right = unpad_bounds((rows * side, cols * side), size)
    height, width = bottom - top, right - left
    return per_tile + height * (width + 1)


def pooled_side(hf_config: dict[str, Any]) -> int:
    """Side of one video frame's feature map after the LLaVA-NeXT-Video pooler."""
    side = int(tokens_per_tile(hf_config) ** 0.5)  # HF: int(math.sqrt(seq_len))
    stride = int(hf_config.get("spatial_pool_stride", 2))
    mode = hf_config.get("spatial_pool_mode", "average")
    if mode not in ("average", "max", "conv"):
        raise TokenCountError(f"spatial_pool_mode must be 'average', 'max' or 'conv', got {mode!r}")
    return (side - stride) // stride + 1


def num_video_tokens(hf_config: dict[str, Any], num_frames: int) -> int:
    """Embedding rows of a video of `num_frames` frames (LLaVA-NeXT-Video: pooled per frame)."""
    if hf_config.get("model_type") != "llava_next_video":
        raise TokenCountError(f"model type {hf_config.get('model_type')!r} takes no video")
    if num_frames <= 0:
        raise TokenCountError(f"a video needs at least one frame, got {num_frames}")
    return num_frames * pooled_side(hf_config) ** 2
