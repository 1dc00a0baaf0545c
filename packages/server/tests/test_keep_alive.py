"""HTTP keep-alive: the server and the router keep an idle connection open longer than a client's
pool keeps it (httpx: 5 s by default), so a client never sends on a connection being closed."""

from __future__ import annotations

import socket
import time
from typing import Any
from urllib.parse import urlparse

import pytest

from lmserver.netutil import CLIENT_KEEPALIVE_EXPIRY_S, SERVER_KEEP_ALIVE_S
from lmserver.testing import ServerProcess

HTTPX_DEFAULT_KEEPALIVE_EXPIRY_S = 5.0


def _get_twice_on_one_connection(base_url: str, idle_s: float) -> tuple[bytes, bytes]:
    """Sends GET /health, waits `idle_s`, sends it again on the same TCP connection; returns the
    two replies (the second is b"" when the server closed the idle connection)."""
    url = urlparse(base_url)
    request = f"GET /health HTTP/1.1\r\nHost: {url.hostname}\r\nConnection: keep-alive\r\n\r\n".encode()
    with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
        sock.sendall(request)
        first = _read_response(sock)
        time.sleep(idle_s)
        try:
            sock.sendall(request)
            second = _read_response(sock)
        except OSError:
            second = b""
    return first, second


def _read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response (headers, then content-length bytes); b"" if the peer closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_constants_keep_the_server_side_longest() -> None:
    assert SERVER_KEEP_ALIVE_S > CLIENT_KEEPALIVE_EXPIRY_S >= HTTPX_DEFAULT_KEEPALIVE_EXPIRY_S


@pytest.mark.parametrize("dp", [False, True], ids=["server", "router"])
def test_an_idle_connection_outlives_a_client_pool_expiry(dp: bool) -> Any:
    if dp:  # the router alone in front of one fake server
        worker = ServerProcess([], core="fake").start()
        router = _router(worker.base_url)
        try:
            first, second = _get_twice_on_one_connection(router[1], HTTPX_DEFAULT_KEEPALIVE_EXPIRY_S + 1.5)
        finally:
            router[0].terminate()
            router[0].wait(timeout=20)
            worker.stop()
    else:
        srv = ServerProcess([], core="fake").start()
        try:
            first, second = _get_twice_on_one_connection(srv.base_url, HTTPX_DEFAULT_KEEPALIVE_EXPIRY_S + 1.5)
        finally:
            srv.stop()
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200"), (first[:40], second[:40])


def _router(worker_url: str) -> tuple[Any, str]:
    import subprocess
    import sys

    from lmserver.netutil import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmserver", "route", "--worker", worker_url, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "ready" in line:
            return proc, f"http://127.0.0.1:{port}"
    proc.kill()
    raise RuntimeError("the router did not start")
