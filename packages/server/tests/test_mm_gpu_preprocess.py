"""lmserver.multimodal.gpu_preprocess: pillow's 8-bit resize and the processor's plan in torch.

Oracles:
- `resize_uint8`: the installed pillow's own `Image.resize` ("RGB" and "L" images, every filter it
  has), compared for exact equality; the pass orders of other pillow releases (before 12.2,
  12.2 to 12.x, 13.0 on) against pillow's own one-axis resizes chained in that order.
- `run_plan(decode_image(...))`: `ImageProcessor.process_image(...).pixel_values` (itself equal to
  transformers' slow processors, see test_mm_processor.py), exact (atol 0).
"""

from __future__ import annotations

import io
import pickle

import numpy as np
import PIL
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from lmserver.io_struct import InvalidRequestError
from lmserver.multimodal.gpu_preprocess import (
    SUPPORTED_FILTERS,
    pil_resize_coefficients,
    resize_uint8,
    run_plan,
)
from lmserver.multimodal.processor import ImageProcessor
from lmserver.testing.multimodal import CLIP_336_PREPROCESSOR, LLAVA_CONFIG, PROCESSOR_CONFIGS

PILLOW_VERSION = tuple(int(v) for v in PIL.__version__.split(".")[:2])
PILLOW_FILTERS = sorted(int(f) for f in Image.Resampling if int(f) in SUPPORTED_FILTERS)
METHODS = ["sparse", "dense"]

# the configurations of test_mm_processor.py that have a plan (all but LLaVA-NeXT anyres)
PLAN_CONFIGS = [c for c in PROCESSOR_CONFIGS if c[0] != "llava-next anyres"]
PLAN_IDS = [name for name, _, _ in PLAN_CONFIGS]
LLAVA_NEXT = dict(LLAVA_CONFIG, model_type="llava_next", architectures=["LlavaNextForConditionalGeneration"],
                  image_grid_pinpoints=[[336, 672], [672, 336], [672, 672]])


def pil_resize(pixels: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    return np.asarray(Image.fromarray(pixels).resize((width, height), resample))


def random_pixels(rng: np.random.Generator, height: int, width: int, channels: int, style: int) -> np.ndarray:
    """Noise (0), four gray levels with hard edges (1: the filters overshoot, clip8 clamps) or a
    smooth gradient (2)."""
    shape = (height, width, channels) if channels > 1 else (height, width)
    if style == 0:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    if style == 1:
        return (rng.integers(0, 4, shape) * 85).astype(np.uint8)
    y, x = np.mgrid[:height, :width]
    gradient = (x * 255 // max(1, width - 1) + y * 97 // max(1, height - 1)) % 256
    return np.broadcast_to(gradient.reshape(height, width, *([1] if channels > 1 else [])), shape).astype(np.uint8)


@st.composite
def resize_cases(draw):
    """(height, width, out_height, out_width): sizes 1..300, often one side kept, often far from square."""
    side = st.integers(1, 300)
    height, width = draw(side), draw(side)
    if draw(st.booleans()):  # a thin strip
        if draw(st.booleans()):
            height = draw(st.integers(1, 4))
        else:
            width = draw(st.integers(1, 4))
    keep = draw(st.sampled_from(["none", "height", "width"]))
    out_height = height if keep == "height" else draw(side)
    out_width = width if keep == "width" else draw(side)
    return height, width, out_height, out_width


# -- resize_uint8 against pillow ------------------------------------------------------------------------


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=resize_cases(), resample=st.sampled_from(PILLOW_FILTERS), method=st.sampled_from(METHODS),
       channels=st.sampled_from([3, 1]), style=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_resize_matches_pillow(case, resample, method, channels, style, seed):
    height, width, out_height, out_width = case
    pixels = random_pixels(np.random.default_rng(seed), height, width, channels, style)
    expected = pil_resize(pixels, out_height, out_width, resample)
    ours = resize_uint8(torch.from_numpy(pixels), out_height, out_width, resample,
                        channels_last=True if channels > 1 else None, method=method).numpy()
    assert ours.dtype == np.uint8 and ours.shape == expected.shape
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("resample", PILLOW_FILTERS)
@pytest.mark.parametrize(("size", "out_size"), [
    ((1, 1), (300, 200)), ((300, 1), (1, 300)), ((2, 900), (336, 1)), ((1200, 900), (7, 5)),
    ((3, 5), (336, 560)), ((480, 640), (336, 448)), ((1080, 1920), (336, 597)), ((500, 500), (500, 17)),
])
def test_resize_edge_sizes_match_pillow(resample, size, out_size):
    """Extreme up- and down-scaling, 1-pixel sides, and the LLaVA sizes of common photos."""
    pixels = random_pixels(np.random.default_rng(sum(size)), *size, 3, style=1)
    expected = pil_resize(pixels, *out_size, resample)
    for method in METHODS:
        np.testing.assert_array_equal(resize_uint8(torch.from_numpy(pixels), *out_size, resample,
                                                   channels_last=True, method=method).numpy(), expected)


# (height, width, out_height, out_width, first pass per release: (11, 0) / (12, 3) / (13, 0)); "V": vertical
PASS_ORDER_CASES = [
    (26, 13, 3, 58, "HHV"),  # 13.0: the height shrinks by more than twice what the width does
    (40, 30, 30, 25, "HHH"),  # 13.0: exactly twice: horizontal first still
    (700, 2, 384, 384, "HVV"),  # 12.2+: over 100 times taller than wide, height shrinks
    (1000, 5, 999, 1, "HVH"),  # 12.2 to 12.x only
    (300, 3, 150, 2, "HHV"),  # 100 times taller, not more
]


@pytest.mark.parametrize(("height", "width", "out_height", "out_width", "orders"), PASS_ORDER_CASES)
def test_pass_order_of_each_pillow_release(height, width, out_height, out_width, orders):
    """Which pass goes first changed in pillow 12.2 (`Image.resize`: tall images) and 13.0
    (`ImagingResampleInner`). Each order equals pillow's own one-axis resizes chained that way,
    and the installed pillow's resize equals ours with its default order."""
    resample = Image.Resampling.BICUBIC
    pixels = random_pixels(np.random.default_rng(height + width), height, width, 3, style=0)
    chained = {
        "H": pil_resize(pil_resize(pixels, height, out_width, resample), out_height, out_width, resample),
        "V": pil_resize(pil_resize(pixels, out_height, width, resample), out_height, out_width, resample),
    }
    assert not np.array_equal(chained["H"], chained["V"])  # the case tells the orders apart
    source = torch.from_numpy(pixels)
    for version, order in zip([(11, 0), (12, 3), (13, 0)], orders, strict=True):
        for method in METHODS:
            ours = resize_uint8(source, out_height, out_width, resample, method=method, pillow_version=version)
            np.testing.assert_array_equal(ours.numpy(), chained[order], err_msg=f"pillow {version} {method}")
    direct = pil_resize(pixels, out_height, out_width, resample)
    np.testing.assert_array_equal(resize_uint8(source, out_height, out_width, resample).numpy(), direct)
    installed = PILLOW_VERSION >= (13, 0) and orders[2] or PILLOW_VERSION >= (12, 2) and orders[1] or orders[0]
    np.testing.assert_array_equal(direct, chained[installed])


def test_layouts_and_errors():
    rng = np.random.default_rng(1)
    pixels = random_pixels(rng, 20, 30, 3, style=0)
    expected = pil_resize(pixels, 11, 7, 3)
    hwc = torch.from_numpy(pixels)
    np.testing.assert_array_equal(resize_uint8(hwc, 11, 7).numpy(), expected)  # BICUBIC by default
    chw = resize_uint8(hwc.permute(2, 0, 1), 11, 7, 3)
    np.testing.assert_array_equal(chw.permute(1, 2, 0).numpy(), expected)
    gray = random_pixels(rng, 20, 30, 1, style=0)
    np.testing.assert_array_equal(resize_uint8(torch.from_numpy(gray), 11, 7, 2).numpy(), pil_resize(gray, 11, 7, 2))
    with pytest.raises(ValueError, match="channels_last"):
        resize_uint8(torch.zeros(3, 8, 3, dtype=torch.uint8), 4, 4, 3)
    square = torch.from_numpy(random_pixels(rng, 3, 5, 3, style=0))  # (3, 5, 3): say which axis
    np.testing.assert_array_equal(resize_uint8(square, 2, 9, 3, channels_last=True).numpy(),
                                  pil_resize(square.numpy(), 2, 9, 3))
    with pytest.raises(ValueError, match="uint8"):
        resize_uint8(hwc.float(), 4, 4, 3)
    with pytest.raises(ValueError, match="not supported on the device"):
        resize_uint8(hwc, 4, 4, 9)
    with pytest.raises(ValueError, match=">= 1"):
        resize_uint8(hwc, 0, 4, 3)
    with pytest.raises(ValueError, match="method"):
        resize_uint8(hwc, 4, 4, 3, method="banded")


def test_coefficients_are_pillows_fixed_point():
    """Each output's integer weights sum to about 1 << 22 and are 0 past the window."""
    xmin, fixed = pil_resize_coefficients(640, 336, 3)
    assert fixed.shape == (336, 2 * int(np.ceil(2 * 640 / 336)) + 1) and xmin[0] == 0
    assert np.all(np.abs(fixed.sum(axis=1) - (1 << 22)) <= fixed.shape[1])
    assert not fixed.flags.writeable
    with pytest.raises(ValueError):
        pil_resize_coefficients(10, 5, 0)  # NEAREST has no coefficients


# -- run_plan against process_image ---------------------------------------------------------------------


def processor_for(hf_config: dict, preprocessor_config: dict) -> ImageProcessor:
    processor = ImageProcessor.from_configs(hf_config, preprocessor_config)
    assert processor is not None
    return processor


def encode(pixels: np.ndarray, fmt: str = "PNG", **kwargs) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt, **kwargs)
    return out.getvalue()


def assert_plan_matches(processor: ImageProcessor, data: bytes, device: str = "cpu",
                        methods: tuple[str, ...] = ("auto",)) -> None:
    expected = processor.process_image(data)
    decoded = processor.decode_image(data)
    assert decoded is not None
    assert decoded.image_size == expected.image_size and decoded.num_tokens == expected.num_tokens
    assert decoded.pixels.dtype == np.uint8 and decoded.pixels.shape == (*decoded.image_size, 3)
    assert decoded.pixels.flags.writeable and decoded.pixels.flags.c_contiguous
    assert decoded.plan.output_hw(*decoded.image_size) == expected.pixel_values.shape[1:]
    for method in methods:
        ours = run_plan(decoded.pixels, decoded.plan, device, method=method)
        assert ours.dtype == torch.float32 and ours.device.type == torch.device(device).type
        np.testing.assert_array_equal(ours.cpu().numpy(), expected.pixel_values)


@pytest.mark.parametrize(("name", "hf_config", "pp_config"), PLAN_CONFIGS, ids=PLAN_IDS)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(height=st.integers(1, 700), width=st.integers(1, 700), seed=st.integers(0, 2**16), style=st.integers(0, 2))
def test_plan_matches_process_image(name, hf_config, pp_config, height, width, seed, style):
    pixels = random_pixels(np.random.default_rng(seed), height, width, 3, style)
    assert_plan_matches(processor_for(hf_config, pp_config), encode(pixels), methods=("sparse", "dense"))


@pytest.mark.parametrize(("name", "hf_config", "pp_config"), PLAN_CONFIGS, ids=PLAN_IDS)
@pytest.mark.parametrize(("height", "width"), [(480, 640), (1080, 1920), (336, 336), (1, 700), (700, 2), (300, 299)])
def test_plan_matches_process_image_on_photo_sizes(name, hf_config, pp_config, height, width):
    """JPEGs (the common case: 4:3 and 16:9 photos), squares, strips."""
    pixels = random_pixels(np.random.default_rng(height * width), height, width, 3, style=2)
    assert_plan_matches(processor_for(hf_config, pp_config), encode(pixels, "JPEG", quality=90))


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "CMYK"])
def test_plan_after_mode_conversion_and_exif(mode):
    """decode_image converts like process_image (alpha on white, palettes, CMYK) and applies
    the EXIF orientation."""
    rng = np.random.default_rng(3)
    rgba = Image.fromarray(rng.integers(0, 256, (45, 61, 4), dtype=np.uint8), "RGBA")
    image = rgba if mode == "RGBA" else rgba.convert("RGB").convert(mode)
    out = io.BytesIO()
    image.save(out, "TIFF" if mode == "CMYK" else "PNG")
    processor = processor_for(*PLAN_CONFIGS[1][1:])
    assert_plan_matches(processor, out.getvalue())
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to view
    data = encode(random_pixels(rng, 40, 90, 3, style=2), "JPEG", exif=exif.tobytes())
    assert processor.decode_image(data).image_size == (90, 40)  # type: ignore[union-attr]
    assert_plan_matches(processor, data)


def test_decoded_image_pickles_and_errors_match():
    processor = processor_for(*PLAN_CONFIGS[0][1:])
    decoded = processor.decode_image(encode(random_pixels(np.random.default_rng(5), 50, 80, 3, style=0)))
    assert decoded is not None
    copy = pickle.loads(pickle.dumps(decoded))
    np.testing.assert_array_equal(run_plan(copy.pixels, copy.plan).numpy(), run_plan(decoded.pixels, decoded.plan).numpy())
    for bad in (b"", b"not an image at all" * 5):
        with pytest.raises(InvalidRequestError):
            processor.decode_image(bad)
    with pytest.raises(ValueError, match=r"\(H, W, 3\) uint8"):
        run_plan(decoded.pixels[..., :2], decoded.plan)


def test_anyres_has_no_plan():
    processor = processor_for(LLAVA_NEXT, dict(CLIP_336_PREPROCESSOR, image_processor_type="LlavaNextImageProcessor"))
    assert not processor.has_image_plan
    assert processor.decode_image(b"never decoded") is None
    assert processor_for(*PLAN_CONFIGS[0][1:]).has_image_plan


# -- CUDA ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=resize_cases(), resample=st.sampled_from(PILLOW_FILTERS), method=st.sampled_from(METHODS),
       style=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_resize_matches_pillow_on_cuda(case, resample, method, style, seed):
    height, width, out_height, out_width = case
    pixels = random_pixels(np.random.default_rng(seed), height, width, 3, style)
    ours = resize_uint8(torch.from_numpy(pixels).cuda(), out_height, out_width, resample, channels_last=True,
                        method=method)
    assert ours.is_cuda
    np.testing.assert_array_equal(ours.cpu().numpy(), pil_resize(pixels, out_height, out_width, resample))


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "hf_config", "pp_config"), PLAN_CONFIGS, ids=PLAN_IDS)
def test_plan_matches_process_image_on_cuda(name, hf_config, pp_config):
    processor = processor_for(hf_config, pp_config)
    for height, width, seed in [(480, 640, 0), (1080, 1920, 1), (37, 53, 2), (1, 700, 3), (2000, 1500, 4)]:
        pixels = random_pixels(np.random.default_rng(seed), height, width, 3, style=seed % 3)
        assert_plan_matches(processor, encode(pixels, "JPEG", quality=90), device="cuda",
                            methods=("auto", "sparse"))
