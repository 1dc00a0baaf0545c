"""Image / video preprocessing for LLaVA-family models with pillow + numpy (no torch, no torchvision).

`ImageProcessor.from_model_folder(path)` reads the folder's `preprocessor_config.json` (and
`video_preprocessor_config.json` when present) and `config.json`; `process_image(bytes)` and
`process_video(bytes, num_frames)` return plain data (`ProcessedImage`, `ProcessedVideo`) whose
`pixel_values` equal, bit for bit, what transformers' slow (PIL) image processors produce for
the same decoded image (`CLIPImageProcessorPil`, `LlavaImageProcessorPil`,
`LlavaNextImageProcessorPil`, `SiglipImageProcessorPil`, which `AutoImageProcessor` picks when
torchvision is absent). The fast (torchvision) processors resize float tensors with
torchvision's antialiased kernels and so differ from these by resampling rounding (a few 1e-2
after normalization at most on edges), as do transformers' torch video processors for frames.

Steps, as the slow processors do them (uint8 throughout until the last step):
  open (format allow-list, pixel limit checked on the header, before decoding) -> full decode
  -> EXIF orientation applied (as `transformers.image_utils.load_image` does) -> RGB (HF's
  `convert_to_rgb`: images with alpha or a transparency key are composited on white)
  -> [LlavaImageProcessor do_pad: pad to square with the mean color]
  -> [LLaVA-NeXT anyres: base image resized to the crop size + tiles of the best pinpoint]
  -> resize (PIL, the config's resample) -> center crop -> rescale + normalize (one
  float32 lookup table per channel: the same float64 -> float32 operations HF applies).

Runs in the HTTP process (in a thread): pure CPU, no torch.

Device path: `decode_image(bytes)` stops after the RGB conversion and returns the decoded uint8
pixels with an `ImagePlan` (plain data: pad, resize, crop sizes and the lookup table) for the
rest, which `lmserver.multimodal.gpu_preprocess.run_plan` runs with torch on any device, bit for
bit equal to `process_image` (the resize is a port of pillow's fixed-point resampling). LLaVA-NeXT
anyres has no plan (`decode_image` returns None): it stays on `process_image`.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from lmserver.io_struct import InvalidRequestError
from lmserver.multimodal import token_counts
from lmserver.multimodal.token_counts import select_best_resolution

__all__ = [
    "DecodedImage",
    "ImagePlan",
    "ImageProcessor",
    "ProcessedImage",
    "ProcessedVideo",
    "ProcessorLimits",
    "shortest_edge_size",
]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
MULTIMODAL_MODEL_TYPES = ("llava", "llava_next", "llava_next_video")
_ARCH_TO_MODEL_TYPE = {
    "LlavaForConditionalGeneration": "llava",
    "LlavaNextForConditionalGeneration": "llava_next",
    "LlavaNextVideoForConditionalGeneration": "llava_next_video",
}

_CLIP_LIKE: dict[str, Any] = {
    "do_resize": True, "size": {"shortest_edge": 224}, "resample": 3,
    "do_center_crop": True, "crop_size": {"height": 224, "width": 224},
    "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD,
    "do_convert_rgb": True, "do_pad": False,
}
# The class defaults of transformers' image processors (a config's fields override them).
_PROCESSOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": _CLIP_LIKE,
    "LlavaImageProcessor": _CLIP_LIKE,
    "LlavaNextImageProcessor": _CLIP_LIKE,
    "LlavaNextVideoImageProcessor": _CLIP_LIKE,
    "LlavaNextVideoVideoProcessor": _CLIP_LIKE,
    "SiglipImageProcessor": {
        "do_resize": True, "size": {"height": 224, "width": 224}, "resample": 3,
        "do_center_crop": False, "crop_size": None,
        "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": IMAGENET_STANDARD_MEAN, "image_std": IMAGENET_STANDARD_STD,
        "do_convert_rgb": True, "do_pad": False,
    },
}

DEFAULT_IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")  # JPEG covers MPO (phone photos)


@dataclass(frozen=True)
class ProcessorLimits:
    """What one request's image or video may cost the HTTP process."""

    max_pixels: int = 25_000_000  # width * height of an image or a video frame, checked before decoding
    max_frames: int = 64  # frames sampled from one video
    max_decoded_frames: int = 20_000  # frames a video may have (all are decoded to sample them)
    image_formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS  # pillow format names accepted

    def __post_init__(self) -> None:
        if self.max_pixels < 1 or self.max_frames < 1 or self.max_decoded_frames < 1:
            raise ValueError(f"ProcessorLimits values must be >= 1, got {self}")


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One preprocessed image. `pixel_values` is (3, H, W) for LLaVA-1.5 / SigLIP-style
    processors and (num_patches, 3, H, W) for LLaVA-NeXT anyres (base image first, then the
    tiles row by row, as `LlavaNextImageProcessor` lays them out, unpadded)."""

    pixel_values: np.ndarray  # float32
    image_size: tuple[int, int]  # (height, width) of the decoded image, EXIF orientation applied
    num_tokens: int  # embedding rows the model produces for this image


@dataclass(frozen=True, eq=False)
class ProcessedVideo:
    """Frames sampled uniformly over the whole video, each preprocessed like an image (no anyres)."""

    pixel_values: np.ndarray  # (num_frames, 3, H, W) float32
    num_frames: int  # frames sampled: min(requested, frames in the video)
    num_tokens: int  # embedding rows the model produces for the video


@dataclass(frozen=True, eq=False)
class ImagePlan:
    """The steps after decoding, as plain data (picklable, torch-free): from a decoded (H, W, 3)
    uint8 RGB image, in order: [pad to a square of `pad_color`, centered, offsets floored] ->
    [PIL resize to `resize_hw` with filter `resample`] -> [HF center crop to `crop_hw`, zero
    padding when larger] -> `lut[c][pixel]` per channel: (3, H, W) float32 pixel_values.
    `lmserver.multimodal.gpu_preprocess.run_plan` runs it with torch."""

    pad_square: bool  # LlavaImageProcessor do_pad
    pad_color: tuple[int, int, int]
    resize_hw: tuple[int, int] | None  # (height, width) after the pad; None: no resize
    resample: int  # PIL filter code (0 NEAREST, 1 LANCZOS, 2 BILINEAR, 3 BICUBIC, 4 BOX, 5 HAMMING)
    crop_hw: tuple[int, int] | None  # (height, width); None: no center crop
    lut: np.ndarray  # (3, 256) float32, shared by every plan of one processor: never write to it

    def output_hw(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the pixel_values this plan makes from a (height, width) image."""
        if self.pad_square:
            height = width = max(height, width)
        if self.resize_hw is not None:
            height, width = self.resize_hw
        return self.crop_hw if self.crop_hw is not None else (height, width)


@dataclass(frozen=True, eq=False)
class DecodedImage:
    """One image decoded for device preprocessing: `run_plan(pixels, plan)` equals
    `process_image(...).pixel_values` bit for bit."""

    pixels: np.ndarray  # (H, W, 3) uint8 RGB, C-contiguous, writable; EXIF orientation applied
    plan: ImagePlan
    image_size: tuple[int, int]  # (height, width) of `pixels`
    num_tokens: int  # embedding rows the model produces for this image


@dataclass(frozen=True)
class _Size:
    """transformers' SizeDict subset: shortest_edge (+ longest_edge), or height and width."""

    shortest_edge: int | None = None
    longest_edge: int | None = None
    height: int | None = None
    width: int | None = None

    @staticmethod
    def parse(value: Any, what: str, square_int: bool) -> _Size:
        if isinstance(value, int) and not isinstance(value, bool):
            return _Size(height=value, width=value) if square_int else _Size(shortest_edge=value)
        if isinstance(value, Sequence) and len(value) == 2:
            return _Size(height=int(value[0]), width=int(value[1]))
        if isinstance(value, Mapping):
            keys = {k: int(v) for k, v in value.items() if v is not None}
            if "shortest_edge" in keys:
                return _Size(shortest_edge=keys["shortest_edge"], longest_edge=keys.get("longest_edge"))
            if "height" in keys and "width" in keys:
                return _Size(height=keys["height"], width=keys["width"])
        raise ValueError(f"unsupported {what} {value!r}: expected shortest_edge or height and width")

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing a (height, width) image, as transformers' PilBackend.resize."""
        if self.shortest_edge and self.longest_edge:
            new_height, new_width = _size_with_aspect_ratio(height, width, self.shortest_edge, self.longest_edge)
            # NOTE: transformers fails on a side rounded to 0 (a 1 x 600 strip); we keep 1 pixel.
            return max(1, new_height), max(1, new_width)
        if self.shortest_edge:
            return shortest_edge_size(height, width, self.shortest_edge)
        assert self.height is not None and self.width is not None
        return self.height, self.width


def shortest_edge_size(height: int, width: int, size: int) -> tuple[int, int]:
    """transformers' `get_resize_output_image_size(default_to_square=False)`: the short side
    becomes `size`, the long side `int(size * long / short)` (truncated)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _size_with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers' `get_size_with_aspect_ratio`."""
    raw_size = None
    lo, hi = float(min(height, width)), float(max(height, width))
    if hi / lo * size > max_size:
        raw_size = max_size * lo / hi
        size = int(round(raw_size))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return (int(raw_size * height / width) if raw_size is not None else int(size * height / width)), size
    return size, (int(raw_size * width / height) if raw_size is not None else int(size * width / height))


def _patch_output_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """transformers' `get_patch_output_size`: fit (height, width) inside target keeping the aspect."""
    target_height, target_width = target
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_height), target_width
    return target_height, min(math.ceil(width * scale_h), target_width)


def _center_crop(image: np.ndarray, crop_height: int, crop_width: int) -> np.ndarray:
    """transformers' `center_crop` on an (H, W, C) array: integer-division offsets; zero padding
    (centered, ceil) when the crop is larger than the image."""
    orig_height, orig_width = image.shape[:2]
    top = (orig_height - crop_height) // 2
    left = (orig_width - crop_width) // 2
    bottom, right = top + crop_height, left + crop_width
    if top >= 0 and bottom <= orig_height and left >= 0 and right <= orig_width:
        return image[top:bottom, left:right]
    new_height, new_width = max(crop_height, orig_height), max(crop_width, orig_width)
    padded = np.zeros((new_height, new_width) + image.shape[2:], dtype=image.dtype)
    top_pad = math.ceil((new_height - orig_height) / 2)
    left_pad = math.ceil((new_width - orig_width) / 2)
    padded[top_pad:top_pad + orig_height, left_pad:left_pad + orig_width] = image
    top, bottom, left, right = top + top_pad, bottom + top_pad, left + left_pad, right + left_pad
    return padded[max(0, top):min(new_height, bottom), max(0, left):min(new_width, right)]


def _triple(value: Any, what: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    values = tuple(float(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"{what} must have 3 values (RGB), got {value!r}")
    return values  # type: ignore[return-value]


@dataclass(frozen=True, eq=False)
class _Pipeline:
    """One processor config's per-image steps (after RGB conversion)."""

    do_resize: bool
    size: _Size
    resample: int
    do_center_crop: bool
    crop_size: tuple[int, int] | None  # (height, width)
    pad_to_square: bool  # LlavaImageProcessor do_pad
    pad_color: tuple[int, int, int]
    lut: np.ndarray  # (3, 256) float32: uint8 value -> rescaled, normalized value per channel

    @staticmethod
    def from_config(cfg: Mapping[str, Any], processor_type: str) -> _Pipeline:
        defaults = _PROCESSOR_DEFAULTS[processor_type]

        def get(key: str) -> Any:
            value = cfg.get(key)
            return defaults[key] if value is None else value

        size = _Size.parse(get("size"), "size", square_int=False)
        crop = get("crop_size")
        crop_size: tuple[int, int] | None = None
        do_center_crop = bool(get("do_center_crop"))
        if do_center_crop and crop is None:
            raise ValueError("do_center_crop needs a crop_size")
        if crop is not None:
            parsed = _Size.parse(crop, "crop_size", square_int=True)
            if parsed.height is None or parsed.width is None:
                raise ValueError(f"crop_size must have height and width, got {crop!r}")
            crop_size = (parsed.height, parsed.width)
        resample = int(get("resample"))
        if resample not in (0, 1, 2, 3, 4, 5):
            raise ValueError(f"unsupported resample {resample} (a PIL filter code 0..5)")
        mean, std = _triple(get("image_mean"), "image_mean"), _triple(get("image_std"), "image_std")
        # NOTE: exactly transformers' rescale (float64 multiply, then float32) and normalize
        # (float32 (x - mean) / std), tabulated over the 256 uint8 values.
        values = np.arange(256, dtype=np.uint8)
        channel = (values.astype(np.float64) * float(get("rescale_factor"))).astype(np.float32) \
            if get("do_rescale") else values.astype(np.float32)
        if get("do_normalize"):
            mean32, std32 = np.array(mean, dtype=np.float32), np.array(std, dtype=np.float32)
            lut = (channel[None, :] - mean32[:, None]) / std32[:, None]
        else:
            lut = np.broadcast_to(channel, (3, 256)).copy()
        return _Pipeline(
            do_resize=bool(get("do_resize")), size=size, resample=resample,
            do_center_crop=do_center_crop, crop_size=crop_size,
            pad_to_square=processor_type == "LlavaImageProcessor" and bool(get("do_pad")),
            pad_color=tuple(int(x * 255) for x in mean),  # type: ignore[arg-type]
            lut=lut.astype(np.float32),
        )

    def resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        return image.resize((width, height), resample=self.resample)

    def plan(self, height: int, width: int) -> ImagePlan:
        """The pad (when `pad_to_square`) + `finish` steps for a decoded (height, width) RGB image."""
        if self.pad_to_square:
            height = width = max(height, width)
        return ImagePlan(
            pad_square=self.pad_to_square, pad_color=self.pad_color,
            resize_hw=self.size.output_size(height, width) if self.do_resize else None,
            resample=self.resample, crop_hw=self.crop_size if self.do_center_crop else None, lut=self.lut,
        )

    def finish(self, image: Image.Image) -> np.ndarray:
        """resize -> center crop -> rescale/normalize: (3, H, W) float32."""
        if self.do_resize:
            image = self.resize(image, *self.size.output_size(image.height, image.width))
        pixels = np.asarray(image)  # (H, W, 3) uint8
        if self.do_center_crop:
            assert self.crop_size is not None
            pixels = _center_crop(pixels, *self.crop_size)
        chw = pixels.transpose(2, 0, 1)
        return self.lut[np.arange(3)[:, None, None], chw]


@dataclass(frozen=True)
class _ModelSpec:
    """What of config.json decides the pixel layout (token counts: `token_counts`)."""

    model_type: str  # one of MULTIMODAL_MODEL_TYPES
    image_size: int  # vision tower input side
    has_cls: bool
    grid_pinpoints: tuple[tuple[int, int], ...] | None  # (height, width); LLaVA-NeXT(-Video) only

    @staticmethod
    def from_hf_config(hf: Mapping[str, Any]) -> _ModelSpec | None:
        model_type = _model_type(hf)
        if model_type is None:
            return None
        token_config = dict(hf, model_type=model_type)
        image_size, _, has_cls = token_counts.vision_geometry(token_config)
        pinpoints = None if model_type == "llava" else tuple(token_counts.grid_pinpoints(token_config))
        return _ModelSpec(model_type, image_size, has_cls, pinpoints)


def _model_type(hf: Mapping[str, Any]) -> str | None:
    """The LLaVA family member of config.json, None for a text-only config; raises for a
    multimodal config of another family."""
    model_type = hf.get("model_type")
    if model_type in MULTIMODAL_MODEL_TYPES:
        return str(model_type)
    for arch in hf.get("architectures") or ():
        if arch in _ARCH_TO_MODEL_TYPE:
            return _ARCH_TO_MODEL_TYPE[arch]
    if "vision_config" in hf:
        raise ValueError(f"unsupported multimodal model type {model_type!r} "
                         f"(supported: {', '.join(MULTIMODAL_MODEL_TYPES)})")
    return None


def _processor_type(cfg: Mapping[str, Any], key: str, fallback: str) -> str:
    name = str(cfg.get(key) or fallback)
    for suffix in ("Fast", "Pil"):
        name = name.removesuffix(suffix)
    if name not in _PROCESSOR_DEFAULTS:
        raise ValueError(f"unsupported {key} {name!r} (supported: {', '.join(sorted(_PROCESSOR_DEFAULTS))})")
    return name


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    value = json.loads(path.read_text())
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return value


class ImageProcessor:
    """Bytes -> `ProcessedImage` / `ProcessedVideo` for one LLaVA-family model. Immutable after
    construction; `process_image` and `process_video` are thread-safe and raise
    `InvalidRequestError` for bad input."""

    def __init__(self, hf_config: Mapping[str, Any], preprocessor_config: Mapping[str, Any] | None = None,
                 video_preprocessor_config: Mapping[str, Any] | None = None,
                 limits: ProcessorLimits | None = None) -> None:
        """Raises ValueError for a config this module does not support (or a text-only one:
        use `from_configs` / `from_model_folder` to get None instead)."""
        spec = _ModelSpec.from_hf_config(hf_config)
        if spec is None:
            raise ValueError("config.json is not a LLaVA-family multimodal config")
        self.spec = spec
        self.hf_config: dict[str, Any] = dict(hf_config)
        # NOTE: token_counts keys on model_type; a config naming only its architecture gets it here.
        self._token_config = dict(hf_config, model_type=spec.model_type)
        token_counts.tokens_per_tile(self._token_config)  # its config errors surface at load, not per request
        self.limits = limits or ProcessorLimits()
        fallback = "SiglipImageProcessor" if not spec.has_cls else "CLIPImageProcessor"
        if preprocessor_config is None:  # the tower's own input size
            side = spec.image_size
            preprocessor_config = {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}
            if fallback == "SiglipImageProcessor":
                preprocessor_config = {"size": {"height": side, "width": side}}
        self.processor_type = _processor_type(preprocessor_config, "image_processor_type", fallback)
        self.image_pipeline = _Pipeline.from_config(preprocessor_config, self.processor_type)
        if video_preprocessor_config is not None:
            video_cfg = video_preprocessor_config
            video_type = _processor_type(video_cfg, "video_processor_type",
                                         str(video_cfg.get("image_processor_type") or "LlavaNextVideoVideoProcessor"))
        else:
            video_cfg, video_type = preprocessor_config, self.processor_type
        self.video_pipeline = _Pipeline.from_config(video_cfg, video_type)
        self.default_num_frames = int(video_cfg.get("num_frames") or 8)
        if spec.grid_pinpoints is not None:
            given = preprocessor_config.get("image_grid_pinpoints")
            if given and tuple((int(h), int(w)) for h, w in given) != spec.grid_pinpoints \
                    and hf_config.get("image_grid_pinpoints"):
                raise ValueError("image_grid_pinpoints differ between config.json and preprocessor_config.json; "
                                 "the model tiles with config.json's")
        self.patch_side = self._patch_side()
        if spec.grid_pinpoints is not None and self.patch_side != spec.image_size:
            raise ValueError(f"anyres tiles of {self.patch_side} pixels (preprocessor crop_size) but a vision tower "
                             f"of {spec.image_size} (config.json vision_config.image_size): the model cannot pack them")

    def _patch_side(self) -> int:
        """The side of each processed image / anyres tile (LlavaNextImageProcessor's patch_size)."""
        pipeline = self.image_pipeline
        if pipeline.crop_size is not None:
            return pipeline.crop_size[0]
        return pipeline.size.height or pipeline.size.shortest_edge or self.spec.image_size

    @classmethod
    def from_configs(cls, hf_config: Mapping[str, Any], preprocessor_config: Mapping[str, Any] | None = None,
                     video_preprocessor_config: Mapping[str, Any] | None = None,
                     limits: ProcessorLimits | None = None) -> ImageProcessor | None:
        """None when `hf_config` is not a multimodal config (a text-only model takes no images)."""
        if _model_type(hf_config) is None:
            return None
        return cls(hf_config, preprocessor_config, video_preprocessor_config, limits)

    @classmethod
    def from_model_folder(cls, path: str | Path, limits: ProcessorLimits | None = None) -> ImageProcessor | None:
        """The processor of a HF-style model folder (config.json, preprocessor_config.json,
        optional video_preprocessor_config.json); None for a text-only model. Raises ValueError
        for a multimodal config this module does not support."""
        folder = Path(path)
        hf_config = _read_json(folder / "config.json") or {}
        return cls.from_configs(hf_config, _read_json(folder / "preprocessor_config.json"),
                                _read_json(folder / "video_preprocessor_config.json"), limits)

    @property
    def supports_video(self) -> bool:
        return self.spec.model_type == "llava_next_video"

    # -- images ---------------------------------------------------------------------------------

    def process_image(self, data: bytes) -> ProcessedImage:
        """Decodes and preprocesses one image; raises InvalidRequestError for bytes that are not a
        readable image of an accepted format, or one over `limits.max_pixels`."""
        image = _decode_image(data, self.limits)
        image_size = (image.height, image.width)
        if self.spec.grid_pinpoints is not None:
            pixel_values = self._anyres(image)
        else:
            pipeline = self.image_pipeline
            if pipeline.pad_to_square:
                image = _expand_to_square(image, pipeline.pad_color)
            pixel_values = pipeline.finish(image)
        return ProcessedImage(pixel_values, image_size, self.num_image_tokens(image_size))

    @property
    def has_image_plan(self) -> bool:
        """Whether `decode_image` gives a plan (False for LLaVA-NeXT anyres: use `process_image`)."""
        return self.spec.grid_pinpoints is None

    def decode_image(self, data: bytes) -> DecodedImage | None:
        """`process_image` up to the RGB conversion (the same checks and errors): the decoded
        pixels and the plan of the remaining steps. None (before decoding anything) when this
        processor has no plan (`has_image_plan`); then use `process_image`."""
        if not self.has_image_plan:
            return None
        image = _decode_image(data, self.limits)
        image_size = (image.height, image.width)
        pixels = np.array(image, dtype=np.uint8)  # a writable copy (np.asarray of a PIL image is read-only)
        return DecodedImage(pixels, self.image_pipeline.plan(*image_size), image_size,
                            self.num_image_tokens(image_size))

    def _anyres(self, image: Image.Image) -> np.ndarray:
        """LlavaNextImageProcessor: [base image resized to the crop size] + tiles of the image
        resized into the best pinpoint resolution and zero-padded to it. (num_patches, 3, H, W)"""
        pipeline, side = self.image_pipeline, self.patch_side
        assert self.spec.grid_pinpoints is not None
        best = select_best_resolution((image.height, image.width), list(self.spec.grid_pinpoints))
        new_height, new_width = _patch_output_size(image.height, image.width, best)
        resized = np.asarray(pipeline.resize(image, new_height, new_width))
        pad_y, rest_y = divmod(best[0] - new_height, 2)
        pad_x, rest_x = divmod(best[1] - new_width, 2)
        padded = np.pad(resized, ((pad_y, pad_y + rest_y), (pad_x, pad_x + rest_x), (0, 0)))
        size = pipeline.size
        base_hw = (size.height, size.width) if size.height and size.width else (size.shortest_edge,) * 2
        patches = [pipeline.resize(image, *base_hw)]  # type: ignore[arg-type]
        for top in range(0, padded.shape[0], side):
            for left in range(0, padded.shape[1], side):
                patches.append(Image.fromarray(padded[top:top + side, left:left + side]))
        return np.stack([pipeline.finish(patch) for patch in patches])

    def num_image_tokens(self, image_size: tuple[int, int]) -> int:
        """Embedding rows the model produces for an image of `image_size` (height, width)."""
        return token_counts.num_image_tokens(self._token_config, image_size)

    # -- video ----------------------------------------------------------------------------------

    def process_video(self, data: bytes, num_frames: int) -> ProcessedVideo:
        """Decodes a video (PyAV), samples `num_frames` frames uniformly over all its frames
        (fewer when it has fewer) and preprocesses each like an image; raises
        InvalidRequestError for bytes that are not a decodable video or a bad `num_frames`."""
        if not self.supports_video:
            raise InvalidRequestError(f"this model ({self.spec.model_type}) does not take video inputs")
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or \
                not 1 <= num_frames <= self.limits.max_frames:
            raise InvalidRequestError(f"num_frames must be an integer in [1, {self.limits.max_frames}], "
                                      f"got {num_frames!r}")
        from lmserver.multimodal.video import decode_frames

        frames = decode_frames(data, num_frames, max_pixels=self.limits.max_pixels,
                               max_decoded_frames=self.limits.max_decoded_frames)
        processed = [self.video_pipeline.finish(Image.fromarray(frame)) for frame in frames]
        if len({frame.shape for frame in processed}) != 1:
            raise InvalidRequestError("video frames change size mid-stream and this model's processor does not "
                                      "crop them to one size")
        return ProcessedVideo(np.stack(processed), len(frames), self.num_video_tokens(len(frames)))

    def num_video_tokens(self, num_frames: int) -> int:
        """Embedding rows the model produces for a video of `num_frames` sampled frames."""
        return token_counts.num_video_tokens(self._token_config, num_frames)


def _decode_image(data: bytes, limits: ProcessorLimits) -> Image.Image:
    """bytes -> an RGB PIL image (EXIF orientation applied), fully decoded."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidRequestError(f"image data must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise InvalidRequestError("image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=list(limits.image_formats))
    except Image.DecompressionBombError as e:
        raise InvalidRequestError(f"image too large: {e}") from None
    except UnidentifiedImageError:
        raise InvalidRequestError(
            f"not an image this server reads (accepted formats: {', '.join(limits.image_formats)})") from None
    except Exception as e:  # pillow raises many types on malformed headers
        raise InvalidRequestError(f"unreadable image: {type(e).__name__}: {e}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidRequestError(f"image has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:
        raise InvalidRequestError(f"image of {width}x{height} = {width * height} pixels is over the limit of "
                                  f"{limits.max_pixels} pixels")
    try:
        # NOTE: a full decode here, so a truncated or corrupt file fails now and never later.
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # NOTE: in place: no copy of an unrotated image
        return _convert_rgb(image)
    except InvalidRequestError:
        raise
    except Exception as e:
        raise InvalidRequestError(f"corrupt or truncated {image.format} image: {type(e).__name__}: {e}") from None


def _convert_rgb(image: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb`: images with an alpha band or a transparency key are
    composited onto white; others go through `convert("RGB")`."""
    if image.mode == "RGB" and image.info.get("transparency") is None:
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _expand_to_square(image: Image.Image, color: tuple[int, int, int]) -> Image.Image:
    """LlavaImageProcessor.pad_to_square: centered on a max-side square of `color` (offset floor)."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    result = Image.new("RGB", (side, side), color)
    result.paste(image, ((side - width) // 2, (side - height) // 2))
    return result
