"""Async plumbing shared by the routes: SSE framing, merging n generations, priming a stream
(so errors become an HTTP status before the first byte), and client-disconnect handling."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from fastapi import Request

from lmserver.edge.api.errors import APIError
from lmserver.edge.tokenizer_manager import GenState

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def due(state: GenState, interval: int) -> bool:
    """Whether a stream chunk is due for `state`: the first one, the last one, or every
    `interval` generated tokens (`--stream-interval`). Mutates the state's token cursor when due."""
    if state.finished or state.num_tokens_streamed < 0 or (
            state.completion_tokens - state.num_tokens_streamed >= interval):
        state.num_tokens_streamed = state.completion_tokens
        return True
    return False


def new_text(state: GenState) -> str:
    """The text not streamed yet; advances the state's character cursor."""
    text = state.text[state.num_chars_sent:]
    state.num_chars_sent = len(state.text)
    return text


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def merge(gens: list[AsyncIterator[GenState]]) -> AsyncIterator[tuple[int, GenState]]:
    """Interleaves several generations as `(index, state)` in arrival order.

    Closing this iterator (or an error in one generation) cancels the others, which aborts
    their requests in the core.
    """
    if len(gens) == 1:
        async for state in gens[0]:
            yield 0, state
        return
    q: asyncio.Queue[tuple[int, GenState] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[GenState]) -> None:
        try:
            async for state in gen:
                await q.put((i, state))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await q.put((i, exc))
            return
        await q.put(None)

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await q.get()
            if item is None:
                remaining -= 1
                continue
            i, value = item
            if isinstance(value, BaseException):
                raise value
            yield i, value
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


async def collect_all(gens: list[AsyncIterator[GenState]]) -> list[GenState]:
    """Runs generations concurrently to their ends; the first error cancels (aborts) the rest."""
    tasks = [asyncio.ensure_future(collect(g)) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


async def collect(gen: AsyncIterator[GenState]) -> GenState:
    """Runs a generation to its end and returns the final state."""
    last: GenState | None = None
    async for state in gen:
        last = state
    assert last is not None and last.finished
    return last


async def prime(it: AsyncIterator[T]) -> AsyncIterator[T]:
    """Pulls the first item now (so errors raise before the response starts) and returns an
    iterator that yields it again followed by the rest."""
    first = await it.__anext__()

    async def chain() -> AsyncIterator[T]:
        yield first
        async for item in it:
            yield item

    return chain()


async def until_disconnect(request: Request, work: Awaitable[T], poll_s: float = 0.5) -> T:
    """Awaits `work`, cancelling it (which aborts its requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "the client disconnected")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
