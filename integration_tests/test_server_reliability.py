"""Issue 32 against the real server (engine core on SmolLM2, CPU), started with an API key and
SGLang's incremental streaming: the key is never returned or logged, a 50 MB body is a 413 that
is answered before the body is read, SGLang's logprob protocol (prefill-only scoring, streamed
chunks), 405's Allow, and clear 400s for values that once misled or crashed the engine core."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from lmserver.testing import ServerProcess

KEY = "sk-reliability-test-5150"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENV = {"OMP_NUM_THREADS": "1"}  # see test_server_clients.py
PROMPT = "The capital of France is"
GRACE_S = 3.0


ARGS = ["--context-length", "2048", "--api-key", KEY, "--incremental-streaming-output", "--shutdown-timeout-s", str(GRACE_S)]


@pytest.fixture(scope="module")
def server() -> Any:
    srv = ServerProcess(ARGS, core=None, env=ENV)
    srv.start(timeout_s=900)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture
def own_server() -> Any:
    """A server of the test's own, for a test that stops it (the module's server serves the others)."""
    srv = ServerProcess(ARGS, core=None, env=ENV)
    srv.start(timeout_s=900)
    yield srv
    srv.stop()


@pytest.fixture
def own_client(own_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=own_server.base_url, timeout=120, headers=AUTH) as c:
        yield c


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120, headers=AUTH) as c:
        yield c


def _still_serves(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text


# -- secrets ------------------------------------------------------------------------------------
def test_the_api_key_is_never_returned_or_logged(server: ServerProcess, client: httpx.Client) -> None:
    info = client.get("/get_server_info")
    assert info.json()["api_key"] == "***" and KEY not in info.text
    assert httpx.get(server.base_url + "/get_server_info").status_code == 401
    lines = list(server.lines)
    assert not [line for line in lines if KEY in line]
    config_lines = [line for line in lines if "'api_key': '***'" in line]
    assert len(config_lines) >= 2, "the core's and the server's resolved-config lines, redacted"


# -- bounded inputs -----------------------------------------------------------------------------
def test_a_50_mb_body_is_refused_before_it_is_read(server: ServerProcess, client: httpx.Client) -> None:
    size = 50 << 20
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n")
        t0 = time.monotonic()
        sock.sendall(head.encode() + b'{"text": "' + b"a" * 65536)  # 64 KiB of the 50 MB: the rest never comes
        answer = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            answer += chunk
        assert time.monotonic() - t0 < 5
    text = answer.decode()
    assert text.startswith("HTTP/1.1 413") and "--max-request-bytes" in text, text[:300]
    _still_serves(client)


def test_a_chunked_50_mb_upload_is_cut_at_the_limit(client: httpx.Client) -> None:
    sent = {"bytes": 0}

    def body() -> Iterator[bytes]:
        yield b'{"text": "'
        for _ in range(50):
            sent["bytes"] += 1 << 20
            yield b"a" * (1 << 20)
        yield b'"}'

    r = client.post("/generate", content=body(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"], r.text
    assert sent["bytes"] < 50 << 20, "the server read the whole upload"  # about 37 MiB: the 32 MiB limit + buffers
    _still_serves(client)


def test_health_answers_while_a_5_mb_prompt_is_tokenized(client: httpx.Client) -> None:
    """Tokenization runs off the event loop: /health (and any other request) is answered while a
    5 MB prompt (1.1 M tokens, seconds of tokenizer work) is tokenized, before that request's own
    answer (a 400: longer than the context)."""
    text = "The quick brown fox jumps over the lazy dog. " * 110_000
    done: dict[str, Any] = {}

    def big() -> None:
        done["response"] = client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
        done["at"] = time.monotonic()

    worker = threading.Thread(target=big)
    worker.start()
    time.sleep(1.0)  # the body (5 MB) is read and its tokenization under way
    health = client.get("/health")
    answered = time.monotonic()
    worker.join(timeout=300)
    assert health.status_code == 200
    r = done["response"]
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text[:300]
    assert answered < done["at"], "/health waited for the tokenization"
    _still_serves(client)


# -- protocol -----------------------------------------------------------------------------------
def test_max_new_tokens_0_with_logprobs_scores_the_whole_prompt(client: httpx.Client) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    meta = client.post("/generate", json=body).json()["meta_info"]
    lps = meta["input_token_logprobs"]
    assert len(lps) == meta["prompt_tokens"] and lps[0][0] is None and all(isinstance(x[0], float) for x in lps[1:])
    explicit = client.post("/generate", json={**body, "logprob_start_len": 0}).json()["meta_info"]
    assert explicit["input_token_logprobs"] == lps
    assert meta["output_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0


def test_streamed_logprobs_are_incremental_with_sglangs_length_field(client: httpx.Client) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2}
    whole = client.post("/generate", json=body).json()
    chunks = []
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    lengths = [c["meta_info"]["output_token_logprobs_length"] for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    got: list[Any] = []
    for c in chunks:
        got += c["meta_info"]["output_token_logprobs"]
        assert len(got) == c["meta_info"]["output_token_logprobs_length"]
    want = whole["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in got] == [t[1] for t in want] == whole["output_ids"]
    assert [t[0] for t in got] == pytest.approx([t[0] for t in want], abs=1e-4)
    assert sum((c["meta_info"]["output_top_logprobs"] for c in chunks), []) != []
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]


def test_405_names_the_allowed_methods(client: httpx.Client) -> None:
    r = client.get("/generate")
    assert r.status_code == 405 and {"POST", "PUT"} <= {m.strip() for m in r.headers["allow"].split(",")}
    assert r.json()["error"]["message"]


@pytest.mark.parametrize("path, raw, message", [
    ("/v1/completions", '{"model": "default", "prompt": "a", "top_p": NaN}', "must be a finite number in (0, 1]"),
    ("/v1/completions", '{"model": "default", "prompt": "a", "top_k": 18446744073709551616}', "top_k is out of range"),
    ("/generate", '{"text": "a", "sampling_params": {"max_new_tokens": 18446744073709551616}}',
     "max_new_tokens is out of range"),
    ("/generate", json.dumps({"text": "a", "sampling_params": {"json_schema": '{"type": "object", "properties": 5}'}}),
     "properties must be an object"),
], ids=["nan-top-p", "huge-top-k", "huge-max-new-tokens", "properties-5"])
def test_clear_messages_and_the_engine_survives(client: httpx.Client, path: str, raw: str, message: str) -> None:
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    _still_serves(client)


# -- SIGTERM drain (on a server of its own: it stops it) -------------------------------------------
@pytest.mark.slow  # a second model server and two 1900-token requests; test_launch checks SIGTERM stops
def test_sigterm_drains_then_ends_what_remains(own_server: ServerProcess, own_client: httpx.Client) -> None:
    server, client = own_server, own_client
    long_params = {"max_new_tokens": 1900, "ignore_eos": True}
    out: dict[str, Any] = {"events": []}
    streaming = threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=server.base_url, timeout=120, headers=AUTH) as c, c.stream(
                "POST", "/generate", json={"text": "Tell a long story.", "stream": True,
                                           "sampling_params": long_params}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:])
                    streaming.set()

    def call(name: str, max_new_tokens: int, delay_s: float = 0.0) -> None:
        time.sleep(delay_s)
        with httpx.Client(base_url=server.base_url, timeout=120, headers=AUTH) as c:
            out[name] = c.post("/generate", json={"text": "Count on.", "sampling_params": {
                "max_new_tokens": max_new_tokens, "ignore_eos": True}})

    threads = [threading.Thread(target=stream), threading.Thread(target=call, args=("long", 1900))]
    for t in threads:
        t.start()
    assert streaming.wait(60)
    while client.get("/get_server_info").json()["scheduler"]["num_running_reqs"] < 2:
        time.sleep(0.05)
    short = threading.Thread(target=call, args=("short", 4))
    short.start()
    time.sleep(0.3)  # the short one is admitted before the signal
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    refused = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}})
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"], refused.text
    assert client.get("/health").status_code == 503
    short.join(30)
    assert out["short"].status_code == 200 and out["short"].json()["meta_info"]["completion_tokens"] == 4
    for t in threads:
        t.join(60)
    ended_s = time.monotonic() - t0
    assert GRACE_S - 0.5 <= ended_s < GRACE_S + 10, ended_s
    assert out["long"].status_code == 503 and "shutting down" in out["long"].json()["error"]["message"]
    events = out["events"]
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"], events[-3:]
    assert json.loads(events[-2])["error"]["code"] == 503
    assert server.proc.wait(20) == 0
    assert time.monotonic() - t0 < GRACE_S + 8  # measured: 2.5 s after the grace (the core's own stop)
