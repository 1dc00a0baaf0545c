"""Concurrent `Engine.async_generate` calls share batches (SGLang's Engine behaviour).

Oracle: the same prompts run one at a time through `generate` (greedy): the outputs must be
identical, and the forward count of the concurrent run must be below the sequential sum.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from lmserver import Engine
from lmserver.io_struct import InvalidRequestError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]
PARAMS = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(dtype="float32", max_total_tokens=4096, max_running_requests=16)
    yield eng
    eng.shutdown()


def _forwards(engine: Engine) -> int:
    return int(engine.get_stats()["forwards"])


def _sequential(engine: Engine) -> tuple[list[list[int]], int]:
    outs, forwards = [], 0
    for p in PROMPTS:
        engine.flush_cache()
        before = _forwards(engine)
        out = engine.generate(p, PARAMS)
        assert isinstance(out, dict)
        forwards += _forwards(engine) - before
        outs.append(out["output_ids"])
    return outs, forwards


def _idle(engine: Engine) -> None:
    assert not engine.core.has_work()
    engine.core.check_memory_invariant()


def test_gathered_calls_share_batches_and_match_sequential_outputs(engine: Engine) -> None:
    want, sequential_forwards = _sequential(engine)
    assert sequential_forwards == len(PROMPTS) * PARAMS["max_new_tokens"]  # one prefill + 11 decodes each
    engine.flush_cache()
    before = _forwards(engine)

    async def go() -> list[object]:
        return await asyncio.gather(*(engine.async_generate(p, PARAMS) for p in PROMPTS))

    outs = asyncio.run(go())
    forwards = _forwards(engine) - before
    got = [o["output_ids"] for o in outs]  # type: ignore[index]
    assert got == want
    # batched: the decodes of all calls run together (far fewer forwards than one call at a time)
    assert forwards < sequential_forwards // 2
    _idle(engine)


def test_async_streams_and_plain_calls_run_together(engine: Engine) -> None:
    want, _ = _sequential(engine)
    engine.flush_cache()

    async def stream(p: str) -> list[dict[str, object]]:
        it = await engine.async_generate(p, PARAMS, stream=True)
        return [c async for c in it]  # type: ignore[union-attr]

    async def go() -> tuple[list[dict[str, object]], object, object]:
        return await asyncio.gather(  # type: ignore[return-value]
            stream(PROMPTS[0]), engine.async_generate(PROMPTS[1], PARAMS), engine.async_generate(PROMPTS[2:], PARAMS)
        )

    chunks, one, two = asyncio.run(go())
    assert chunks[-1]["output_ids"] == want[0] and len(chunks) > 1
    assert isinstance(one, dict) and one["output_ids"] == want[1]
    assert isinstance(two, list) and [o["output_ids"] for o in two] == want[2:]
    _idle(engine)


def test_a_bad_call_fails_alone_and_a_cancelled_call_is_aborted(engine: Engine) -> None:
    async def go() -> None:
        ok = asyncio.ensure_future(engine.async_generate(PROMPTS[0], PARAMS))
        with pytest.raises(InvalidRequestError):
            await engine.async_generate(input_ids=[[engine.core.vocab_size + 5]], sampling_params=PARAMS)
        slow = asyncio.ensure_future(engine.async_generate(PROMPTS[1], {**PARAMS, "max_new_tokens": 500}))
        await asyncio.sleep(0.5)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        out = await ok
        assert isinstance(out, dict) and out["meta_info"]["completion_tokens"] == PARAMS["max_new_tokens"]

    asyncio.run(go())
    for _ in range(200):  # the driver aborts the cancelled request on its next round
        if not engine.core.has_work() and not engine.core.states:
            break
        asyncio.run(asyncio.sleep(0.05))
    _idle(engine)
