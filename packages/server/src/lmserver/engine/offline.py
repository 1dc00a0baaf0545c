"""The offline Engine (SGLang's `sgl.Engine` shape) on top of EngineCore: no HTTP, no processes.

    engine = Engine()                      # the embedded SmolLM2-135M-Instruct
    out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    out["text"], out["meta_info"]["completion_tokens"]
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from lmserver.config import ServerConfig
from lmserver.engine.async_call import END, AsyncCall, Result
from lmserver.engine.core import EngineCore
from lmserver.io_struct import (
    GenerateReq,
    InvalidRequestError,
    MultimodalItem,
    ReqOutput,
    SamplingParams,
    expand_n,
)

if TYPE_CHECKING:
    from lmserver.multimodal.frontend import MultimodalFrontend

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
ImageData = str | list[str] | list[str | list[str] | None] | None


class Engine:
    """Offline engine. `model_path=None` means the embedded default model; `**config` are
    ServerConfig fields (e.g. `dtype="float32"`, `max_total_tokens=4096`)."""

    def __init__(self, model_path: str | None = None, **config: Any) -> None:
        self.core = EngineCore(ServerConfig(model_path=model_path, **config))
        self.tokenizer = self.core.tokenizer
        self.model_path = self.core.model_path
        self._lock = threading.Lock()  # one thread steps the core at a time
        self._ids = itertools.count()
        # rid -> receiver of its outputs; mutated only under _lock. Whoever steps the core (a
        # sync call or the async driver) dispatches every output, so no call's outputs are lost.
        self._sinks: dict[str, Callable[[ReqOutput], object]] = {}
        self._async_rids: set[str] = set()  # live requests of async calls (under _lock)
        self._cv = threading.Condition()  # guards _inbox and _closed
        self._inbox: list[tuple[str, AsyncCall]] = []  # ("add" | "abort", call) for the driver
        self._closed = False
        self._driver: threading.Thread | None = None
        self._mm: MultimodalFrontend | None = None  # images of a multimodal model (built on first use)

    # --- building requests ------------------------------------------------------------------

    def _requests(
        self,
        prompt: Prompt,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
        input_ids: InputIds,
        return_logprob: bool,
        logprob_start_len: int | None,
        top_logprobs_num: int | None,
        return_text_in_logprobs: bool,
        rid: str | list[str] | None,
        image_data: ImageData = None,
        video_data: ImageData = None,
    ) -> tuple[list[GenerateReq], bool]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("pass exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            ids_list = [list(self.tokenizer(t)["input_ids"]) for t in texts]
        else:
            assert input_ids is not None
            single = bool(input_ids) and isinstance(input_ids[0], int)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]  # type: ignore[arg-type]
        n = len(ids_list)
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        rids = rid if isinstance(rid, list) else [rid] * n
        if len(params_list) != n or len(rids) != n:
            raise InvalidRequestError("sampling_params and rid lists must have one entry per prompt")
        images = self._images_per_prompt(image_data, n, single)
        videos = self._images_per_prompt(video_data, n, single)
        reqs: list[GenerateReq] = []
        for ids, params, r, refs, video_refs in zip(ids_list, params_list, rids, images, videos, strict=True):
            sp = SamplingParams.from_dict(params)
            ids, mm_items = self._expand_media(ids, refs, video_refs)
            req = GenerateReq(
                rid=r or f"offline-{next(self._ids)}",
                input_ids=ids,
                sampling_params=sp,
                return_logprob=return_logprob,
                logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                top_logprobs_num=top_logprobs_num or 0,
                return_text_in_logprobs=return_text_in_logprobs,
                mm_items=mm_items,
            )
            reqs.extend(expand_n(req))
        return reqs, single and len(reqs) == 1

    @staticmethod
    def _images_per_prompt(image_data: ImageData, n: int, single: bool) -> list[list[str]]:
        """SGLang's layout: one prompt takes a str or a list; a batch one entry (str, list or
        None) per prompt."""
        if image_data is None:
            return [[] for _ in range(n)]
        if single:
            return [[image_data] if isinstance(image_data, str) else [str(x) for x in image_data]]
        if not isinstance(image_data, list) or len(image_data) != n:
            raise InvalidRequestError(f"image_data must have one entry per prompt ({n})")
        return [[] if x is None else [x] if isinstance(x, str) else list(x) for x in image_data]

    def _expand_media(self, ids: list[int], refs: list[str],
                      video_refs: list[str]) -> tuple[list[int], list[MultimodalItem]]:
        if not refs and not video_refs:
            return ids, []
        if self._mm is None:
            from lmserver.multimodal.frontend import MultimodalFrontend

            self._mm = MultimodalFrontend.for_model(self.model_path, self.tokenizer, self.core.resolved_config,
                                                    self.core.device.type)
            if self._mm is None:
                raise InvalidRequestError("this model is text-only: it takes no images or videos")
        from lmserver.multimodal.frontend import MediaRef

        media = [MediaRef("image", ref) for ref in refs] + [MediaRef("video", ref) for ref in video_refs]
        return self._mm.expand(ids, self._mm.prepare_blocking(media))

    # --- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: InputIds = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        image_data: ImageData = None,
        video_data: ImageData = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generates for one prompt (a dict), a list of prompts (a list of dicts, n per prompt),
        or, with `stream=True` and one prompt, an iterator of dicts with cumulative text.
        `image_data` / `video_data` (a multimodal model): per prompt an image / video (file
        path, URL, base64) or a list of them, one per placeholder of the prompt."""
        reqs, single = self._requests(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
            return_text_in_logprobs, rid, image_data, video_data,
        )
        if stream:
            if len(reqs) != 1:
                raise InvalidRequestError("stream=True takes one prompt with n == 1")
            return self._stream(reqs[0])
        results = self._run(reqs)
        dicts = [r.as_dict() for r in results]
        return dicts[0] if single else dicts

    def _step(self) -> None:
        """One core step; outputs go to their sinks (caller holds _lock)."""
        for out in self.core.step():
            sink = self._sinks.get(out.rid)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.rid]
                self._async_rids.discard(out.rid)
            if sink(out) is False:  # an async caller's loop is gone: stop its request
                self._sinks.pop(out.rid, None)
                self._async_rids.discard(out.rid)
                self.core.abort_request(out.rid)

    def _drain_aborted(self, rids: list[str]) -> None:
        """Aborts `rids` and steps until the core has no work (caller holds _lock)."""
        for rid in rids:
            self.core.abort_request(rid)
        while self.core.has_work():
            self._step()

    def _run(self, reqs: list[GenerateReq]) -> list[Result]:
        with self._lock:
            results = {r.rid: Result(r.rid) for r in reqs}
            added: list[str] = []
            try:
                for r in reqs:
                    self.core.add_request(r)
                    added.append(r.rid)
                    self._sinks[r.rid] = results[r.rid].update
                while any(not res.finished for res in results.values()):
                    self._step()  # live async requests ride along in the same batches
            except BaseException:
                for rid in added:
                    self._sinks.pop(rid, None)
                self._drain_aborted(added)
                raise
            return [results[r.rid] for r in reqs]

    def _stream(self, req: GenerateReq) -> Iterator[dict[str, Any]]:
        with self._lock:
            result = Result(req.rid)
            updates: list[ReqOutput] = []
            self.core.add_request(req)
            self._sinks[req.rid] = updates.append
            try:
                while not result.finished:
                    self._step()
                    for out in updates:
                        result.update(out)
                        yield result.as_dict()
                    updates.clear()
            finally:
                if not result.finished:
                    self._sinks.pop(req.rid, None)
                    self._drain_aborted([req.rid])

    # --- async: concurrent calls share batches -------------------------------------------------

    def _post(self, kind: str, call: AsyncCall) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine was shut down")
            self._inbox.append((kind, call))
            if self._driver is None:
                self._driver = threading.Thread(target=self._drive, name="lmserver-engine-driver", daemon=True)
                self._driver.start()
            self._cv.notify()

    def _drive(self) -> None:
        """The driver thread: admits async calls and steps the core while any is live."""
        while True:
            with self._cv:
                while not self._closed and not self._inbox and not self._async_rids:
                    self._cv.wait()
                if self._closed:
                    return
                inbox, self._inbox = self._inbox, []
            with self._lock:
                for kind, call in inbox:
                    if kind == "add":
                        self._admit(call)
                    else:
                        for rid in call.rids:
                            if self._sinks.pop(rid, None) is not None:
                                self._async_rids.discard(rid)
                                self.core.abort_request(rid)
                if self.core.has_work():
                    self._step()
                    continue
            with self._cv:  # live calls but nothing to step (cannot happen; never spin)
                if self._async_rids and not self._inbox and not self._closed:
                    self._cv.wait(0.01)

    def _admit(self, call: AsyncCall) -> None:
        """Adds the call's requests to the core, or none of them (caller holds _lock)."""
        added: list[str] = []
        try:
            for r in call.reqs:
                self.core.add_request(r)
                added.append(r.rid)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
            for rid in added:
                self.core.abort_request(rid)
            call.fail(exc)
            return
        for rid in added:
            self._sinks[rid] = call.deliver
            self._async_rids.add(rid)

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: InputIds = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        image_data: ImageData = None,
        video_data: ImageData = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """`generate` without blocking the event loop. Concurrent calls (e.g. under
        `asyncio.gather`) are scheduled together: a driver thread steps the core for all of them,
        so they share prefill and decode batches. Cancelling the call aborts its requests."""
        reqs, single = self._requests(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
            return_text_in_logprobs, rid, image_data, video_data,
        )
        if stream and len(reqs) != 1:
            raise InvalidRequestError("stream=True takes one prompt with n == 1")
        call = AsyncCall(asyncio.get_running_loop(), reqs, stream)
        self._post("add", call)
        if stream:
            return self._astream(call)
        try:
            await call.future
        except asyncio.CancelledError:
            self._post("abort", call)
            raise
        dicts = [call.results[r.rid].as_dict() for r in reqs]
        return dicts[0] if single else dicts

    async def _astream(self, call: AsyncCall) -> AsyncIterator[dict[str, Any]]:
        assert call.queue is not None
        try:
            while True:
                item = await call.queue.get()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item  # type: ignore[misc]
        finally:
            if not call.future.done():
                self._post("abort", call)

    # --- stats and lifecycle ------------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        """Throughput, cache hit rate, token counts, KV usage (see EngineCore.get_stats)."""
        return self.core.get_stats()

    def flush_cache(self) -> bool:
        return self.core.flush_cache()

    def shutdown(self) -> None:
        """Aborts anything left (pending async calls finish with reason "abort"), stops the
        driver thread and frees the model and KV cache (the engine is unusable after)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._driver is not None:
            self._driver.join()
        with self._lock:
            self._drain_aborted(list(self.core.states))
            self._sinks.clear()
            self.core.constrained.shutdown()  # the grammar compile worker processes
            self.core._inflight = None  # an overlapped decode's device tensors
            self.core.lowlat = None  # plugin workspaces and prepared weights
            del self.core.runner, self.core.model, self.core.kv_pool, self.core.req_to_token
        # NOTE: give the memory back to the device, so that a second Engine of this process sizes
        # its KV cache from free memory (mem_get_info does not count torch's cached blocks as free)
        gc.collect()
        if self.core.device.type == "cuda":
            torch.cuda.synchronize(self.core.device)
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
