"""The router's HTTP proxy against real fake-worker HTTP servers (uvicorn in threads)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from lmserver.edge.router.app import RouterConfig, build_app, routing_text
from lmserver.netutil import free_port


def _fake_worker(name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {}

    @app.post("/generate")
    def generate(body: dict) -> object:
        if body.get("stream"):

            def events() -> Iterator[bytes]:
                for i in range(3):
                    yield f'data: {{"text": "{name}-{i}"}}\n\n'.encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return {"text": name, "meta_info": {"prompt": body.get("text")}}

    return app


class _Server:
    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                httpx.get(self.url + "/health", timeout=0.5)
                return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("fake worker did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


@pytest.fixture()
def workers() -> Iterator[list[_Server]]:
    servers = [_Server(_fake_worker(f"w{i}")) for i in range(2)]
    yield servers
    for s in servers:
        s.stop()


def test_shared_prefix_requests_stick_to_one_worker(workers: list[_Server]) -> None:
    app = build_app(RouterConfig(workers=tuple(w.url for w in workers), policy="cache_aware"))
    with TestClient(app) as client:
        answers = {g: set() for g in range(2)}
        for i in range(10):
            g = i % 2
            prefix = f"group {g} long system prompt " * 10
            r = client.post("/generate", json={"text": prefix + f"q{i}"})
            assert r.status_code == 200
            answers[g].add(r.json()["text"])
        assert all(len(a) == 1 for a in answers.values())
        assert answers[0] != answers[1]
        info = client.get("/workers").json()
        assert sum(w["served"] for w in info["workers"]) == 10
        assert all(w["in_flight"] == 0 for w in info["workers"])


def test_streaming_is_relayed_unchanged(workers: list[_Server]) -> None:
    app = build_app(RouterConfig(workers=(workers[0].url,)))
    with (
        TestClient(app) as client,
        client.stream("POST", "/generate", json={"text": "x", "stream": True}) as r,
    ):
        body = b"".join(r.iter_raw()).decode()
    assert body.count("data: ") == 4 and body.endswith("data: [DONE]\n\n") and "w0-2" in body


def test_dead_worker_is_retried_elsewhere_and_dropped(workers: list[_Server]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    config = RouterConfig(
        workers=(dead, workers[1].url),
        policy="round_robin",
        health_failure_threshold=1,
        health_check_interval_s=60,
    )
    with TestClient(build_app(config)) as client:
        for _ in range(4):
            r = client.post("/generate", json={"text": "hello"})
            assert r.status_code == 200 and r.json()["text"] == "w1"
        states = {w["url"]: w for w in client.get("/workers").json()["workers"]}
        assert states[dead]["healthy"] is False


def test_no_healthy_worker_gives_503() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with TestClient(
        build_app(RouterConfig(workers=(dead,), max_retries=0, health_check_interval_s=60))
    ) as client:
        r = client.post("/generate", json={"text": "x"})
    assert r.status_code == 503 and "no healthy worker" in r.json()["error"]["message"]


def test_routing_text_of_each_api() -> None:
    assert routing_text("/generate", {"text": ["a", "b"]}) == "a"
    assert routing_text("/generate", {"input_ids": [[1, 2], [3]]}) == "1 2"
    assert routing_text("/v1/completions", {"prompt": "p"}) == "p"
    chat = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "U"}]},
        ]
    }
    assert routing_text("/v1/chat/completions", chat) == "system:S\nuser:U\n"


def test_more_than_a_hundred_requests_are_in_flight_to_workers_at_once() -> None:
    """The worker answers only once 120 requests wait in it at the same time: a router whose
    connection pool held fewer (httpx's default is 100) would make every request time out."""
    import asyncio
    import concurrent.futures

    need = 120
    app = FastAPI()
    waiting = {"n": 0}
    all_in: asyncio.Event | None = None

    @app.get("/health")
    def health() -> dict:
        return {}

    @app.post("/generate")
    async def generate(body: dict) -> dict:
        nonlocal all_in
        if all_in is None:
            all_in = asyncio.Event()
        waiting["n"] += 1
        if waiting["n"] >= need:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), timeout=20)
        return {"text": "ok", "meta_info": {}}

    worker = _Server(app)
    router = _Server(build_app(RouterConfig(workers=(worker.url,), policy="round_robin", request_timeout_s=30)))
    try:
        def send(i: int) -> int:
            with httpx.Client(timeout=40) as c:
                return c.post(router.url + "/generate", json={"text": f"q{i}"}).status_code

        with concurrent.futures.ThreadPoolExecutor(need) as pool:
            codes = list(pool.map(send, range(need)))
        assert codes == [200] * need and waiting["n"] == need
    finally:
        router.stop()
        worker.stop()


def test_a_body_over_the_limit_is_a_413_before_any_worker_sees_it(workers: list[_Server]) -> None:
    config = RouterConfig(workers=tuple(w.url for w in workers), health_check_interval_s=60, max_request_bytes=1000)
    with TestClient(build_app(config)) as client:
        big = client.post("/generate", json={"text": "a" * 2000})
        assert big.status_code == 413 and "--max-request-bytes" in big.json()["error"]["message"], big.text

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"text": "'
            for _ in range(4):
                yield b"a" * 600
            yield b'"}'

        cut = client.post("/generate", content=chunks(), headers={"Content-Type": "application/json"})
        assert cut.status_code == 413, cut.text
        ok = client.post("/generate", json={"text": "a" * 100})
        assert ok.status_code == 200 and ok.json()["meta_info"]["prompt"] == "a" * 100
        served = {w["url"]: w["served"] for w in client.get("/workers").json()["workers"]}
        assert sum(served.values()) == 1  # only the small request reached a worker
