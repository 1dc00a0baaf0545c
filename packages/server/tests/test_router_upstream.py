"""ShardedClient: requests in flight per upstream httpx client stay bounded."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.edge.router.upstream import ShardedClient


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.lists(st.booleans(), max_size=60))
def test_shards_never_exceed_their_bound_and_open_only_when_full(per_shard: int, ops: list[bool]) -> None:
    pool = ShardedClient(per_shard=per_shard)
    held: list[int] = []
    peak = 0
    for acquire in ops:
        if acquire or not held:
            before = pool.num_shards
            full_before = all(load >= per_shard for load in pool._load)
            shard, client = pool.acquire()
            assert isinstance(client, httpx.AsyncClient)
            # a new shard opens exactly when every existing one is full
            assert pool.num_shards == before + (1 if full_before else 0)
            held.append(shard)
            peak = max(peak, len(held))
        else:
            pool.release(held.pop(len(held) // 2))
        assert all(0 <= load <= per_shard for load in pool._load)
        assert pool.in_flight() == len(held)
        # never more shards than the peak demand needs
        assert pool.num_shards == 0 or pool.num_shards <= -(-peak // per_shard)
    asyncio.run(pool.aclose())
    assert pool.num_shards == 0


def test_least_loaded_shard_is_reused() -> None:
    pool = ShardedClient(per_shard=2)
    a, _ = pool.acquire()
    b, _ = pool.acquire()
    c, _ = pool.acquire()  # both slots of shard a taken: a second shard
    assert (a, b, c) == (0, 0, 1)
    pool.release(a)
    d, _ = pool.acquire()  # shard 0 and 1 both have one in flight: the first of the least loaded
    assert d == 0
    assert pool.num_shards == 2
    with pytest.raises(RuntimeError):
        pool.release(1)
        pool.release(1)
    with pytest.raises(ValueError):
        ShardedClient(per_shard=0)
    asyncio.run(pool.aclose())


class _FakeUpstream:
    """What RelayResponse reads of an httpx.Response: status, headers, raw chunks, aclose."""

    status_code = 200
    headers = {"content-type": "text/event-stream"}

    def __init__(self) -> None:
        self.closed = 0

    async def aiter_raw(self):  # type: ignore[no-untyped-def]
        for i in range(3):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0)

    async def aclose(self) -> None:
        self.closed += 1


def _relay_once(send_fails: bool, spec: str, disconnect_at_once: bool) -> tuple[int, int, list[bytes]]:
    from starlette.requests import ClientDisconnect

    from lmserver.edge.router.app import RelayResponse

    upstream = _FakeUpstream()
    finished: list[int] = []
    body: list[bytes] = []

    async def receive() -> dict[str, object]:
        if disconnect_at_once:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        if send_fails:
            raise OSError("client went away")
        if message["type"] == "http.response.body":
            body.append(message.get("body", b""))  # type: ignore[arg-type]

    async def main() -> None:
        response = RelayResponse(upstream, lambda: finished.append(1))  # type: ignore[arg-type]
        scope = {"type": "http", "asgi": {"spec_version": spec}}
        with contextlib.suppress(ClientDisconnect):
            await response(scope, receive, send)

    asyncio.run(main())
    return upstream.closed, len(finished), body


def test_relay_closes_upstream_and_releases_once_whatever_the_client_does() -> None:
    # read to the end
    closed, finished, body = _relay_once(send_fails=False, spec="2.4", disconnect_at_once=False)
    assert (closed, finished) == (1, 1) and b"".join(body) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    # the client is gone before the first byte (the body iterator never starts)
    assert _relay_once(send_fails=True, spec="2.4", disconnect_at_once=False)[:2] == (1, 1)
    # older ASGI servers: a disconnect seen by the listener cancels the stream
    assert _relay_once(send_fails=False, spec="2.0", disconnect_at_once=True)[:2] == (1, 1)
