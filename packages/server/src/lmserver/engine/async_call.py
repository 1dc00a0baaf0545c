"""The event-loop side of one `Engine.async_generate` call.

The engine's driver thread steps the core for every live async call at once (so concurrent
calls share batches) and hands each output to the call's `deliver`, which hops onto the
call's event loop; results, the final future and the stream queue are touched only there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from lmserver.io_struct import GenerateReq, ReqOutput

END = object()  # the stream queue's end marker


class Result:
    """The accumulated output of one request (text, ids, meta_info)."""

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


class AsyncCall:
    """Requests of one async call. `deliver` / `fail` are thread-safe (the driver calls them);
    everything else runs on `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, reqs: list[GenerateReq], stream: bool) -> None:
        self.loop = loop
        self.reqs = reqs
        self.results = {r.rid: Result(r.rid) for r in reqs}
        self.future: asyncio.Future[None] = loop.create_future()
        self.queue: asyncio.Queue[object] | None = asyncio.Queue() if stream else None
        self._remaining = len(reqs)

    @property
    def rids(self) -> list[str]:
        return [r.rid for r in self.reqs]

    def deliver(self, out: ReqOutput) -> bool:
        """Passes `out` to the loop; False when the loop is closed (the caller is gone)."""
        try:
            self.loop.call_soon_threadsafe(self._on_output, out)
        except RuntimeError:
            return False
        return True

    def fail(self, exc: BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(self._on_error, exc)

    def _on_output(self, out: ReqOutput) -> None:
        result = self.results[out.rid]
        result.update(out)
        if self.queue is not None:
            self.queue.put_nowait(result.as_dict())
        if out.finished:
            self._remaining -= 1
            if self._remaining == 0:
                if not self.future.done():
                    self.future.set_result(None)
                if self.queue is not None:
                    self.queue.put_nowait(END)

    def _on_error(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)
            self.future.exception()  # NOTE: marks it retrieved; the awaiting caller re-raises it
        if self.queue is not None:
            self.queue.put_nowait(exc)
