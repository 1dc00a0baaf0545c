"""lmserver.multimodal.processor / video against transformers' own image processors and models.

Oracles:
- pixel values: transformers' slow (PIL backend) image processors, which need no torchvision
  (`CLIPImageProcessorPil`, `LlavaImageProcessorPil`, `LlavaNextImageProcessorPil`,
  `SiglipImageProcessorPil`: what `AutoImageProcessor` loads without torchvision), fed the
  decoded PIL image; equality is exact. The `gpu` test (torchvision there) also compares with
  `AutoImageProcessor`'s torchvision (fast) backend within a resampling tolerance.
- token counts: LlavaNextProcessor's `_get_number_of_features` and the model's own
  `pack_image_features` / `image_size_to_num_patches` run on placeholder features.
- video sampling: an mp4 written here with PyAV whose frames have known colors.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from lmserver.multimodal.processor import ImageProcessor, ProcessorLimits, shortest_edge_size

CLIP_TOWER = {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14}
LLAVA = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "vision_config": CLIP_TOWER,
         "vision_feature_select_strategy": "default", "image_token_index": 32000}
PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
LLAVA_NEXT = dict(LLAVA, model_type="llava_next", architectures=["LlavaNextForConditionalGeneration"],
                  image_grid_pinpoints=PINPOINTS)
LLAVA_NEXT_VIDEO = dict(LLAVA_NEXT, model_type="llava_next_video", spatial_pool_stride=2,
                        spatial_pool_mode="average", architectures=["LlavaNextVideoForConditionalGeneration"])
CLIP_336 = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 336},
            "crop_size": {"height": 336, "width": 336}, "resample": 3,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_resize": True, "do_center_crop": True, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "do_convert_rgb": True}

# (name, config.json, preprocessor_config.json): the configurations compared with transformers
IMAGE_CONFIGS = [
    ("llava-1.5 CLIP", LLAVA, CLIP_336),
    ("llava pad-to-square", LLAVA, dict(CLIP_336, image_processor_type="LlavaImageProcessor", do_pad=True)),
    ("siglip 384 bilinear", dict(LLAVA, vision_config={"model_type": "siglip_vision_model", "image_size": 384,
                                                       "patch_size": 14}),
     {"image_processor_type": "SiglipImageProcessor", "size": {"height": 384, "width": 384}, "resample": 2,
      "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_normalize": True, "do_rescale": True,
      "rescale_factor": 1 / 255, "do_resize": True}),
    ("old int sizes, crop > resize", dict(LLAVA, vision_config=dict(CLIP_TOWER, image_size=240)),
     {"image_processor_type": "CLIPImageProcessor", "size": 224, "crop_size": 240, "resample": 2}),
    ("shortest+longest edge, no normalize", LLAVA,
     {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 200, "longest_edge": 260},
      "crop_size": {"height": 224, "width": 224}, "do_normalize": False, "resample": 1}),
    ("llava-next anyres", LLAVA_NEXT, dict(CLIP_336, image_processor_type="LlavaNextImageProcessor",
                                           image_grid_pinpoints=PINPOINTS)),
]
CONFIG_IDS = [name for name, _, _ in IMAGE_CONFIGS]

MODES = ["RGB", "RGBA", "L", "LA", "P", "P+transparency", "1", "CMYK", "I;16", "RGB+transparency"]


def _hf_class(processor_type: str):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    return {"CLIPImageProcessor": CLIPImageProcessorPil, "LlavaImageProcessor": LlavaImageProcessorPil,
            "LlavaNextImageProcessor": LlavaNextImageProcessorPil,
            "SiglipImageProcessor": SiglipImageProcessorPil}[processor_type]


def hf_pixel_values(preprocessor_config: dict, data: bytes) -> np.ndarray:
    """transformers' slow processor on the image pillow decodes from `data` (EXIF orientation
    applied, as transformers' `load_image`)."""
    from PIL import ImageOps

    kwargs = {k: v for k, v in preprocessor_config.items() if k != "image_processor_type"}
    processor = _hf_class(preprocessor_config["image_processor_type"])(**kwargs)
    image = Image.open(io.BytesIO(data))
    image.load()
    image = ImageOps.exif_transpose(image)
    return processor(image, return_tensors="np")["pixel_values"][0]


def encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def make_image(mode: str, height: int, width: int, seed: int) -> bytes:
    """A random image of `mode`, encoded losslessly (PNG; TIFF for CMYK)."""
    rng = np.random.default_rng(seed)
    rgba = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    # NOTE: some smooth structure too, so resampling sees edges and gradients, not only noise
    rgba[..., 0] = (np.arange(width)[None, :] * 255 // max(1, width - 1)).astype(np.uint8)
    base = Image.fromarray(rgba, "RGBA")
    if mode == "RGBA":
        return encode(base)
    if mode == "RGB+transparency":
        rgb = base.convert("RGB")
        return encode(rgb, transparency=tuple(int(v) for v in rgba[0, 0, :3]))
    if mode == "P+transparency":
        pal = base.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
        return encode(pal, transparency=int(np.asarray(pal)[0, 0]))
    if mode == "P":
        return encode(base.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=64))
    if mode == "CMYK":
        return encode(base.convert("CMYK"), "TIFF")
    if mode == "I;16":
        return encode(Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16)))
    return encode(base.convert(mode))


def processor_for(hf_config: dict, preprocessor_config: dict, **limits) -> ImageProcessor:
    processor = ImageProcessor.from_configs(hf_config, preprocessor_config, limits=ProcessorLimits(**limits))
    assert processor is not None
    return processor


# -- pixel values against transformers' slow processors ----------------------------------------------


@pytest.mark.parametrize(("name", "hf_config", "pp_config"), IMAGE_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_transformers(name, hf_config, pp_config, mode):
    data = make_image(mode, 37, 53, seed=len(mode))
    ours = processor_for(hf_config, pp_config).process_image(data)
    expected = hf_pixel_values(pp_config, data)
    assert ours.pixel_values.dtype == np.float32
    assert ours.pixel_values.shape == expected.shape
    np.testing.assert_array_equal(ours.pixel_values, expected)
    assert ours.image_size == (37, 53)


@pytest.mark.parametrize(("name", "hf_config", "pp_config"), IMAGE_CONFIGS, ids=CONFIG_IDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(height=st.integers(1, 700), width=st.integers(1, 700), seed=st.integers(0, 2**16))
def test_sizes_match_transformers(name, hf_config, pp_config, height, width, seed):
    data = make_image("RGB", height, width, seed)
    ours = processor_for(hf_config, pp_config).process_image(data)
    np.testing.assert_allclose(ours.pixel_values, hf_pixel_values(pp_config, data), rtol=0, atol=1e-6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(long_side=st.integers(337, 3000), short_side=st.integers(1, 336), tall=st.booleans())
def test_extreme_aspect_ratios_match_transformers(long_side, short_side, tall):
    """Thin strips: the shortest-edge rounding and the anyres pinpoint choice at their edges."""
    height, width = (long_side, short_side) if tall else (short_side, long_side)
    data = encode(Image.new("L", (width, height), 77).convert("RGB"))
    for _, hf_config, pp_config in (IMAGE_CONFIGS[0], IMAGE_CONFIGS[-1]):
        ours = processor_for(hf_config, pp_config).process_image(data)
        np.testing.assert_array_equal(ours.pixel_values, hf_pixel_values(pp_config, data))


def test_exif_orientation_is_applied():
    """A JPEG whose EXIF says "rotate 90": the processor sees it upright (as load_image does)."""
    image = Image.fromarray(np.tile(np.arange(40, dtype=np.uint8)[None, :, None] * 6, (20, 1, 3)))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW to view
    data = encode(image, "JPEG", exif=exif.tobytes(), quality=95)
    ours = processor_for(LLAVA, CLIP_336).process_image(data)
    assert ours.image_size == (40, 20)
    np.testing.assert_array_equal(ours.pixel_values, hf_pixel_values(CLIP_336, data))


@pytest.mark.parametrize(("height", "width", "expected"), [
    (300, 500, (336, 560)), (500, 300, (560, 336)), (7, 1000, (336, 48000)), (336, 336, (336, 336)),
    (3, 7, (336, 784)), (1001, 1000, (336, 336)),
])
def test_shortest_edge_size_matches_transformers(height, width, expected):
    from transformers.image_transforms import get_resize_output_image_size

    reference = get_resize_output_image_size(np.zeros((3, height, width)), 336, default_to_square=False,
                                             input_data_format="channels_first")
    assert shortest_edge_size(height, width, 336) == tuple(reference) == expected


# -- loading from a model folder ---------------------------------------------------------------------


def test_from_model_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAVA))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(CLIP_336))
    processor = ImageProcessor.from_model_folder(tmp_path)
    assert processor is not None and processor.spec.model_type == "llava"
    assert not processor.supports_video


def test_from_model_folder_text_model_is_none(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert ImageProcessor.from_model_folder(tmp_path) is None


def test_missing_preprocessor_config_uses_the_tower_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAVA))
    processor = ImageProcessor.from_model_folder(tmp_path)
    assert processor is not None
    data = make_image("RGB", 50, 80, 1)
    np.testing.assert_array_equal(processor.process_image(data).pixel_values, hf_pixel_values(CLIP_336, data))


@pytest.mark.parametrize(("hf_config", "pp_config", "message"), [
    ({"model_type": "qwen2_vl", "vision_config": {}}, None, "unsupported multimodal model type"),
    (dict(LLAVA, vision_config={"model_type": "pixtral"}), None, "not supported"),
    (LLAVA, {"image_processor_type": "Qwen2VLImageProcessor"}, "unsupported image_processor_type"),
    (LLAVA, dict(CLIP_336, resample=9), "resample"),
    (LLAVA, dict(CLIP_336, size={"max_height": 3}), "size"),
])
def test_unsupported_configs_raise(hf_config, pp_config, message):
    with pytest.raises(ValueError, match=message):
        ImageProcessor.from_configs(hf_config, pp_config)
