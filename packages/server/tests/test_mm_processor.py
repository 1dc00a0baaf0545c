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
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from lmserver.io_struct import InvalidRequestError
from lmserver.multimodal.processor import ImageProcessor, ProcessorLimits, shortest_edge_size
from lmserver.testing.multimodal import (
    ANYRES_PINPOINTS,
    CLIP_336_PREPROCESSOR,
    CLIP_336_TOWER,
    LLAVA_CONFIG,
    LLAVA_NEXT_CONFIG,
    PROCESSOR_CONFIGS,
)

CLIP_TOWER, LLAVA, PINPOINTS, LLAVA_NEXT = CLIP_336_TOWER, LLAVA_CONFIG, ANYRES_PINPOINTS, LLAVA_NEXT_CONFIG
LLAVA_NEXT_VIDEO = dict(LLAVA_NEXT, model_type="llava_next_video", spatial_pool_stride=2,
                        spatial_pool_mode="average", architectures=["LlavaNextVideoForConditionalGeneration"])
CLIP_336 = CLIP_336_PREPROCESSOR
IMAGE_CONFIGS = PROCESSOR_CONFIGS
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


def hf_composites_alpha() -> bool:
    """transformers' convert_to_rgb composites transparency onto white (5.2x); earlier 5.x
    releases (5.17) dropped it with `convert("RGB")`."""
    from transformers.image_transforms import convert_to_rgb

    clear = Image.new("RGBA", (1, 1), (0, 0, 0, 0))
    try:
        converted = convert_to_rgb(clear, return_numpy=True)
    except TypeError:
        converted = convert_to_rgb(clear)
    return bool(np.asarray(converted).reshape(-1)[0] == 255)


@pytest.mark.parametrize(("name", "hf_config", "pp_config"), IMAGE_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_transformers(name, hf_config, pp_config, mode):
    if mode in ("RGBA", "LA", "P+transparency", "RGB+transparency") and not hf_composites_alpha():
        pytest.skip("this transformers drops transparency; we composite on white as transformers 5.24 does")
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
    try:
        expected = hf_pixel_values(pp_config, data)
    except ValueError:  # transformers rounds a side to 0 pixels (shortest + longest edge on a thin strip)
        assert "longest_edge" in pp_config["size"] and max(height, width) / min(height, width) > 2 * 260
        assert np.isfinite(ours.pixel_values).all()
        return
    np.testing.assert_allclose(ours.pixel_values, expected, rtol=0, atol=1e-6)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(long_side=st.integers(337, 2400), short_side=st.integers(1, 40), tall=st.booleans())
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
    (LLAVA_NEXT, dict(CLIP_336, crop_size={"height": 224, "width": 224}), "anyres tiles of 224 pixels"),
])
def test_unsupported_configs_raise(hf_config, pp_config, message):
    with pytest.raises(ValueError, match=message):
        ImageProcessor.from_configs(hf_config, pp_config)


# -- token counts against transformers' processor and model --------------------------------------------


def hf_processor_num_tokens(image_size: tuple[int, int], pinpoints: list, patch_size: int = 14,
                            side: int = 336) -> int:
    """LlavaNextProcessor's expansion of one `<image>` (num_additional_image_tokens=1 for the
    CLS, strategy 'default'), called on a stand-in for the processor (it needs a tokenizer)."""
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    stand_in = types.SimpleNamespace(image_processor=types.SimpleNamespace(image_grid_pinpoints=pinpoints),
                                     patch_size=patch_size, num_additional_image_tokens=1)
    stand_in._get_unpadded_features = types.MethodType(LlavaNextProcessor._get_unpadded_features, stand_in)
    return LlavaNextProcessor._get_number_of_features(stand_in, *image_size, side, side) - 1


def hf_model_num_tokens(image_size: tuple[int, int], pinpoints: list) -> tuple[int, int]:
    """(rows `LlavaNextModel.pack_image_features` returns, `image_size_to_num_patches`) for
    placeholder tower features of an image of `image_size`: the model's own count."""
    import torch
    from transformers import LlavaNextConfig
    from transformers.models.llava_next import modeling_llava_next as hf

    config = LlavaNextConfig(vision_config=CLIP_TOWER, image_grid_pinpoints=pinpoints)
    num_patches = hf.image_size_to_num_patches(list(image_size), pinpoints, 336)
    features = torch.zeros(num_patches, (336 // 14) ** 2, 1)  # CLS already dropped ('default')
    stand_in = types.SimpleNamespace(config=config)
    packed, lengths = hf.LlavaNextModel.pack_image_features(
        stand_in, [features], torch.tensor([image_size]), "default", image_newline=torch.zeros(1))
    assert int(lengths[0]) == packed[0].shape[0]
    return packed[0].shape[0], num_patches


@settings(max_examples=200, deadline=None)
@given(height=st.integers(1, 5000), width=st.integers(1, 5000))
def test_next_token_counts_match_hf_processor_and_model(height, width):
    processor = processor_for(LLAVA_NEXT, IMAGE_CONFIGS[-1][2])
    ours = processor.num_image_tokens((height, width))
    model_rows, _ = hf_model_num_tokens((height, width), PINPOINTS)
    assert ours == model_rows == hf_processor_num_tokens((height, width), PINPOINTS)


@pytest.mark.parametrize(("height", "width"), [(1, 1), (37, 53), (300, 500), (1000, 200), (17, 999), (720, 1280)])
def test_next_processed_image_layout_matches_model(height, width):
    """The first dim of pixel_values is the model's `image_size_to_num_patches` and num_tokens
    is the rows `pack_image_features` yields."""
    processor = processor_for(LLAVA_NEXT, IMAGE_CONFIGS[-1][2])
    image = processor.process_image(make_image("RGB", height, width, seed=3))
    model_rows, num_patches = hf_model_num_tokens((height, width), PINPOINTS)
    assert image.pixel_values.shape == (num_patches, 3, 336, 336)
    assert image.num_tokens == model_rows


@pytest.mark.parametrize(("strategy", "expected"), [("default", 576), ("full", 577)])
def test_llava_token_count_matches_hf_processor(strategy, expected):
    """LlavaProcessor: (336 // 14) ** 2 + 1 CLS, minus 1 with strategy 'default'."""
    processor = processor_for(dict(LLAVA, vision_feature_select_strategy=strategy), CLIP_336)
    assert processor.process_image(make_image("RGB", 20, 30, 0)).num_tokens == expected


def test_video_token_count_matches_hf_pooler():
    """LLaVA-NeXT-Video: per frame the 24 x 24 grid average-pooled by 2 (the model's pooler;
    the processor's `num_image_tokens // 4 * num_frames`)."""
    import torch
    from transformers import LlavaNextVideoConfig
    from transformers.models.llava_next_video.modeling_llava_next_video import LlavaNextVideoPooler

    config = LlavaNextVideoConfig(vision_config=CLIP_TOWER, spatial_pool_stride=2, spatial_pool_mode="average")
    pooled = LlavaNextVideoPooler(config)(torch.zeros(5, 576, config.vision_config.hidden_size))
    processor = processor_for(LLAVA_NEXT_VIDEO, IMAGE_CONFIGS[-1][2])
    assert processor.num_video_tokens(5) == pooled.shape[0] * pooled.shape[1] == 576 // 4 * 5


# -- bad inputs --------------------------------------------------------------------------------------


def png_bytes(width: int, height: int, bit_depth: int = 1, color_type: int = 0) -> bytes:
    """A valid all-zero PNG written by hand (1-bit grayscale compresses ~1000x), so a huge image
    costs the test a few kilobytes and no pillow allocation."""
    import struct
    import zlib

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    row = b"\x00" * (1 + (width * bit_depth + 7) // 8)
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture
def no_decode(monkeypatch):
    """Any full decode fails the test: size checks must come first."""
    from PIL import ImageFile

    def load(self):
        raise AssertionError("the image was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


def test_hand_made_png_is_valid():
    image = Image.open(io.BytesIO(png_bytes(30, 20)))
    image.load()
    assert image.size == (30, 20) and image.mode == "1"


def test_50_megapixel_png_is_refused_before_decoding(no_decode):
    data = png_bytes(8000, 6500)
    assert len(data) < 100_000
    with pytest.raises(InvalidRequestError, match="8000x6500 = 52000000 pixels is over the limit of 25000000"):
        processor_for(LLAVA, CLIP_336).process_image(data)


def test_decompression_bomb_is_refused(no_decode):
    """Over pillow's own bomb limit (2 x 89.5 M pixels): Image.open itself refuses it."""
    with pytest.raises(InvalidRequestError, match="too large|over the limit"):
        processor_for(LLAVA, CLIP_336, max_pixels=10**9).process_image(png_bytes(20000, 10000))


def test_pixel_limit_is_configurable():
    data = make_image("RGB", 40, 40, 0)
    with pytest.raises(InvalidRequestError, match="over the limit of 1000 pixels"):
        processor_for(LLAVA, CLIP_336, max_pixels=1000).process_image(data)


def test_truncated_png_fails_in_process_image():
    data = make_image("RGB", 200, 200, 0)
    with pytest.raises(InvalidRequestError, match="corrupt or truncated PNG image"):
        processor_for(LLAVA, CLIP_336).process_image(data[: len(data) // 2])


def test_truncated_jpeg_fails_in_process_image():
    data = encode(Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)), "JPEG")
    with pytest.raises(InvalidRequestError, match="corrupt or truncated JPEG image"):
        processor_for(LLAVA, CLIP_336).process_image(data[: len(data) // 2])


@pytest.mark.parametrize(("data", "message"), [
    (b"", "empty"),
    (b"hello, this is text and not an image\n" * 10, "not an image this server reads"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "not an image|unreadable"),
    (b"P6\n4 4\n255\n" + bytes(48), "not an image this server reads"),  # PPM: not an accepted format
])
def test_not_images_are_refused(data, message):
    with pytest.raises(InvalidRequestError, match=message):
        processor_for(LLAVA, CLIP_336).process_image(data)


def test_corrupt_png_data_is_refused():
    data = bytearray(make_image("RGB", 64, 64, 0))
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)  # breaks the zlib stream (and its CRC)
    with pytest.raises(InvalidRequestError, match="corrupt or truncated PNG"):
        processor_for(LLAVA, CLIP_336).process_image(bytes(data))


# -- video -------------------------------------------------------------------------------------------

COLORS = [(10 + 24 * i, 240 - 22 * i, (80 * i) % 256) for i in range(10)]


def make_video(colors, container: str = "mp4", codec: str = "mpeg4", width: int = 64, height: int = 48) -> bytes:
    """A short video whose i-th frame is filled with colors[i]."""
    av = pytest.importorskip("av")
    out = io.BytesIO()
    with av.open(out, "w", format=container) as file:
        stream = file.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for color in colors:
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), color, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                file.mux(packet)
        for packet in stream.encode():
            file.mux(packet)
    return out.getvalue()


def nearest_color(frame: np.ndarray) -> int:
    mean = frame.reshape(-1, 3).mean(0)
    return int(np.argmin([np.abs(mean - np.array(c)).sum() for c in COLORS]))


def decoded_frames(data: bytes) -> list[np.ndarray]:
    import av

    with av.open(io.BytesIO(data)) as file:
        return [frame.to_ndarray(format="rgb24") for frame in file.decode(video=0)]


VIDEO_PROCESSOR_CONFIG = dict(CLIP_336, video_processor_type="LlavaNextVideoVideoProcessor")


@pytest.mark.parametrize(("container", "codec"), [("mp4", "mpeg4"), ("webm", "libvpx")])
@pytest.mark.parametrize(("num_frames", "expected"), [
    (4, [0, 3, 6, 9]), (1, [0]), (2, [0, 9]), (3, [0, 4, 9]), (10, list(range(10))), (32, list(range(10))),
])
def test_video_samples_uniformly(container, codec, num_frames, expected):
    """np.linspace over the whole video, floored; fewer frames than asked: every frame once.
    (webm carries no frame count: the count-then-pick path.)"""
    data = make_video(COLORS, container, codec)
    processor = ImageProcessor.from_configs(LLAVA_NEXT_VIDEO, IMAGE_CONFIGS[-1][2], VIDEO_PROCESSOR_CONFIG)
    assert processor is not None
    video = processor.process_video(data, num_frames)
    assert video.num_frames == len(expected)
    assert video.pixel_values.shape == (len(expected), 3, 336, 336) and video.pixel_values.dtype == np.float32
    assert video.num_tokens == 144 * len(expected)
    # each frame is the CLIP slow processor's output for the frame PyAV decodes at that index
    frames = decoded_frames(data)
    assert [nearest_color(frames[i]) for i in expected] == expected
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    clip = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    reference = clip([Image.fromarray(frames[i]) for i in expected], return_tensors="np")["pixel_values"]
    np.testing.assert_array_equal(video.pixel_values, reference)


@pytest.fixture(scope="module")
def video_processor() -> ImageProcessor:
    pytest.importorskip("av")
    processor = ImageProcessor.from_configs(LLAVA_NEXT_VIDEO, IMAGE_CONFIGS[-1][2], VIDEO_PROCESSOR_CONFIG,
                                            limits=ProcessorLimits(max_frames=64))
    assert processor is not None
    return processor


@pytest.mark.parametrize(("data", "message"), [
    (b"", "empty"),
    (b"this is not a video at all\n" * 20, "not a decodable video"),
])
def test_not_videos_are_refused(video_processor, data, message):
    with pytest.raises(InvalidRequestError, match=message):
        video_processor.process_video(data, 4)


def test_image_is_not_a_video(video_processor):
    with pytest.raises(InvalidRequestError, match=r"not a video container this server reads \(png_pipe\)"):
        video_processor.process_video(make_image("RGB", 20, 20, 0), 4)


def test_truncated_video_is_refused(video_processor):
    data = make_video(COLORS)
    with pytest.raises(InvalidRequestError, match="not a decodable video|no decodable frames"):
        video_processor.process_video(data[: len(data) // 3], 4)


@pytest.mark.parametrize("num_frames", [0, -1, 65, 2.5, True])
def test_bad_num_frames(video_processor, num_frames):
    with pytest.raises(InvalidRequestError, match=r"num_frames must be an integer in \[1, 64\]"):
        video_processor.process_video(make_video(COLORS[:2]), num_frames)


def test_video_frame_pixel_limit():
    processor = ImageProcessor.from_configs(LLAVA_NEXT_VIDEO, IMAGE_CONFIGS[-1][2],
                                            limits=ProcessorLimits(max_pixels=1000))
    assert processor is not None
    with pytest.raises(InvalidRequestError, match="64x48 = 3072 pixels are over the limit of 1000"):
        processor.process_video(make_video(COLORS[:2]), 2)


def test_video_decoded_frame_limit():
    processor = ImageProcessor.from_configs(LLAVA_NEXT_VIDEO, IMAGE_CONFIGS[-1][2],
                                            limits=ProcessorLimits(max_decoded_frames=5))
    assert processor is not None
    for container, codec in (("mp4", "mpeg4"), ("webm", "libvpx")):
        with pytest.raises(InvalidRequestError, match="frames"):
            processor.process_video(make_video(COLORS, container, codec), 2)


def test_image_model_takes_no_video():
    with pytest.raises(InvalidRequestError, match="does not take video"):
        processor_for(LLAVA, CLIP_336).process_video(make_video(COLORS[:2]), 2)


def test_missing_pyav_says_what_to_install(monkeypatch):
    import builtins

    video_processor = ImageProcessor.from_configs(LLAVA_NEXT_VIDEO, IMAGE_CONFIGS[-1][2])
    assert video_processor is not None

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "av":
            raise ImportError("No module named 'av'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="pip install av"):
        video_processor.process_video(b"\x00" * 100, 2)


# -- transformers' AutoImageProcessor, slow and fast (torchvision: on the GPU machine) -------------


def smooth_image(height: int, width: int, seed: int) -> bytes:
    """Gradients and a disc: what photos look like to a resampler (noise is its worst case)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    disc = ((y - height * rng.uniform(0.2, 0.8)) ** 2 + (x - width * rng.uniform(0.2, 0.8)) ** 2
            < (min(height, width) * 0.3) ** 2)
    rgb = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), np.where(disc, 220, 40)], -1)
    return encode(Image.fromarray(rgb.astype(np.uint8)))


def auto_image_processor(folder, fast: bool):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(folder, backend="torchvision" if fast else "pil")
    except TypeError:  # transformers before the backend argument
        return AutoImageProcessor.from_pretrained(folder, use_fast=fast)


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "hf_config", "pp_config"), IMAGE_CONFIGS, ids=CONFIG_IDS)
def test_matches_auto_image_processor_slow_exactly_and_fast_closely(tmp_path, name, hf_config, pp_config):
    """The slow processor `AutoImageProcessor` loads from the folder: equal. The torchvision
    one resizes float tensors with its own antialiased kernels: close, not equal."""
    pytest.importorskip("torchvision")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pp_config))
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    ours_processor = ImageProcessor.from_model_folder(tmp_path)
    assert ours_processor is not None
    slow, fast = auto_image_processor(tmp_path, fast=False), auto_image_processor(tmp_path, fast=True)
    assert type(slow) is not type(fast), (type(slow), type(fast))
    for height, width, seed in [(37, 53, 0), (300, 500, 1), (1000, 200, 2), (720, 1280, 3), (336, 336, 4)]:
        data = smooth_image(height, width, seed)
        image = Image.open(io.BytesIO(data)).convert("RGB")
        ours = ours_processor.process_image(data).pixel_values
        expected = slow(image, return_tensors="np")["pixel_values"][0]
        np.testing.assert_array_equal(ours, expected)
        fast_values = np.asarray(fast(image, return_tensors="pt")["pixel_values"][0].float().numpy())
        assert fast_values.shape == ours.shape
        diff = np.abs(fast_values - ours)
        print(f"{name} {height}x{width}: fast vs slow mean {diff.mean():.2e} max {diff.max():.2e}")
        # NOTE: one uint8 step is 1 / 255 / std ~ 0.015 after CLIP's normalization
        assert diff.mean() < 0.02 and diff.max() < 0.6
