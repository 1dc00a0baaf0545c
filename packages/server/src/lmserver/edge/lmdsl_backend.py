"""lmdsl programs on an `Engine` of this process: SGLang's `sgl.Runtime` backend without HTTP.

    import lmdsl as sgl
    from lmserver.edge.lmdsl_backend import Runtime

    runtime = Runtime(dtype="float32")       # an Engine on the embedded SmolLM2-135M-Instruct
    sgl.set_default_backend(runtime)
    ...                                      # run @sgl.function programs
    runtime.shutdown()

`EngineBackend` speaks lmdsl's native protocol (`lmdsl.backend.native.NativeBackend`) to an
`Engine`: a program sends the same `/generate` bodies as through `lmdsl.RuntimeEndpoint` against
`lmserver serve`, handed to the engine instead of a socket. Calls from lmdsl's threads (forks,
`run_batch`) go through `Engine.async_generate`, so they share prefill and decode batches, and
prompts sharing a prefix reuse it through the engine's radix cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from lmdsl import BackendError
from lmdsl.backend.native import Body, NativeBackend, pick_chat_template
from lmdsl.chat_template import ChatTemplate
from lmserver import Engine

__all__ = ["EngineBackend", "Runtime"]

# /generate fields that `Engine.generate` takes under the same name
_PASSED = ("return_logprob", "top_logprobs_num", "return_text_in_logprobs", "image_data", "video_data", "stream")


def _has_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class EngineBackend(NativeBackend):
    """An lmdsl backend over `engine` (shared: the engine may serve other callers too).

    chat_template: a template name or object, overriding the one picked from the model path
    (as `RuntimeEndpoint` picks it from `/get_model_info`). Bad requests raise
    `lmdsl.BackendError` with status_code 400, as the HTTP server answers them.
    """

    def __init__(self, engine: Engine, *, chat_template: str | ChatTemplate | None = None) -> None:
        self.engine = engine
        image_id = getattr(engine.core.model, "image_token_id", None)
        # NOTE: what lmserver's /get_model_info says: the scheduler computes a prefix shared by the
        # requests of one batch once, so prefix hints only cost a request. Video entries travel as
        # plain references (the engine takes no per-video frame count).
        self.model_info: dict[str, Any] = {
            "model_path": engine.model_path,
            "prefix_hints_useful": False,
            "image_token": None if image_id is None else str(engine.tokenizer.convert_ids_to_tokens(image_id)),
            "video_frames_in_requests": False,
        }
        self.model_path = engine.model_path
        self.chat_template = pick_chat_template(self.model_info, chat_template)

    def flush_cache(self) -> bool:
        """Empties the engine's radix cache (False when requests are running)."""
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return {"model_path": self.engine.model_path, "scheduler": self.engine.get_stats()}

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ---- transport
    @staticmethod
    def _engine_kwargs(body: Body) -> dict[str, Any]:
        """`Engine.generate` arguments of a /generate body, with the HTTP API's defaults: null
        sampling fields mean the default; a prefill-only request with logprobs scores its whole
        prompt."""
        params = {k: v for k, v in (body.get("sampling_params") or {}).items() if v is not None}
        kwargs: dict[str, Any] = {"prompt": body["text"], "sampling_params": params}
        kwargs.update((k, body[k]) for k in _PASSED if body.get(k) is not None)
        start = body.get("logprob_start_len")
        if body.get("return_logprob") and start in (None, -1) and params.get("max_new_tokens") == 0:
            start = 0
        if start is not None:
            kwargs["logprob_start_len"] = start
        return kwargs

    @staticmethod
    def _checked(reply: dict[str, Any]) -> dict[str, Any]:
        """`reply`, or the BackendError of a request the engine failed (e.g. a bad grammar)."""
        error = reply["meta_info"].get("error")
        if error:
            raise BackendError(f"the engine failed the request: {error}", 400)
        return reply

    def native_generate(self, body: Body) -> Any:
        kwargs = self._engine_kwargs(body)
        try:
            if _has_running_loop():  # NOTE: a caller's event loop cannot be blocked on: step it here
                reply = self.engine.generate(**kwargs)
            else:  # async: calls from lmdsl's other threads join the same batches
                reply = asyncio.run(self.engine.async_generate(**kwargs))  # type: ignore[arg-type,assignment]
        except ValueError as exc:  # lmserver's InvalidRequestError: the HTTP server's 400
            raise BackendError(f"the engine refused the request: {exc}", 400) from exc
        if isinstance(reply, list):
            return [self._checked(r) for r in reply]
        return self._checked(reply)  # type: ignore[arg-type]

    def native_stream(self, body: Body) -> Iterator[dict[str, Any]]:
        kwargs = self._engine_kwargs(body)
        try:
            if _has_running_loop():
                for event in self.engine.generate(**kwargs):  # type: ignore[union-attr]
                    yield self._checked(event)  # type: ignore[arg-type]
                return
            loop = asyncio.new_event_loop()
            try:
                events = loop.run_until_complete(self.engine.async_generate(**kwargs))  # type: ignore[arg-type]
                try:
                    while True:
                        try:
                            event = loop.run_until_complete(events.__anext__())  # type: ignore[union-attr]
                        except StopAsyncIteration:
                            return
                        yield self._checked(event)
                finally:  # a consumer that stops early aborts the request
                    loop.run_until_complete(events.aclose())  # type: ignore[union-attr]
            finally:
                loop.close()
        except ValueError as exc:
            raise BackendError(f"the engine refused the request: {exc}", 400) from exc


class Runtime(EngineBackend):
    """SGLang's `sgl.Runtime`, in this process: builds and owns an `Engine(model_path, **config)`
    (`config`: ServerConfig fields, e.g. `dtype="float32"`); `shutdown()` frees it."""

    def __init__(self, model_path: str | None = None, *, chat_template: str | ChatTemplate | None = None,
                 **config: Any) -> None:
        super().__init__(Engine(model_path, **config), chat_template=chat_template)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
