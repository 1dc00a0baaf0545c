"""Client fixtures shared by the real-server test modules; each module defines its own
module-scoped `server` fixture (a started `lmserver.testing.ServerProcess`) with its options."""

from __future__ import annotations

from typing import Any

import httpx
import pytest


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
