"""Small network helpers shared by the launcher, tensor parallelism and the tests."""

from __future__ import annotations

import random
import socket

__all__ = ["CLIENT_KEEPALIVE_EXPIRY_S", "SERVER_KEEP_ALIVE_S", "free_port"]

# HTTP keep-alive: a server must keep an idle connection open longer than any client keeps it
# in its pool, else a client can send on a connection the server is closing and get a ReadError
# (uvicorn and httpx both default to 5 s, so under load this race hits at random). Our servers
# (lmserver, the router) keep idle connections for SERVER_KEEP_ALIVE_S; our clients (the
# router's connections to workers) drop theirs after CLIENT_KEEPALIVE_EXPIRY_S.
SERVER_KEEP_ALIVE_S = 75
CLIENT_KEEPALIVE_EXPIRY_S = 30.0


def free_port(span: int = 1) -> int:
    """A port `p` such that `p .. p + span - 1` were all free a moment ago on 127.0.0.1.

    NOTE: picked at random below the kernel's ephemeral range (32768+ on Linux), so an outgoing
    connection of another process cannot take it between this check and the bind that follows
    (a data-parallel server listens on `port + 1 + i` for its replicas: `span = 1 + dp_size`).
    """
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 32000 - span)
        try:
            for port in range(first, first + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no block of {span} free ports found in 20000..32000")
