"""The offline Engine (SGLang's `sgl.Engine` shape) on top of EngineCore: no HTTP, no processes.

    engine = Engine()                      # the embedded SmolLM2-135M-Instruct
    out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    out["text"], out["meta_info"]["completion_tokens"]
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from lmserver.config import ServerConfig
from lmserver.engine.core import EngineCore
from lmserver.io_struct import GenerateReq, InvalidRequestError, ReqOutput, SamplingParams, expand_n

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None


class _Result:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.text = ""
        self.output_ids: list[int] = []
        self.meta: dict[str, Any] = {"id": rid}
        self.started = time.monotonic()
        self.finished = False

    def update(self, out: ReqOutput) -> None:
        self.text += out.new_text
        if out.rollback_tokens:
            del self.output_ids[len(self.output_ids) - out.rollback_tokens :]
        self.output_ids.extend(out.new_token_ids)
        m = self.meta
        if out.jump_forward_tokens:
            m["jump_forward_tokens"] = out.jump_forward_tokens
        m["prompt_tokens"] = out.prompt_tokens
        m["completion_tokens"] = out.completion_tokens
        m["cached_tokens"] = out.cached_tokens
        if out.input_token_logprobs is not None:
            m["input_token_logprobs"] = out.input_token_logprobs
            m["input_top_logprobs"] = out.input_top_logprobs
        if out.output_token_logprobs:
            m.setdefault("output_token_logprobs", []).extend(out.output_token_logprobs)
            m.setdefault("output_top_logprobs", []).extend(out.output_top_logprobs)
        if out.finished:
            self.finished = True
            m["finish_reason"] = out.finish_reason
            m["e2e_latency"] = time.monotonic() - self.started
            if out.error:
                m["error"] = out.error

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": dict(self.meta)}


class Engine:
    """Offline engine. `model_path=None` means the embedded default model; `**config` are
    ServerConfig fields (e.g. `dtype="float32"`, `max_total_tokens=4096`)."""

    def __init__(self, model_path: str | None = None, **config: Any) -> None:
        self.core = EngineCore(ServerConfig(model_path=model_path, **config))
        self.tokenizer = self.core.tokenizer
        self.model_path = self.core.model_path
        self._lock = threading.Lock()
        self._ids = itertools.count()

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
        reqs: list[GenerateReq] = []
        for ids, params, r in zip(ids_list, params_list, rids, strict=True):
            sp = SamplingParams.from_dict(params)
            req = GenerateReq(
                rid=r or f"offline-{next(self._ids)}",
                input_ids=ids,
                sampling_params=sp,
                return_logprob=return_logprob,
                logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                top_logprobs_num=top_logprobs_num or 0,
                return_text_in_logprobs=return_text_in_logprobs,
            )
            reqs.extend(expand_n(req))
        return reqs, single and len(reqs) == 1

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
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generates for one prompt (a dict), a list of prompts (a list of dicts, n per prompt),
        or, with `stream=True` and one prompt, an iterator of dicts with cumulative text."""
        reqs, single = self._requests(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
            return_text_in_logprobs, rid,
        )
        if stream:
            if len(reqs) != 1:
                raise InvalidRequestError("stream=True takes one prompt with n == 1")
            return self._stream(reqs[0])
        results = self._run(reqs)
        dicts = [r.as_dict() for r in results]
        return dicts[0] if single else dicts

    def _run(self, reqs: list[GenerateReq]) -> list[_Result]:
        with self._lock:
            results = {r.rid: _Result(r.rid) for r in reqs}
            added: list[str] = []
            try:
                for r in reqs:
                    self.core.add_request(r)
                    added.append(r.rid)
                while any(not res.finished for res in results.values()):
                    for out in self.core.step():
                        if out.rid in results:
                            results[out.rid].update(out)
            except BaseException:
                for rid in added:
                    self.core.abort_request(rid)
                while self.core.has_work():
                    self.core.step()
                raise
            return [results[r.rid] for r in reqs]

    def _stream(self, req: GenerateReq) -> Iterator[dict[str, Any]]:
        with self._lock:
            result = _Result(req.rid)
            self.core.add_request(req)
            try:
                while not result.finished:
                    for out in self.core.step():
                        if out.rid == req.rid:
                            result.update(out)
                            yield result.as_dict()
            finally:
                if not result.finished:
                    self.core.abort_request(req.rid)
                    while self.core.has_work():
                        self.core.step()

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """`generate` without blocking the event loop (runs in a worker thread). Calls are
        served one after another; batch prompts in one call for throughput."""
        if kwargs.get("stream"):
            sync_iter = self.generate(prompt, sampling_params, **kwargs)
            assert isinstance(sync_iter, Iterator)
            return self._aiter(sync_iter)
        return await asyncio.to_thread(self.generate, prompt, sampling_params, **kwargs)  # type: ignore[arg-type, return-value]

    async def _aiter(self, sync_iter: Iterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        sentinel = object()
        while True:
            item = await asyncio.to_thread(next, sync_iter, sentinel)
            if item is sentinel:
                return
            yield item  # type: ignore[misc]

    # --- stats and lifecycle ------------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        """Throughput, cache hit rate, token counts, KV usage (see EngineCore.get_stats)."""
        return self.core.get_stats()

    def flush_cache(self) -> bool:
        return self.core.flush_cache()

    def shutdown(self) -> None:
        """Aborts anything left and frees the model and KV cache (the engine is unusable after)."""
        with self._lock:
            for rid in list(self.core.states):
                self.core.abort_request(rid)
            while self.core.has_work():
                self.core.step()
            del self.core.runner, self.core.model, self.core.kv_pool

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
