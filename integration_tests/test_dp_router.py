"""`--dp-size 2`: two real SmolLM2 replicas behind the cache-aware router (CPU)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import pytest

from lmserver.testing import ServerProcess

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server() -> Any:
    srv = ServerProcess(["--dp-size", "2", "--context-length", "1024"], core=None, env=ENV)
    srv.start(timeout_s=900)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def _generate(client: httpx.Client, text: str) -> dict[str, Any]:
    r = client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()


def test_prefix_groups_stick_to_replicas_and_hit_their_cache(server: ServerProcess) -> None:
    systems = [f"You are assistant number {g}. Answer briefly and politely. " * 6 for g in range(2)]
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        first = [_generate(client, s + "Question: what is 2+2?") for s in systems]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            later = list(pool.map(lambda i: _generate(client, systems[i % 2] + f"Question {i}: name a color."), range(4)))
        workers = client.get("/workers").json()["workers"]
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in first)
    # The second request of a group reuses the system prompt on the replica that cached it.
    prompt_tokens = min(r["meta_info"]["prompt_tokens"] for r in later)
    assert all(r["meta_info"]["cached_tokens"] >= prompt_tokens // 2 for r in later), later
    assert sorted(w["served"] for w in workers) == [3, 3]
    assert all(w["healthy"] and w["in_flight"] == 0 for w in workers)


def test_same_prompt_same_greedy_text_on_either_replica(server: ServerProcess) -> None:
    replicas = [f"http://127.0.0.1:{server.port + 1 + i}" for i in range(2)]
    texts = [_generate(httpx.Client(base_url=u, timeout=300), "The capital of France is")["text"] for u in replicas]
    assert texts[0] == texts[1] and texts[0].strip()
