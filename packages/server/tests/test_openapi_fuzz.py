"""Schemathesis over the server's own OpenAPI description (`/openapi.json`): every operation, the
OpenAI routes' bodies generated from their pydantic models, against the real HTTP process over the fake core (the
protocol layer; engine-side fuzzing lives in integration_tests/test_server_faults.py). Oracle: no
answer is a 5xx, every error body is OpenAI's error format, and the server is healthy after."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")

from lmserver.testing import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # NOTE: a short context: a generated request without max_tokens decodes to the context's end (the fake
    # core detokenizes every token), and 2,048-token answers made the fuzz's time vary from 20 s to over 300 s
    srv = ServerProcess(["--max-request-bytes", str(1 << 20), "--context-length", "256"], core="fake")
    srv.start(timeout_s=120)
    yield srv
    srv.stop()


def test_no_operation_answers_a_5xx(server: ServerProcess) -> None:
    """Every operation of /openapi.json with 20 generated cases each (schemathesis' strategies run
    by hypothesis directly: its pytest plugin does not load under this pytest)."""
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    seen: set[str] = set()
    for operation in operations:

        @settings(max_examples=20, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def fuzz(case: Any) -> None:
            response = case.call(base_url=server.base_url, timeout=30)
            seen.add(f"{case.method} {case.path}")
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
            ctype = response.headers.get("content-type") or [""]  # schemathesis: each header a list of values
            if response.status_code >= 400 and ctype[0].startswith("application/json"):
                error = response.json().get("error")
                assert isinstance(error, dict) and isinstance(error.get("message"), str), response.text[:500]

        fuzz()
    assert len(seen) == len(operations), sorted(seen)


def test_healthy_after_the_fuzz(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    r = httpx.post(server.base_url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 2}},
                   timeout=30)
    assert r.status_code == 200, r.text
