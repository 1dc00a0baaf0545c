"""Pillow's 8-bit resize and the CLIP-style preprocessing steps in torch, bit for bit, on any device.

`resize_uint8(image, height, width, resample)` equals pillow's `Image.resize((width, height),
resample)` (`reducing_gap=None`, whole image as the box) of an "RGB" or "L" image exactly, for
the filters NEAREST (0), LANCZOS (1), BILINEAR (2), BICUBIC (3), BOX (4), HAMMING (5) and
pillow 13's MKS2013 (6) / MKS2021 (7); other codes raise ValueError. It ports pillow's
`src/libImaging/Resample.c` (`precompute_coeffs` and the 8-bit passes are the same from 12.x to
13.0) and the pass order of the installed pillow release:

- `precompute_coeffs`: per output pixel a window of input pixels and float64 weights, computed
  here in numpy with the same float64 operations in the same order (sequential sums, libm
  sin / cos through `math`), then `normalize_coeffs_8bpc`: fixed-point ints of PRECISION_BITS (22)
  fractional bits, rounded half away from zero.
- each pass is `ss = 1 << 21; ss += pixel * k` over the window, then `clip8`: `ss >> 22` clamped
  to [0, 255]. Here: float64 matmuls (dense, or a sparse CSR matrix) of integers below 2^53,
  which are exact in any summation order, then `floor((acc + 2^21) / 2^22)` clamped.
- two passes through a uint8 intermediate, the horizontal one first (on the rows the vertical
  one reads only) except: from 13.0 (`ImagingResampleInner`) when the height shrinks by more
  than twice what the width does; in 12.2 to 12.x (`Image.resize`, two C calls) when the image
  is over 100 times taller than wide and its height shrinks; then the vertical pass runs first,
  on every column. A pass whose size does not change is skipped; an unchanged size is a copy.
- NEAREST is not resampling in pillow but an affine transform (`ImagingScaleAffine`): source
  index `int(x0 + i * step)` with the position accumulated by repeated float64 additions.

The weights come from float64 arithmetic, so exactness assumes pillow's C code evaluates them
without fused multiply-adds: true of x86-64 builds (no FMA in the baseline ISA); an aarch64
pillow build may contract them and differ in a rare coefficient. The tests compare with the
installed pillow itself.

`run_plan(pixels, plan)` runs an `ImagePlan` (`lmserver.multimodal.processor`): pad to square,
resize, HF center crop, lookup-table rescale + normalize, returning what
`ImageProcessor.process_image(...).pixel_values` holds for the same image, bit for bit.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from lmserver.multimodal.processor import ImagePlan

__all__ = ["PRECISION_BITS", "SUPPORTED_FILTERS", "pil_resize_coefficients", "resize_uint8", "run_plan"]

PRECISION_BITS = 32 - 8 - 2
NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING, MKS2013, MKS2021 = 0, 1, 2, 3, 4, 5, 6, 7
SUPPORTED_FILTERS = (NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING, MKS2013, MKS2021)
_ONE = float(1 << PRECISION_BITS)
_MAX_CHUNK_ELEMENTS = 1 << 24  # float64 elements per matmul operand chunk (128 MiB)
_MAX_DENSE_ELEMENTS = 1 << 22  # a larger (out, in) matrix (32 MiB) goes sparse (thin strips resized to 336 x 10^5)


# -- pillow's filters, element-wise on float64 arrays, each operation as Resample.c writes it ----------


def _box(x: np.ndarray) -> np.ndarray:
    return np.where((x > -0.5) & (x <= 0.5), 1.0, 0.0)


def _bilinear(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


def _bicubic(x: np.ndarray) -> np.ndarray:
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x = x * math.pi
    return math.sin(x) / x


def _lanczos(x: np.ndarray) -> np.ndarray:
    # NOTE: libm's sin through `math` (numpy's own vectorized sin may differ in the last bit)
    return np.array([_sinc(v) * _sinc(v / 3.0) if -3.0 <= v < 3.0 else 0.0 for v in x.tolist()],
                    dtype=np.float64).reshape(x.shape)


_HAMMING_A = float(np.float32(0.54))  # C float literals 0.54f / 0.46f, promoted to double
_HAMMING_B = float(np.float32(0.46))


def _hamming_scalar(x: float) -> float:
    x = abs(x)
    if x == 0.0:
        return 1.0
    if x >= 1.0:
        return 0.0
    x = x * math.pi
    return math.sin(x) / x * (_HAMMING_A + _HAMMING_B * math.cos(x))


def _hamming(x: np.ndarray) -> np.ndarray:
    return np.array([_hamming_scalar(v) for v in x.tolist()], dtype=np.float64).reshape(x.shape)


def _mks2013(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    x25 = x - 5.0 / 2.0
    return np.select([x < 0.5, x < 1.5, x < 2.5],
                     [17.0 / 16.0 - 7.0 / 4.0 * (x * x), (1.0 - x) * (7.0 / 4.0 - x), -1.0 / 8.0 * (x25 * x25)], 0.0)


def _mks2021(x: np.ndarray) -> np.ndarray:
    # NOTE: pow(v, 2) in the C source; compilers fold it to v * v (both exact to the rounding)
    x = np.abs(x)
    x45 = x - 9.0 / 2.0
    return np.select(
        [x < 0.5, x < 1.5, x < 2.5, x < 3.5, x < 4.5],
        [577.0 / 576.0 - 239.0 / 144.0 * (x * x), 35.0 / 36.0 * (x - 1.0) * (x - 239.0 / 140.0),
         1.0 / 6.0 * (x - 2.0) * (65.0 / 24.0 - x), 1.0 / 36.0 * (x - 3.0) * (x - 15.0 / 4.0),
         -1.0 / 288.0 * (x45 * x45)], 0.0)


_FILTERS: dict[int, tuple[Callable[[np.ndarray], np.ndarray], float]] = {
    BOX: (_box, 0.5), BILINEAR: (_bilinear, 1.0), HAMMING: (_hamming, 1.0),
    BICUBIC: (_bicubic, 2.0), LANCZOS: (_lanczos, 3.0), MKS2013: (_mks2013, 2.5), MKS2021: (_mks2021, 4.5),
}


def _check_filter(resample: int) -> None:
    if resample not in SUPPORTED_FILTERS:
        raise ValueError(f"resample {resample!r} is not supported on the device (supported pillow filters: "
                         f"{', '.join(map(str, SUPPORTED_FILTERS))}); preprocess this image with pillow")


@functools.lru_cache(maxsize=256)
def pil_resize_coefficients(in_size: int, out_size: int, resample: int) -> tuple[np.ndarray, np.ndarray]:
    """pillow's `precompute_coeffs` + `normalize_coeffs_8bpc` for a whole-axis box: (xmin (out,)
    int64, k (out, ksize) int64): output pixel o is `sum_j in[xmin[o] + j] * k[o, j]` (fixed
    point, PRECISION_BITS), k is 0 past each window. Read-only arrays, cached."""
    _check_filter(resample)
    if resample == NEAREST or in_size < 1 or out_size < 1:
        raise ValueError(f"no resampling coefficients for filter {resample} from {in_size} to {out_size}")
    filter_fn, filter_support = _FILTERS[resample]
    # (double)(in1 - in0) / outSize with float in0 = 0, in1 = in_size (exact below 2^24)
    scale = float(np.float32(in_size)) / out_size
    filterscale = max(scale, 1.0)
    support = filter_support * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    inv_filterscale = 1.0 / filterscale
    center = 0.0 + (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)  # (int) truncates toward zero
    xmax = np.minimum((center + support + 0.5).astype(np.int64), in_size) - xmin
    offsets = np.arange(ksize, dtype=np.int64)
    inside = offsets[None, :] < xmax[:, None]
    positions = ((offsets[None, :] + xmin[:, None]).astype(np.float64) - center[:, None] + 0.5) * inv_filterscale
    weights = np.zeros((out_size, ksize), dtype=np.float64)
    weights[inside] = filter_fn(positions[inside])
    total = np.zeros(out_size, dtype=np.float64)
    for j in range(ksize):  # a sequential sum, as the C loop (np.sum is pairwise)
        total = total + weights[:, j]
    nonzero = total != 0.0
    weights[nonzero] /= total[nonzero, None]
    scaled = weights * _ONE
    fixed = np.where(weights < 0, np.trunc(-0.5 + scaled), np.trunc(0.5 + scaled)).astype(np.int64)
    xmin.setflags(write=False)
    fixed.setflags(write=False)
    return xmin, fixed


@functools.lru_cache(maxsize=256)
def _nearest_indices(in_size: int, out_size: int) -> np.ndarray:
    """`ImagingScaleAffine`'s source index per output pixel (-1: outside, left at 0 by pillow)."""
    step = float(np.float32(in_size)) / out_size
    position = 0.0 + step * 0.5
    index = np.empty(out_size, dtype=np.int64)
    for i in range(out_size):  # repeated additions, as the C loop
        index[i] = -1 if position < 0.0 else int(position)
        position += step
    index[(index < 0) | (index >= in_size)] = -1
    index.setflags(write=False)
    return index


@dataclass(frozen=True, eq=False)
class _Pass:
    """One axis' resampling on a device: output o reads inputs [first, first + span) with
    weights `matrix_row(o)`; `index` / `weights` (out, ksize) are the windows rebased on `first`
    (padding clamped, weight 0), `csr` the same as a sparse (out, span) float64 matrix."""

    first: int
    span: int
    index: torch.Tensor
    weights: torch.Tensor
    csr: torch.Tensor

    def dense(self) -> torch.Tensor:
        """(out, span) float64, built on the device (not cached: a few MB for large images)."""
        matrix = torch.zeros(self.index.shape[0], self.span, dtype=torch.float64, device=self.index.device)
        return matrix.scatter_add_(1, self.index, self.weights)  # add: padding entries carry weight 0


@functools.lru_cache(maxsize=64)
def _device_pass(in_size: int, out_size: int, resample: int, device: torch.device) -> _Pass:
    xmin, fixed = pil_resize_coefficients(in_size, out_size, resample)
    first = int(xmin[0])
    columns = xmin[:, None] + np.arange(fixed.shape[1])[None, :] - first
    span = int(columns[fixed != 0].max(initial=0)) + 1
    index = np.minimum(columns, span - 1)
    nonzero = fixed != 0  # always inside the window: distinct columns per row
    crow = np.concatenate([[0], np.cumsum(nonzero.sum(axis=1))])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
        csr = torch.sparse_csr_tensor(torch.from_numpy(crow), torch.from_numpy(columns[nonzero]),
                                      torch.from_numpy(fixed[nonzero].astype(np.float64)), (out_size, span),
                                      dtype=torch.float64, check_invariants=True).to(device)
    return _Pass(first, span, torch.from_numpy(index).to(device),
                 torch.from_numpy(fixed.astype(np.float64)).to(device), csr)


def _clip8(acc: torch.Tensor) -> torch.Tensor:
    """pillow's clip8 of `ss = 2^21 + acc`: `ss >> 22` clamped to [0, 255], from float64 integers
    `acc` (overwritten). `acc / 2^22 + 0.5` is exact (|acc| < 2^31), so its floor is `ss >> 22`."""
    return acc.mul_(1.0 / _ONE).add_(0.5).floor_().clamp_(0, 255).to(torch.uint8)


def _resample_axis(x: torch.Tensor, dim: int, op: _Pass, dense: bool, start: int | None = None) -> torch.Tensor:
    """One pillow pass along `dim` (1: rows, 2: columns) of a (C, H, W) uint8 tensor, reading its
    `op.span` inputs from `start` (default `op.first`). float64 matmuls of integers below 2^53,
    exact in any order, in chunks of at most _MAX_CHUNK_ELEMENTS elements. Returns uint8."""
    x = x.narrow(dim, op.first if start is None else start, op.span)
    out_size = op.index.shape[0]
    dense = dense and out_size * op.span <= _MAX_DENSE_ELEMENTS
    matrix = op.dense() if dense else op.csr
    step = max(1, _MAX_CHUNK_ELEMENTS // max(op.span, out_size) // (x.shape[0] if dim == 1 else 1))
    if dim == 2:  # (C * H, span) -> (C * H, out)
        total = x.shape[0] * x.shape[1]
        out = torch.empty(total, out_size, dtype=torch.uint8, device=x.device)
        if dense:
            flat = x.reshape(total, op.span)
            for begin in range(0, total, step):
                out[begin:begin + step] = _clip8(flat[begin:begin + step].to(torch.float64) @ matrix.T)
        else:  # CSR times contiguous (span, n) matrices (transposed as uint8: cheaper)
            flat_t = x.permute(2, 0, 1).reshape(op.span, total)
            for begin in range(0, total, step):
                chunk = flat_t[:, begin:begin + step].contiguous().to(torch.float64)
                out[begin:begin + step] = _clip8(matrix @ chunk).T
        return out.reshape(x.shape[0], x.shape[1], out_size)
    channels, width = x.shape[0], x.shape[2]  # (C, span, W) -> (C, out, W), in column chunks
    out = torch.empty(channels, out_size, width, dtype=torch.uint8, device=x.device)
    for begin in range(0, width, step):
        part = x[:, :, begin:begin + step]
        if dense:
            out[:, :, begin:begin + step] = _clip8(torch.matmul(matrix, part.to(torch.float64)))
        else:
            chunk = part.permute(1, 0, 2).reshape(op.span, -1).to(torch.float64)
            result = _clip8(matrix @ chunk).reshape(out_size, channels, part.shape[2])
            out[:, :, begin:begin + step] = result.permute(1, 0, 2)
    return out


@functools.cache
def _installed_pillow_version() -> tuple[int, int]:
    try:
        import PIL

        major, minor = PIL.__version__.split(".")[:2]
        return int(major), int(minor)
    except (ImportError, ValueError):  # no pillow here: the current rule
        return 13, 0


def _vertical_first(in_height: int, in_width: int, height: int, width: int,
                    pillow_version: tuple[int, int] | None) -> bool:
    """Whether pillow resizes the height first. 13.0 on (`ImagingResampleInner`): when the height
    shrinks by more than twice what the width does. 12.2 to 12.x (`Image.resize`, two C calls):
    an image over 100 times taller than wide whose height shrinks. Before 12.2: never."""
    version = pillow_version if pillow_version is not None else _installed_pillow_version()
    if version >= (13, 0):
        shrink = in_height - height
        return shrink > 0 and shrink > (in_width - width) * 2
    if version >= (12, 2):
        return in_height > in_width * 100 and height < in_height
    return False


def _resize_chw(x: torch.Tensor, height: int, width: int, resample: int, method: str,
                pillow_version: tuple[int, int] | None) -> torch.Tensor:
    """pillow's resize of a (C, H, W) uint8 tensor (`ImagingResampleInner`, or the nearest transform)."""
    in_height, in_width = x.shape[1], x.shape[2]
    if (in_height, in_width) == (height, width):
        return x.clone()
    if resample == NEAREST:
        source_rows = torch.tensor(_nearest_indices(in_height, height), device=x.device)
        source_cols = torch.tensor(_nearest_indices(in_width, width), device=x.device)
        out = x.index_select(1, source_rows.clamp(min=0)).index_select(2, source_cols.clamp(min=0))
        valid = (source_rows >= 0)[:, None] & (source_cols >= 0)[None, :]
        return out * valid.to(torch.uint8)  # never zero in practice: pillow leaves 0 where outside
    dense = method == "dense" or (method == "auto" and x.device.type != "cpu")
    need_horizontal, need_vertical = width != in_width, height != in_height
    rows = _device_pass(in_height, height, resample, x.device) if need_vertical else None
    cols = _device_pass(in_width, width, resample, x.device) if need_horizontal else None
    if _vertical_first(in_height, in_width, height, width, pillow_version):
        assert rows is not None  # the vertical pass first, on every column
        x = _resample_axis(x, 1, rows, dense)
        return _resample_axis(x, 2, cols, dense) if cols is not None else x
    if rows is not None:  # the horizontal pass only on the rows the vertical one reads (ybox_first / last)
        x = x.narrow(1, rows.first, rows.span)
    if cols is not None:
        x = _resample_axis(x, 2, cols, dense)
    return _resample_axis(x, 1, rows, dense, start=0) if rows is not None else x


def resize_uint8(image: torch.Tensor, height: int, width: int, resample: int = BICUBIC, *,
                 channels_last: bool | None = None, method: str = "auto",
                 pillow_version: tuple[int, int] | None = None) -> torch.Tensor:
    """pillow's `Image.resize((width, height), resample)` of a uint8 image, bit for bit, on the
    image's device. `image`: (H, W, C) or (C, H, W) uint8 (C channels resampled independently,
    as pillow does for "RGB" and "L"; pillow premultiplies "RGBA" by alpha, this does not) or
    (H, W); `channels_last` picks the layout, None infers it from which end has 3 channels
    (ValueError when both or neither do). Returns the same layout. `method`: "dense" (float64
    matmuls; the default on accelerators, for matrices up to 4 M elements, sparse above),
    "sparse" (a CSR float64 matrix times the image; the default on CPU, where it is about twice
    as fast) or "auto"; all are exact. `pillow_version`: the (major, minor) pillow
    release whose pass order to follow (the height goes first: from 13.0 when it shrinks by more
    than twice what the width does; in 12.2 to 12.x when the image is over 100 times taller than
    wide and its height shrinks; before 12.2 never); default: the installed pillow's. Raises ValueError for
    a filter not in SUPPORTED_FILTERS (the caller then resizes with pillow)."""
    if image.dtype != torch.uint8:
        raise ValueError(f"resize_uint8 takes a uint8 image, got {image.dtype}")
    if method not in ("auto", "dense", "sparse"):
        raise ValueError(f"method must be 'auto', 'dense' or 'sparse', got {method!r}")
    _check_filter(resample)
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be >= 1, got {height} x {width}")
    if image.ndim == 2:
        return _resize_chw(image[None], height, width, resample, method, pillow_version)[0]
    if image.ndim != 3:
        raise ValueError(f"expected an (H, W, C), (C, H, W) or (H, W) image, got shape {tuple(image.shape)}")
    if channels_last is None:
        if (image.shape[-1] == 3) == (image.shape[0] == 3):
            raise ValueError(f"cannot tell the channel axis of shape {tuple(image.shape)}: pass channels_last")
        channels_last = image.shape[-1] == 3
    if image.shape[1] < 1 or image.shape[0 if channels_last else 2] < 1:
        raise ValueError(f"empty image of shape {tuple(image.shape)}")
    chw = image.permute(2, 0, 1) if channels_last else image
    out = _resize_chw(chw, height, width, resample, method, pillow_version)
    return out.permute(1, 2, 0).contiguous() if channels_last else out


# -- the processor's plan ------------------------------------------------------------------------------


def _center_crop(x: torch.Tensor, crop_height: int, crop_width: int) -> torch.Tensor:
    """transformers' `center_crop` on (C, H, W): floor-division offsets; a crop larger than the
    image pads it with zeros (centered, ceil) first (`processor._center_crop`)."""
    height, width = x.shape[1], x.shape[2]
    top, left = (height - crop_height) // 2, (width - crop_width) // 2
    bottom, right = top + crop_height, left + crop_width
    if top >= 0 and bottom <= height and left >= 0 and right <= width:
        return x[:, top:bottom, left:right]
    new_height, new_width = max(crop_height, height), max(crop_width, width)
    padded = x.new_zeros(x.shape[0], new_height, new_width)
    top_pad, left_pad = math.ceil((new_height - height) / 2), math.ceil((new_width - width) / 2)
    padded[:, top_pad:top_pad + height, left_pad:left_pad + width] = x
    top, bottom, left, right = top + top_pad, bottom + top_pad, left + left_pad, right + left_pad
    return padded[:, max(0, top):min(new_height, bottom), max(0, left):min(new_width, right)]


def _expand_to_square(x: torch.Tensor, color: tuple[int, int, int]) -> torch.Tensor:
    """LlavaImageProcessor.pad_to_square on (3, H, W): centered on a square of `color` (offsets floored)."""
    height, width = x.shape[1], x.shape[2]
    if height == width:
        return x
    side = max(height, width)
    canvas = _device_color(color, x.device)[:, None, None].repeat(1, side, side)
    top, left = (side - height) // 2, (side - width) // 2
    canvas[:, top:top + height, left:left + width] = x
    return canvas


@functools.lru_cache(maxsize=16)
def _device_color(color: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """(3,) uint8 on `device`, made once: a host-to-device copy of a fresh host tensor waits for
    the device's queued work (an image in the middle of an engine step would)."""
    return torch.tensor(color, dtype=torch.uint8).to(device)


@functools.lru_cache(maxsize=16)
def _device_lut(lut_bytes: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(lut_bytes), dtype=torch.float32).reshape(3, 256).to(device)


def run_plan(pixels: np.ndarray | torch.Tensor, plan: ImagePlan, device: torch.device | str | None = None, *,
             method: str = "auto", pillow_version: tuple[int, int] | None = None) -> torch.Tensor:
    """An `ImagePlan` on decoded (H, W, 3) uint8 RGB pixels (`DecodedImage.pixels`, numpy or a
    tensor): (3, H', W') float32 pixel_values on `device` (default: the tensor's device, CPU for
    numpy), equal bit for bit to `ImageProcessor.process_image(...).pixel_values`. Raises
    ValueError for a filter the device path does not support (see `resize_uint8`)."""
    _check_filter(plan.resample)
    if isinstance(pixels, np.ndarray):
        pixels = torch.from_numpy(np.ascontiguousarray(pixels))
    if pixels.dtype != torch.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"run_plan takes (H, W, 3) uint8 RGB pixels, got {tuple(pixels.shape)} {pixels.dtype}")
    target = torch.device(device) if device is not None else pixels.device
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    x = pixels.to(target, non_blocking=True).permute(2, 0, 1)
    if plan.pad_square:
        x = _expand_to_square(x, plan.pad_color)
    if plan.resize_hw is not None:
        x = _resize_chw(x, *plan.resize_hw, plan.resample, method, pillow_version)
    if plan.crop_hw is not None:
        x = _center_crop(x, *plan.crop_hw)
    lut = _device_lut(np.ascontiguousarray(plan.lut, dtype=np.float32).tobytes(), target)
    return torch.gather(lut, 1, x.reshape(3, -1).long()).reshape(x.shape)
