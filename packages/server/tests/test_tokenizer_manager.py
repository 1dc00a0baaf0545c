"""TokenizerManager against a scripted core on the other end of its ZMQ sockets (no processes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from lmserver.config import ServerConfig
from lmserver.edge.ipc import AbortReq, BatchOut, CoreFatal, CoreReady, IpcAddrs, RpcReq, RpcResp
from lmserver.edge.tokenizer_manager import EngineDeadError, GenState, TokenizerManager
from lmserver.io_struct import GenerateReq, ReqOutput, SamplingParams


class ScriptedCore:
    def __init__(self, addrs: IpcAddrs) -> None:
        self.ctx = zmq.asyncio.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(addrs.from_core)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(addrs.to_core)

    async def send(self, msg: Any) -> None:
        await self.push.send_pyobj(msg)

    async def recv(self) -> Any:
        return await asyncio.wait_for(self.pull.recv_pyobj(), 5)

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # closes both sockets; never waits on undelivered messages


def run(test: Any) -> None:
    async def main() -> None:
        addrs = IpcAddrs.new()
        mgr = TokenizerManager(ServerConfig(), addrs)
        core = ScriptedCore(addrs)
        await core.send(CoreReady(tokenizer=None, model_path="m", vocab_size=100, context_length=64,
                                  resolved_config={}))
        await mgr.wait_ready(5)
        try:
            await asyncio.wait_for(test(mgr, core), 60)
        finally:
            core.close()
            await mgr.shutdown()

    asyncio.run(main())


def req(rid: str, n: int = 3) -> GenerateReq:
    return GenerateReq(rid, [1, 2, 3], SamplingParams(max_new_tokens=n))


def out(rid: str, token: int, text: str, finished: bool = False) -> ReqOutput:
    return ReqOutput(rid, [token], text, finished, {"type": "length"} if finished else None, prompt_tokens=3,
                     completion_tokens=1)


def test_outputs_accumulate_into_the_state() -> None:
    async def test(mgr: TokenizerManager, core: ScriptedCore) -> None:
        gen: AsyncIterator[GenState] = mgr.generate(req("a"))
        first = asyncio.ensure_future(gen.__anext__())
        assert (await core.recv()).rid == "a"
        await core.send(BatchOut([out("a", 7, "Hel")]))
        state = await first
        assert (state.text, state.output_ids, state.finished) == ("Hel", [7], False)
        await core.send(BatchOut([out("a", 8, "lo", finished=True)]))
        state = await gen.__anext__()
        assert (state.text, state.output_ids, state.finish_reason) == ("Hello", [7, 8], {"type": "length"})
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        assert mgr.num_pending == 0

    run(test)


def test_closing_a_generation_early_aborts_it_in_the_core() -> None:
    async def test(mgr: TokenizerManager, core: ScriptedCore) -> None:
        gen = mgr.generate(req("b", 50))
        first = asyncio.ensure_future(gen.__anext__())
        await core.recv()
        await core.send(BatchOut([out("b", 5, "x")]))
        await first
        await gen.aclose()  # the client went away
        assert await core.recv() == AbortReq("b")
        assert mgr.num_pending == 0

    run(test)


def test_rpc_answers_and_errors() -> None:
    async def test(mgr: TokenizerManager, core: ScriptedCore) -> None:
        call = asyncio.ensure_future(mgr.rpc("get_stats"))
        msg = await core.recv()
        assert isinstance(msg, RpcReq) and msg.method == "get_stats"
        await core.send(RpcResp(msg.id, result={"num_running_reqs": 0}))
        assert await call == {"num_running_reqs": 0}
        call = asyncio.ensure_future(mgr.rpc("check_memory_invariant"))
        msg = await core.recv()
        await core.send(RpcResp(msg.id, error="MemoryInvariantError: leak"))
        with pytest.raises(RuntimeError, match="leak"):
            await call

    run(test)


def test_core_fatal_fails_pending_requests() -> None:
    async def test(mgr: TokenizerManager, core: ScriptedCore) -> None:
        gen = mgr.generate(req("c"))
        first = asyncio.ensure_future(gen.__anext__())
        await core.recv()
        await core.send(CoreFatal("RuntimeError: boom"))
        with pytest.raises(EngineDeadError, match="boom"):
            await asyncio.wait_for(first, 5)
        with pytest.raises(EngineDeadError):
            await mgr.generate(req("d")).__anext__()

    run(test)


def test_a_broken_receive_loop_fails_loudly_instead_of_hanging() -> None:
    async def test(mgr: TokenizerManager, core: ScriptedCore) -> None:
        gen = mgr.generate(req("e"))
        first = asyncio.ensure_future(gen.__anext__())
        await core.recv()
        await core.send(BatchOut(outputs=None))  # type: ignore[arg-type]
        with pytest.raises(EngineDeadError, match="receive loop failed"):
            await asyncio.wait_for(first, 5)

    run(test)


def test_terminate_context_gives_up_on_a_term_that_would_block_and_finishes_once_it_can() -> None:
    # A PUSH socket with an unbounded linger and a message queued for a peer that is not there: plain ctx.term() blocks
    # until the message is delivered (forever, if the peer never comes). terminate_context returns after its timeout;
    # when a reader appears, the message is delivered and the term it started finishes.
    import time

    from lmserver.edge.ipc import terminate_context
    from lmserver.netutil import free_port

    port = free_port()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")  # nobody listens yet: the message waits in the socket's queue
    push.send(b"pending")
    push.close(linger=-1)
    t0 = time.monotonic()
    assert terminate_context(ctx, timeout_s=0.3) is False
    assert time.monotonic() - t0 < 2.0
    reader_ctx = zmq.Context()
    pull = reader_ctx.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{port}")
    assert pull.poll(10_000) and pull.recv() == b"pending"
    pull.close(linger=0)
    reader_ctx.term()
    ctx_done = zmq.Context()
    assert terminate_context(ctx_done, timeout_s=5.0) is True  # a context with nothing queued terminates at once
    deadline = time.monotonic() + 10
    while not ctx.closed and time.monotonic() < deadline:  # the first term returns once the queue is empty
        time.sleep(0.05)
    assert ctx.closed


def test_prompt_token_checks_match_their_per_element_definitions() -> None:
    """The C-speed checks (`is_token_id_list`, which the native API takes, and `check_input_ids`) accept and refuse exactly what a
    per-element check would (ints, not bools, in [0, vocab)), whatever the list holds, and say which rule failed."""
    import enum

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from lmserver.edge.tokenizer_manager import InvalidRequestError, is_token_id_list

    class Color(enum.IntEnum):  # an int subclass other than bool: a token id by the per-element rule
        RED = 5

    items = st.one_of(st.integers(-3, 130), st.booleans(), st.floats(allow_nan=False), st.text(max_size=2),
                      st.none(), st.just(Color.RED))

    def per_element_ids(x: list[Any]) -> bool:
        return all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    async def check(mgr: TokenizerManager, core: ScriptedCore) -> None:
        @settings(max_examples=300, deadline=None, derandomize=True)
        @given(ids=st.lists(items, min_size=1, max_size=12))
        def same(ids: list[Any]) -> None:
            assert is_token_id_list(ids) == per_element_ids(ids)
            in_vocab = per_element_ids(ids) and all(0 <= t < 100 for t in ids)
            try:
                mgr.check_input_ids(ids, SamplingParams(max_new_tokens=1), max_new_tokens_given=True)
                accepted = True
            except InvalidRequestError as exc:
                accepted = False
                # the message names what is wrong: a non-integer (bools included) first, else an id out of range
                assert ("must be integers" if not per_element_ids(ids) else "vocabulary") in str(exc), (ids, exc)
            assert accepted == in_vocab, ids

        same()
        assert not is_token_id_list((1, 2)) and is_token_id_list([])

    run(check)
