"""Client fixtures shared by the real-server test modules; each module defines its own
module-scoped `server` fixture (a started `lmserver.testing.ServerProcess`) with its options.

`idle_invariant(client)` waits until the server has no running or waiting request, then checks
the KV memory invariant (the core checks it only when idle). The modules call it in a test of its
own and again when their server stops, so that it holds after all their tests in any order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from integration_tests.servers import idle_invariant_of as _idle_invariant


@pytest.fixture(scope="module")
def http(server: Any) -> Any:
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server: Any) -> Any:
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield client
    client.close()


@pytest.fixture(scope="session")
def idle_invariant() -> Callable[..., dict[str, Any]]:
    """Waits until the client's server is idle, asserts the KV memory invariant, returns the
    scheduler stats."""
    return _idle_invariant

