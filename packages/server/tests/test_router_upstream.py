"""ShardedClient: requests in flight per upstream httpx client stay bounded."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.router.upstream import ShardedClient


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
