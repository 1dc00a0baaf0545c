"""Image / video references -> bytes (lmserver.multimodal.loader): files, data: URLs, base64 and
http URLs of a local test server (slow, failing, closed port, too large). Loopback only."""

from __future__ import annotations

import asyncio
import base64
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.io_struct import InvalidRequestError
from lmserver.multimodal.loader import LoadLimits, decode_base64, fetch_url, load_local

PAYLOAD = bytes(range(256)) * 5


@given(st.binary(min_size=1, max_size=300), st.booleans())
@settings(max_examples=60, deadline=None)
def test_base64_round_trips_in_both_alphabets(data: bytes, urlsafe: bool) -> None:
    text = (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(data).decode()
    assert decode_base64(text, "x") == data
    assert decode_base64(text.rstrip("="), "x") == data  # padding may be left out
    assert load_local(f"data:image/png;base64,{text}", LoadLimits()) == data


@pytest.mark.parametrize("bad", ["not base64 at all!", "abc$", "data:image/png;base64,@@@@", "data:image/png;base64",
                                 "data:image/png;base64,", "/no/such/file.png", ""])
def test_bad_references_are_clear_errors(bad: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        load_local(bad, LoadLimits())
    assert any(word in str(err.value) for word in ("base64", "data:", "empty", "not an existing file"))


def test_files_and_size_limits(tmp_path: Path) -> None:
    file = tmp_path / "x.bin"
    file.write_bytes(PAYLOAD)
    assert load_local(str(file), LoadLimits()) == PAYLOAD
    assert load_local(file.as_uri(), LoadLimits()) == PAYLOAD
    small = LoadLimits(max_bytes=100)
    for source in (str(file), f"data:;base64,{base64.b64encode(PAYLOAD).decode()}",
                   base64.b64encode(PAYLOAD).decode()):
        with pytest.raises(InvalidRequestError, match="limit"):
            load_local(source, small)
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(InvalidRequestError, match="empty"):
        load_local(str(tmp_path / "empty"), LoadLimits())


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/slow":
            time.sleep(2.0)
        if self.path == "/missing":
            self.send_response(404)
            self.end_headers()
            return
        body = PAYLOAD * (50 if self.path == "/big" else 1)
        self.send_response(200)
        if self.path != "/chunked":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _fetch(url: str, limits: LoadLimits) -> bytes:
    async def run() -> bytes:
        async with httpx.AsyncClient() as client:
            return await fetch_url(client, url, limits)

    return asyncio.run(run())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_urls(server: str) -> None:
    assert _fetch(f"{server}/ok", LoadLimits()) == PAYLOAD
    with pytest.raises(InvalidRequestError, match="HTTP 404"):
        _fetch(f"{server}/missing", LoadLimits())
    with pytest.raises(InvalidRequestError, match="limit"):
        _fetch(f"{server}/big", LoadLimits(max_bytes=len(PAYLOAD) * 10))
    with pytest.raises(InvalidRequestError, match="timed out"):
        _fetch(f"{server}/slow", LoadLimits(timeout_s=0.3))
    with pytest.raises(InvalidRequestError, match="cannot fetch"):
        _fetch(f"http://127.0.0.1:{_closed_port()}/x.png", LoadLimits(timeout_s=2.0))
