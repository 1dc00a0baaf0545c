"""The engine side of images and videos: checks a request's items against the model, and gives
each extend forward the vision embeddings of the image / video tokens it computes.

Embeddings come from the EncoderCache (a miss runs the model's vision encoder once per item);
chunked prefill and a radix hit that ends inside an image take a slice of the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmserver.engine.encoder_cache import EncoderCache
from lmserver.engine.model_runner import MMRows
from lmserver.io_struct import InvalidRequestError, MultimodalItem
from lmserver.scheduler import Req, ScheduleDecision


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
        self.counters = {"mm_items": 0, "mm_tokens": 0, "mm_cached_tokens": 0, "mm_encoded_items": 0,
                         "mm_encode_time_s": 0.0}

    def capture_encoder_graphs(self) -> bool:
        """Replays the model's tile encoder (tower + projector) from CUDA graphs (CUDA, a model
        with `project_tiles`); returns whether it does. Mutates the model's `tile_encoder`."""
        model: Any = self.model
        if self.device.type != "cuda" or not callable(getattr(model, "tile_shape", None)):
            return False
        from lmserver.engine.encoder_graph import EncoderGraphs

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

    def check(self, input_ids: Sequence[int], items: Sequence[MultimodalItem]) -> None:
        """Raises InvalidRequestError unless every item covers its own run of the model's image
        (video) token ids inside the prompt, items in order and apart."""
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

    def _check_rows(self, item: MultimodalItem) -> None:
        """The item's token count is what the model's encoder makes of it (a mismatch would fail
        the forward, not the request)."""
        from lmserver.multimodal import token_counts

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
        images = [(i, item) for i, item in enumerate(items) if item.kind == "image"]
        model: Any = self.model
        with torch.inference_mode():
            if images:
                pixels = [self._image_tensor(item) for _, item in images]
                encoded = model.encode_images(pixels, [tuple(item.image_size) for _, item in images])
                out.update((i, rows) for (i, _), rows in zip(images, encoded, strict=True))
            for i, item in enumerate(items):
                if item.kind == "video":
                    out[i] = model.encode_video(self._tensor(item.pixel_values))
        self.counters["mm_encoded_items"] += len(items)
        self.counters["mm_encode_time_s"] += time.perf_counter() - start
        return [out[i] for i in range(len(items))]

    def _tensor(self, pixel_values: Any) -> torch.Tensor:
        return torch.as_tensor(pixel_values).to(self.device, self.dtype, non_blocking=True)

    def _image_tensor(self, item: MultimodalItem) -> torch.Tensor:
        """The item's pixel_values on the device; a decoded image with a plan is resized,
        cropped and normalized there (bit-identical to the processor's CPU path)."""
        if item.plan is None:
            return self._tensor(item.pixel_values)
        from lmserver.multimodal.gpu_preprocess import run_plan

        pixels = torch.from_numpy(item.pixel_values)
        if self.device.type == "cuda":
            pixels = pixels.pin_memory().to(self.device, non_blocking=True)
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
