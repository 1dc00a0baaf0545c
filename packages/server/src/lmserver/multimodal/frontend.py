"""MultimodalFrontend: the HTTP process's side of images and videos.

References (paths, URLs, base64) -> bytes (`loader`) -> pixel values and token counts
(`processor`, in a thread) -> the prompt's image / video tokens expanded to one per embedding
row, with a `MultimodalItem` each (io_struct) for the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from lmserver.io_struct import InvalidRequestError, MultimodalItem
from lmserver.multimodal.loader import LoadLimits, fetch_url, is_remote, load_local

KINDS = ("image", "video")
INLINE_DECODE_CHARS = 1 << 20  # a data: URL up to this size is decoded on the event loop


@dataclass(frozen=True)
class MediaRef:
    """One image or video of a request, as the client gave it."""

    kind: str  # "image" | "video"
    source: str  # file path, http(s) or data: URL, or base64
    num_frames: int | None = None  # video only; None: the server's default


@dataclass(frozen=True)
class PreparedMedia:
    kind: str
    content_hash: int
    pixel_values: Any  # numpy float32, or the decoded uint8 image when `plan` is set
    image_size: tuple[int, int]
    num_tokens: int
    plan: Any = None  # processor.ImagePlan the engine runs on its device


def content_hash(kind: str, data: bytes, num_frames: int | None = None) -> int:
    """64-bit hash of an item's bytes (and of what changes its embeddings: kind, frame count)."""
    h = hashlib.blake2b(data, digest_size=8, person=f"{kind}:{num_frames or 0}".encode()[:16])
    return int.from_bytes(h.digest(), "little")


def _hf_config(model_path: str | Path) -> dict[str, Any]:
    file = Path(model_path) / "config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def _token_id(hf: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = hf.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class MultimodalFrontend:
    def __init__(self, processor: Any, image_token_id: int | None, video_token_id: int | None, tokenizer: Any,
                 limits: LoadLimits, max_items: int = 32, default_num_frames: int = 8,
                 max_frames: int = 64, processed_cache_items: int = 64, device_preprocess: bool = False,
                 engine_cache_rows: int = 0) -> None:
        self.processor = processor
        self.token_ids = {"image": image_token_id, "video": video_token_id}
        self.token_texts = {kind: (None if tid is None else str(tokenizer.convert_ids_to_tokens(tid)))
                            for kind, tid in self.token_ids.items()}
        self.limits = limits
        self.max_items = max_items
        self.default_num_frames = default_num_frames
        self.max_frames = max_frames
        self._client: httpx.AsyncClient | None = None
        # preprocessed items by content hash (LRU): a repeated image skips decoding and resizing
        self._processed: OrderedDict[int, PreparedMedia] = OrderedDict()
        self.processed_cache_items = processed_cache_items
        # resize / crop / normalize in the engine, on its GPU (decode only here): see gpu_preprocess
        self.device_preprocess = device_preprocess and bool(getattr(processor, "has_image_plan", False))
        # the images whose pixels went to the engine, by hash (LRU, in embedding rows, the engine's encoder
        # cache budget): a repeat goes by its hash alone (`for_engine`); 0 rows: every image with its pixels
        self.engine_cache_rows = engine_cache_rows
        self._sent: OrderedDict[int, int] = OrderedDict()
        self._sent_rows = 0

    @classmethod
    def for_model(cls, model_path: str | Path, tokenizer: Any, config: Any,
                  engine_device: str = "cpu") -> MultimodalFrontend | None:
        """The frontend of a multimodal model folder, None for a text-only model. `config` is
        the ServerConfig (its mm_* limits); with a CUDA `engine_device` images are only decoded
        here and the engine resizes and normalizes them on the GPU (bit-identical)."""
        hf = _hf_config(model_path)
        image_id = _token_id(hf, "image_token_index", "image_token_id")
        if image_id is None:
            return None
        from lmserver.multimodal.processor import ImageProcessor, ProcessorLimits

        processor = ImageProcessor.from_model_folder(
            model_path, ProcessorLimits(max_pixels=config.mm_max_image_pixels, max_frames=config.mm_max_video_frames))
        if processor is None:
            return None
        video_id = _token_id(hf, "video_token_index", "video_token_id")
        frames = getattr(processor, "default_num_frames", None) or min(8, config.mm_max_video_frames)
        return cls(processor, image_id, video_id, tokenizer,
                   LoadLimits(max_bytes=config.mm_max_fetch_bytes, timeout_s=config.mm_fetch_timeout_s),
                   max_items=config.mm_max_items, default_num_frames=frames, max_frames=config.mm_max_video_frames,
                   processed_cache_items=64 if config.mm_encoder_cache_size > 0 else 0,
                   device_preprocess=engine_device == "cuda", engine_cache_rows=config.mm_encoder_cache_size)

    def token_text(self, kind: str) -> str:
        """The placeholder text of `kind` in a prompt (e.g. "<image>"); raises for a kind the
        model does not take."""
        text = self.token_texts.get(kind)
        if text is None:
            raise InvalidRequestError(f"this model does not take {kind} inputs")
        return text

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def prepare_blocking(self, refs: Sequence[MediaRef]) -> list[PreparedMedia]:
        """`prepare` for callers outside an event loop's thread (the offline Engine): on a loop
        and HTTP client of its own, in a helper thread."""
        async def run() -> list[PreparedMedia]:
            async with httpx.AsyncClient() as client:
                return await self.prepare(refs, client)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, run()).result()

    async def prepare(self, refs: Sequence[MediaRef], client: httpx.AsyncClient | None = None) -> list[PreparedMedia]:
        """Loads and preprocesses `refs` concurrently (fetches async, decoding in threads);
        `client` fetches URLs (default: one the frontend keeps)."""
        if len(refs) > self.max_items:
            raise InvalidRequestError(f"{len(refs)} images / videos in one prompt; the limit is {self.max_items} "
                                      "(--mm-max-items)")
        for ref in refs:
            self.token_text(ref.kind)
            if ref.num_frames is not None and not 1 <= ref.num_frames <= self.max_frames:
                raise InvalidRequestError(f"num_frames must be in [1, {self.max_frames}] (--mm-max-video-frames)")
        return list(await asyncio.gather(*(self._prepare_one(ref, client) for ref in refs)))

    async def _prepare_one(self, ref: MediaRef, client: httpx.AsyncClient | None) -> PreparedMedia:
        if is_remote(ref.source):
            if client is None:
                if self._client is None:
                    self._client = httpx.AsyncClient()
                client = self._client
            data = await fetch_url(client, ref.source, self.limits)
        elif ref.source.startswith("data:") and len(ref.source) <= INLINE_DECODE_CHARS:
            # NOTE: a photo's base64 decodes in well under a millisecond, holding the GIL: a thread hop
            # costs more than it saves; files and large payloads still go to a thread
            data = load_local(ref.source, self.limits)
        else:
            data = await asyncio.to_thread(load_local, ref.source, self.limits)
        frames = None if ref.kind == "image" else ref.num_frames or self.default_num_frames
        key = content_hash(ref.kind, data, frames)
        hit = self._processed.get(key)
        if hit is not None:
            self._processed.move_to_end(key)
            return hit
        prepared = await asyncio.to_thread(self._process, ref.kind, data, key, frames)
        if self.processed_cache_items > 0:
            self._processed[key] = prepared
            while len(self._processed) > self.processed_cache_items:
                self._processed.popitem(last=False)
        return prepared

    def _process(self, kind: str, data: bytes, key: int, frames: int | None) -> PreparedMedia:
        if kind == "image":
            if self.device_preprocess:
                decoded = self.processor.decode_image(data)
                if decoded is not None:
                    return PreparedMedia("image", key, decoded.pixels, tuple(decoded.image_size),
                                         int(decoded.num_tokens), decoded.plan)
            image = self.processor.process_image(data)
            return PreparedMedia("image", key, image.pixel_values, tuple(image.image_size), int(image.num_tokens))
        assert frames is not None
        video = self.processor.process_video(data, frames)
        size = tuple(video.pixel_values.shape[-2:])
        return PreparedMedia("video", key, video.pixel_values, size, int(video.num_tokens))

    def for_engine(self, items: Sequence[MultimodalItem]) -> list[MultimodalItem]:
        """`items` as the engine gets them: an image whose pixels went to the engine before (within
        its encoder cache's budget) goes by its hash alone (pixel_values None; the engine takes its
        embeddings from its encoder cache, see engine.multimodal); the others in full, remembered as
        sent. Mutates the record of sent images."""
        out = []
        for item in items:
            rows = self._sent.get(item.content_hash)
            if item.kind == "image" and rows == item.num_tokens:
                self._sent.move_to_end(item.content_hash)
                out.append(dataclasses.replace(item, pixel_values=None))
            else:
                self.sent_in_full([item])
                out.append(item)
        return out

    def sent_in_full(self, items: Sequence[MultimodalItem]) -> None:
        """Records `items` as sent to the engine with their pixels (LRU by rows, like its encoder
        cache). Mutates the record."""
        for item in items:
            if item.kind != "image" or item.num_tokens > self.engine_cache_rows:
                continue
            old = self._sent.pop(item.content_hash, None)
            self._sent_rows -= old or 0
            self._sent[item.content_hash] = item.num_tokens
            self._sent_rows += item.num_tokens
            while self._sent_rows > self.engine_cache_rows:
                self._sent_rows -= self._sent.popitem(last=False)[1]

    def forget_sent(self) -> None:
        """Forgets which images the engine got (its encoder cache was flushed). Mutates the record."""
        self._sent.clear()
        self._sent_rows = 0

    def expand(self, input_ids: Sequence[int], media: Sequence[PreparedMedia]) -> tuple[list[int], list[MultimodalItem]]:
        """`input_ids` with the k-th image (video) token expanded to `media`'s k-th image's
        (video's) token count, and the items; raises InvalidRequestError when the prompt's
        placeholders and the media do not pair up."""
        for kind in KINDS:
            token = self.token_ids[kind]
            given = sum(m.kind == kind for m in media)
            found = 0 if token is None else sum(t == token for t in input_ids)
            if given != found:
                shown = self.token_texts.get(kind) or kind
                raise InvalidRequestError(
                    f"the prompt has {found} {kind} placeholder(s) ({shown!r}) for {given} {kind}(s) given; "
                    f"put one {shown!r} where each {kind} goes")
        queues = {kind: [m for m in media if m.kind == kind] for kind in KINDS}
        kind_of = {tid: kind for kind, tid in self.token_ids.items() if tid is not None}
        out: list[int] = []
        items: list[MultimodalItem] = []
        for token in input_ids:
            found_kind = kind_of.get(token)
            if found_kind is None:
                out.append(token)
                continue
            m = queues[found_kind].pop(0)
            items.append(MultimodalItem(kind=m.kind, content_hash=m.content_hash, offset=len(out),
                                        num_tokens=m.num_tokens, pixel_values=m.pixel_values,
                                        image_size=m.image_size, plan=m.plan))
            out.extend([token] * m.num_tokens)
        return out, items
