"""Connections from the router to its workers: httpx clients in shards of bounded concurrency.

httpcore's connection pool scans every connection it holds when a request starts and when one
ends, so a single client with n requests in flight pays O(n) per event and O(n^2) per batch of
n. Behind a router with 128 requests in flight that scan dominated (a profile showed
`AsyncHTTP11Connection.is_idle` and `_assign_requests_to_connections` at ~37% of the router's
CPU) and capped it at 20-40 requests/s with 0.5 s upstream latency, where direct clients made
70-80. Each shard here carries at most `per_shard` requests at once, so a scan stays short;
shards open as concurrency grows and stay open (their idle connections expire as usual).
"""

from __future__ import annotations

import ssl
from typing import Any

import httpx


class ShardedClient:
    """Hands out one of several `httpx.AsyncClient`s per request; not thread-safe (one event loop)."""

    def __init__(self, per_shard: int = 16, **client_kwargs: Any) -> None:
        if per_shard < 1:
            raise ValueError(f"per_shard must be >= 1, got {per_shard}")
        self.per_shard = per_shard
        # one TLS context for every shard: building one loads the CA store (milliseconds each)
        self._kwargs = {"verify": ssl.create_default_context(), **client_kwargs}
        self._shards: list[httpx.AsyncClient] = []
        self._load: list[int] = []  # requests in flight per shard

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def acquire(self) -> tuple[int, httpx.AsyncClient]:
        """The least loaded shard with room (a new one when all are full); pair with `release`."""
        best = min(range(len(self._shards)), key=self._load.__getitem__, default=-1)
        if best < 0 or self._load[best] >= self.per_shard:
            self._shards.append(httpx.AsyncClient(**self._kwargs))
            self._load.append(0)
            best = len(self._shards) - 1
        self._load[best] += 1
        return best, self._shards[best]

    def release(self, shard: int) -> None:
        if self._load[shard] <= 0:
            raise RuntimeError(f"shard {shard} released more often than acquired")
        self._load[shard] -= 1

    def in_flight(self) -> int:
        return sum(self._load)

    async def aclose(self) -> None:
        for client in self._shards:
            await client.aclose()
        self._shards.clear()
        self._load.clear()
