"""A tiny JSON-over-HTTP server base (stdlib only) for the fake endpoints; runs in a daemon thread."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Reply:
    """A JSON reply, or an SSE stream when `events` is given."""

    def __init__(self, body: Any = None, status: int = 200, events: Iterator[Any] | None = None) -> None:
        self.body = body
        self.status = status
        self.events = events


class FakeHTTPServer:
    """Routes (method, path) to `handle`; records every request as (method, path, json body).

    Use as a context manager: `with FakeNativeServer(...) as server: server.url`. Setting
    `fail_status` makes every later request fail with that HTTP status.
    """

    def __init__(self) -> None:
        self.fail_status: int | None = None
        self.requests: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def handle(self, method: str, path: str, body: Any, headers: dict[str, str]) -> Reply:
        raise NotImplementedError

    def requests_to(self, path: str) -> list[Any]:
        """Bodies of the recorded requests to `path`, in arrival order."""
        with self._lock:
            return [b for _, p, b in self.requests if p == path]

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeHTTPServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                path = self.path.split("?")[0]
                with server._lock:
                    server.requests.append((method, path, body))
                try:
                    if server.fail_status is not None:
                        raise RuntimeError("injected failure")
                    reply = server.handle(method, path, body, dict(self.headers))
                except Exception as e:  # a fake's bug becomes a 500 the client can see
                    reply = Reply({"error": {"message": f"{type(e).__name__}: {e}"}}, server.fail_status or 500)
                if reply.events is None:
                    data = json.dumps(reply.body).encode()
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(reply.status)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in reply.events:
                    payload = event if isinstance(event, str) else json.dumps(event)
                    self.wfile.write(f"data: {payload}\n\n".encode())
                    self.wfile.flush()
                self.close_connection = True

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def do_PUT(self) -> None:
                self._serve("PUT")

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
