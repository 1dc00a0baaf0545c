"""Helpers of the real-server test modules: the idle KV invariant check (the `idle_invariant` fixture of conftest.py)
and `started_side_by_side`, for the modules that compare two servers' answers."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx

K = TypeVar("K")


def idle_invariant_of(client: httpx.Client, timeout_s: float = 60.0) -> dict[str, Any]:
    """Waits until the client's server is idle, asserts the KV memory invariant, returns the scheduler stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        sched = client.get("/get_server_info").json()["scheduler"]
        if sched["num_running_reqs"] == 0 and sched["num_waiting_reqs"] == 0:
            break
        assert time.monotonic() < deadline, f"the server is not idle after {timeout_s} s: {sched}"
        time.sleep(0.05)
    r = client.get("/check_memory_invariant")
    assert r.status_code == 200 and r.json() == {"ok": True}, r.text
    return dict(sched)


@contextmanager
def started_side_by_side(procs: Mapping[K, Any], timeout_s: float = 600) -> Iterator[Mapping[K, Any]]:
    """Starts several `ServerProcess`es in turn (the modules that compare two servers' answers), yields them, then
    checks each one's idle KV invariant and stops them all (also when a start or the test failed)."""
    try:
        for srv in procs.values():
            srv.start(timeout_s=timeout_s)
        yield procs
        for srv in procs.values():
            with httpx.Client(base_url=srv.base_url, timeout=60) as client:
                idle_invariant_of(client)
    finally:
        for srv in procs.values():
            if srv.proc is not None:
                srv.stop()
