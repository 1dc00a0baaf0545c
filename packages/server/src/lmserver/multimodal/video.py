"""Video decoding for the multimodal processor: bytes -> uniformly sampled RGB frames (PyAV).

PyAV (`pip install av`, the `video` extra) is imported when a video is first decoded.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np

from lmserver.io_struct import InvalidRequestError

__all__ = ["VIDEO_CONTAINERS", "decode_frames", "sample_frame_indices"]

# FFmpeg demuxer names accepted (a container's `format.name` lists several, comma-separated):
# the common video files; FFmpeg's image, playlist and concat demuxers are refused.
VIDEO_CONTAINERS = frozenset({"mov", "mp4", "matroska", "webm", "avi", "mpegts", "mpeg", "flv", "gif", "ogg"})


def _import_av() -> Any:
    try:
        import av
    except ImportError as e:
        raise ImportError("video inputs need PyAV: pip install av (or the lmserver[video] extra)") from e
    return av


def sample_frame_indices(total_frames: int, num_frames: int) -> np.ndarray:
    """`min(num_frames, total_frames)` indices spread uniformly over [0, total_frames - 1], first
    and last included (np.linspace floored, as LLaVA-NeXT-Video's and SGLang's samplers).
    Strictly increasing."""
    assert total_frames >= 1 and num_frames >= 1
    count = min(num_frames, total_frames)
    return np.floor(np.linspace(0, total_frames - 1, count)).astype(np.int64)


def decode_frames(data: bytes, num_frames: int, *, max_pixels: int, max_decoded_frames: int) -> list[np.ndarray]:
    """The frames at `sample_frame_indices(frames in the video, num_frames)`, each (H, W, 3)
    uint8 RGB (PyAV's rgb24 conversion, as transformers' PyAV video loader). Decodes the first
    video stream; once when the container's frame count is right, otherwise once to count and
    once to pick. Raises InvalidRequestError for bytes that are not a decodable video, a video
    without frames, frames over `max_pixels` or more than `max_decoded_frames` frames."""
    if len(data) == 0:
        raise InvalidRequestError("video is empty (0 bytes)")
    av = _import_av()
    try:
        hint = _frame_count_hint(av, data, max_pixels)
        if hint > max_decoded_frames:
            raise InvalidRequestError(f"video has {hint} frames, over the limit of {max_decoded_frames}")
        if hint > 0:
            wanted = sample_frame_indices(hint, num_frames)
            total, frames = _pick(av, data, wanted, max_pixels, max_decoded_frames)
            if total == hint:
                return frames
        else:
            total = sum(1 for _ in _decode(av, data, max_pixels, max_decoded_frames))
        if total == 0:
            raise InvalidRequestError("video has no decodable frames")
        wanted = sample_frame_indices(total, num_frames)
        total_again, frames = _pick(av, data, wanted, max_pixels, max_decoded_frames)
        assert total_again == total, "video decoded to a different frame count twice"
        return frames
    except InvalidRequestError:
        raise
    except Exception as e:  # av.FFmpegError and friends: the bytes are not a video we can read
        raise InvalidRequestError(f"not a decodable video: {type(e).__name__}: {e}") from None


def _frame_count_hint(av: Any, data: bytes, max_pixels: int) -> int:
    """The container's frame count of the first video stream (0 when unknown); checks the
    stream's frame size before anything is decoded."""
    with av.open(io.BytesIO(data), mode="r") as container:
        names = set(container.format.name.split(","))
        if not names & VIDEO_CONTAINERS:
            raise InvalidRequestError(f"not a video container this server reads ({container.format.name}); "
                                      f"accepted: {', '.join(sorted(VIDEO_CONTAINERS))}")
        if not container.streams.video:
            raise InvalidRequestError("no video stream in the file")
        stream = container.streams.video[0]
        _check_size(stream.codec_context.width, stream.codec_context.height, max_pixels)
        return int(stream.frames or 0)


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise InvalidRequestError(f"video frames of {width}x{height} = {width * height} pixels are over the "
                                  f"limit of {max_pixels} pixels")


def _decode(av: Any, data: bytes, max_pixels: int, max_decoded_frames: int) -> Iterator[Any]:
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for index, frame in enumerate(container.decode(stream)):
            if index >= max_decoded_frames:
                raise InvalidRequestError(f"video has more than {max_decoded_frames} frames")
            _check_size(frame.width, frame.height, max_pixels)
            yield frame


def _pick(av: Any, data: bytes, wanted: np.ndarray, max_pixels: int, max_decoded_frames: int
          ) -> tuple[int, list[np.ndarray]]:
    """(frames decoded, the frames at `wanted` that exist)."""
    wanted_set = set(wanted.tolist())
    frames: list[np.ndarray] = []
    total = 0
    for index, frame in enumerate(_decode(av, data, max_pixels, max_decoded_frames)):
        total = index + 1
        if index in wanted_set:
            frames.append(frame.to_ndarray(format="rgb24"))
    return total, frames
