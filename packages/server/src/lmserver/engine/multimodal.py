"""The engine side of images and videos: checks a request's items against the model, and gives
each extend forward the vision embeddings of the image / video tokens it computes.

Embeddings come from the EncoderCache (a miss runs the model's vision encoder once per item);
chunked prefill and a radix hit that ends inside an image take a slice of the rows. The pixels of
one encode call go to the device through one reusable page-locked buffer (`HostStaging`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, MutableSequence, Sequence
from typing import Any

import numpy as np
import torch

from lmserver.io_struct import InvalidRequestError, MultimodalItem, PixelsNeededError
from lmserver.runner.encoder_cache import EncoderCache
from lmserver.runner.model_runner import MMRows
from lmserver.scheduler import Req, ScheduleDecision

_ALIGN_BYTES = 64  # every array starts at a multiple of this offset (any dtype's alignment)


class HostStaging:
    """Uploads host arrays to a device through one reusable host buffer, page-locked for CUDA:
    one memcpy per array into the buffer and one host-to-device copy per call.

    `tensor.pin_memory()` per array allocates page-locked memory each time (measured on the H200's
    host: most of a 640x480 image's 6-7 ms encode in the server, see benchmarks/RESULTS.md); this
    buffer is allocated once (and grown to a power of two when a call needs more).
    NOTE: the copy of call k reads the buffer after `upload` returns, so call k + 1 waits for it
    (an event) before writing; a CPU device copies out of the buffer too (`copy=True`).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer: torch.Tensor | None = None  # (capacity,) uint8 on the host
        self._copied: torch.cuda.Event | None = None  # the last upload's copy, recorded after it
        self.uploads = 0
        self.allocations = 0

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._buffer is None else int(self._buffer.numel())

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """The `arrays` on the device (new tensors, same shapes and dtypes, in order). Mutates
        the buffer (grows it when needed) and waits for the previous call's copy first."""
        if not arrays:
            return []
        flat = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
        offsets: list[int] = []
        total = 0
        for part in flat:
            offsets.append(total)
            total += -(-part.nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        if self._copied is not None:
            self._copied.synchronize()  # NOTE: the buffer is free again only once that copy ran
            self._copied = None
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = torch.empty(1 << max(total - 1, 1).bit_length(), dtype=torch.uint8,
                                       pin_memory=self.device.type == "cuda")
            self.allocations += 1
        host = self._buffer.numpy()
        for part, start in zip(flat, offsets, strict=True):
            host[start : start + part.nbytes] = part
        device_bytes = self._buffer[:total].to(self.device, non_blocking=True, copy=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        self.uploads += 1
        out = []
        for a, part, start in zip(arrays, flat, offsets, strict=True):
            dtype = torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype
            out.append(device_bytes[start : start + part.nbytes].view(dtype).view(a.shape))
        return out


class MultimodalInputs:
    """Owns the encoder cache and the multimodal counters of one engine."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 encoder_cache_rows: int) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.image_token_id: int | None = getattr(model, "image_token_id", None)
        self.video_token_id: int | None = getattr(model, "video_token_id", None)
        self.cache = EncoderCache(encoder_cache_rows)
        self.staging = HostStaging(device)
        # the pixels of the images of live requests, by content hash: an image sent by its hash alone
        # (see `check`) right after a request with its pixels, before those are encoded, takes them here
        self._live_pixels: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        self.counters = {"mm_items": 0, "mm_tokens": 0, "mm_cached_tokens": 0, "mm_encoded_items": 0,
                         "mm_encode_time_s": 0.0, "mm_items_by_hash": 0}

    def capture_encoder_graphs(self) -> bool:
        """Replays the model's tile encoder (tower + projector) from CUDA graphs (CUDA, a model
        with `project_tiles`); returns whether it does. Mutates the model's `tile_encoder`."""
        model: Any = self.model
        if self.device.type != "cuda" or not callable(getattr(model, "tile_shape", None)):
            return False
        from lmserver.runner.encoder_graph import EncoderGraphs

        def eager(pixels: torch.Tensor) -> torch.Tensor:
            return model.multi_modal_projector(model.vision_features(pixels))  # type: ignore[no-any-return]

        graphs = EncoderGraphs(eager, model.tile_shape(), self.dtype, self.device)
        graphs.capture()
        model.tile_encoder = graphs
        return True

    @staticmethod
    def supported(model: torch.nn.Module) -> bool:
        """Whether `model` takes images (it has a vision encoder)."""
        return callable(getattr(model, "encode_images", None))

    def check(self, input_ids: Sequence[int], items: MutableSequence[MultimodalItem]) -> None:
        """Raises InvalidRequestError unless every item covers its own run of the model's image
        (video) token ids inside the prompt, items in order and apart.

        An image sent by its hash alone (`pixel_values` None: the front end's fast path for an image
        it sent before) is replaced in `items` (mutated) by a copy carrying its embeddings from the
        encoder cache, else the pixels of a live request's copy; with neither, PixelsNeededError
        (the front end sends the request again with the pixels)."""
        for index, item in enumerate(items):
            if item.pixel_values is None and item.embeds is None:
                items[index] = self._resolve(item)
            elif isinstance(item.pixel_values, np.ndarray):
                self._live_pixels[item.content_hash] = item.pixel_values
        end = 0
        for item in sorted(items, key=lambda it: it.offset):
            token = self.image_token_id if item.kind == "image" else self.video_token_id
            if item.kind not in ("image", "video") or token is None:
                raise InvalidRequestError(f"this model does not take {item.kind} inputs")
            if item.num_tokens <= 0 or item.offset < end or item.end > len(input_ids):
                raise InvalidRequestError(f"a {item.kind} item's tokens [{item.offset}, {item.end}) do not fit "
                                          f"the prompt ({len(input_ids)} tokens) or overlap another item")
            if any(t != token for t in input_ids[item.offset : item.end]):
                raise InvalidRequestError(f"the prompt's tokens [{item.offset}, {item.end}) are not all the "
                                          f"model's {item.kind} token ({token})")
            self._check_rows(item)
            end = item.end

    def _resolve(self, item: MultimodalItem) -> MultimodalItem:
        """`item` (sent without pixels) with its embeddings or pixels; raises PixelsNeededError.
        Mutates the cache's LRU order and the counters."""
        if item.kind != "image":
            raise InvalidRequestError(f"a {item.kind} item needs its pixels")
        rows = self.cache.lookup(item.content_hash)
        if rows is not None and rows.shape[0] == item.num_tokens:
            resolved = dataclasses.replace(item, embeds=rows)
        else:
            pixels = self._live_pixels.get(item.content_hash)
            if pixels is None:
                raise PixelsNeededError("the engine holds no copy of an image sent by its hash; send its pixels")
            resolved = dataclasses.replace(item, pixel_values=pixels)
        self.counters["mm_items_by_hash"] += 1
        return resolved

    def _check_rows(self, item: MultimodalItem) -> None:
        """The item's token count is what the model's encoder makes of it (a mismatch would fail
        the forward, not the request)."""
        from lmserver.multimodal import token_counts

        if item.embeds is not None:
            return  # rows of the encoder cache, counted when they were encoded (and checked: `_resolve`)
        hf = getattr(self.model, "config", None)
        hf_config = getattr(hf, "hf_config", None)
        if not isinstance(hf_config, dict):
            return
        frames = len(item.pixel_values) if item.kind == "video" else 0
        try:
            height, width = item.image_size
            want = (token_counts.num_image_tokens(hf_config, (int(height), int(width))) if item.kind == "image"
                    else token_counts.num_video_tokens(hf_config, frames))
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"a {item.kind} item does not fit this model: {exc}") from None
        if want != item.num_tokens:
            raise InvalidRequestError(f"a {item.kind} item of size {tuple(item.image_size)} takes {want} tokens in "
                                      f"this model, the request has {item.num_tokens}")

    def rows(self, decision: ScheduleDecision, req_of: Callable[[str], Req]) -> list[MMRows]:
        """The vision rows of an extend `decision` (see ModelRunner.forward); encodes misses.
        Mutates the cache and the counters."""
        wanted: list[tuple[int, int, int, int, MultimodalItem]] = []
        for index, fwd in enumerate(decision.items):
            if not fwd.mm_spans:
                continue
            req = req_of(fwd.rid)
            for span in fwd.mm_spans:
                wanted.append((index, span.token_offset, span.item_start, span.length, req.mm_items[span.item_index]))
        if not wanted:
            return []
        embeds = self.cache.get_many([w[4] for w in wanted], self._encode)
        return [(index, offset, rows[start : start + length])
                for (index, offset, start, length, _), rows in zip(wanted, embeds, strict=True)]

    def _encode(self, items: Sequence[MultimodalItem]) -> list[torch.Tensor]:
        import time

        start = time.perf_counter()
        out: dict[int, torch.Tensor] = {}
        model: Any = self.model
        with torch.inference_mode():
            # NOTE: one upload for every item's pixels (decoded uint8 images with a plan, or float32 values)
            pixels = self.staging.upload([np.asarray(item.pixel_values) for item in items])
            images = [i for i, item in enumerate(items) if item.kind == "image"]
            if images:
                tensors = [self._image_tensor(items[i], pixels[i]) for i in images]
                encoded = model.encode_images(tensors, [tuple(items[i].image_size) for i in images])
                out.update(zip(images, encoded, strict=True))
            for i, item in enumerate(items):
                if item.kind == "video":
                    out[i] = model.encode_video(pixels[i].to(self.dtype))
        self.counters["mm_encoded_items"] += len(items)
        self.counters["mm_encode_time_s"] += time.perf_counter() - start
        return [out[i] for i in range(len(items))]

    def _image_tensor(self, item: MultimodalItem, pixels: torch.Tensor) -> torch.Tensor:
        """The item's pixel_values from its `pixels` on the device; a decoded image with a plan is
        resized, cropped and normalized there (bit-identical to the processor's CPU path)."""
        if item.plan is None:
            return pixels.to(self.dtype)
        from lmserver.multimodal.gpu_preprocess import run_plan

        return run_plan(pixels, item.plan, self.device).to(self.dtype)

    def record_finished(self, req: Req) -> None:
        """Counts a finished request's items and how many of their tokens came from the radix
        cache at its first admission; mutates the counters."""
        if not req.mm_items:
            return
        self.counters["mm_items"] += len(req.mm_items)
        self.counters["mm_tokens"] += sum(item.num_tokens for item in req.mm_items)
        self.counters["mm_cached_tokens"] += sum(
            max(0, min(item.end, req.cached_tokens) - item.offset) for item in req.mm_items)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        stats: dict[str, Any] = dict(c)
        stats["mm_radix_hit_rate"] = c["mm_cached_tokens"] / c["mm_tokens"] if c["mm_tokens"] else 0.0
        stats.update(self.cache.stats())
        return stats
