"""The data-parallel router: an HTTP proxy in front of several lmserver (or SGLang) workers.

Requests are routed by a policy (`policy.py`); workers are health-checked, dropped after
consecutive failures and re-added when they answer again; a request whose worker fails before
anything was streamed back is retried on another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmserver.edge.api.app import BodyLimit, BodyTooLargeError
from lmserver.edge.api.errors import error_response
from lmserver.edge.metrics import CONTENT_TYPE
from lmserver.edge.router.policy import CacheAwareConfig, RoutingPolicy, make_policy
from lmserver.edge.router.upstream import ShardedClient
from lmserver.netutil import CLIENT_KEEPALIVE_EXPIRY_S, SERVER_KEEP_ALIVE_S

logger = logging.getLogger("lmserver.router")

ROUTED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...] = ()
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 30000
    health_check_interval_s: float = 5.0
    health_failure_threshold: int = 3
    max_retries: int = 2
    request_timeout_s: float = 600.0
    requests_per_connection_pool: int = 16  # requests in flight per upstream httpx client (see upstream.py)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    # NOTE: a secret (repr hidden): when set, every endpoint except /health needs "Authorization: Bearer <key>",
    # and the header is forwarded to the workers (which serve the same key)
    api_key: str | None = field(default=None, repr=False)
    max_request_bytes: int = 32 << 20  # a larger request body is a 413, answered before it is read (0: no limit)


@dataclass
class WorkerState:
    url: str
    healthy: bool = True
    failures: int = 0
    in_flight: int = 0
    served: int = 0


@dataclass
class Router:
    """Worker table + policy. Mutated only from the event loop."""

    config: RouterConfig
    policy: RoutingPolicy = field(init=False)
    workers: dict[str, WorkerState] = field(init=False)

    def __post_init__(self) -> None:
        self.policy = make_policy(self.config.policy, self.config.cache_aware)
        self.workers = {u.rstrip("/"): WorkerState(u.rstrip("/")) for u in self.config.workers}

    def healthy_loads(self, exclude: set[str]) -> dict[str, int]:
        return {u: w.in_flight for u, w in self.workers.items() if w.healthy and u not in exclude}

    def pick(self, text: str, exclude: set[str]) -> str | None:
        loads = self.healthy_loads(exclude)
        if not loads:
            return None
        return self.policy.choose(text, loads)

    def mark_failure(self, url: str) -> None:
        worker = self.workers.get(url)
        if worker is None:
            return
        worker.failures += 1
        if worker.healthy and worker.failures >= self.config.health_failure_threshold:
            worker.healthy = False
            self.policy.remove_worker(url)
            logger.warning("worker %s dropped after %d failures", url, worker.failures)

    def mark_success(self, url: str) -> None:
        worker = self.workers.get(url)
        if worker is None:
            return
        if not worker.healthy:
            logger.info("worker %s is back", url)
        worker.healthy, worker.failures = True, 0


class RouterMetrics:
    """Prometheus metrics of the router, in a registry of its own: routed requests by path and
    status, and each worker's health, requests in flight and requests served."""

    def __init__(self, router: Router) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.router = router
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter("lmserver_router_requests", "routed requests answered (and 401s)",
                                     ["path", "status"], registry=r)
        self.healthy = Gauge("lmserver_router_worker_healthy", "1 when the worker passes its health checks",
                             ["worker"], registry=r)
        self.in_flight = Gauge("lmserver_router_worker_in_flight", "requests in flight to the worker", ["worker"],
                               registry=r)
        self.served = Gauge("lmserver_router_worker_served", "requests sent to the worker", ["worker"], registry=r)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        for gauge in (self.healthy, self.in_flight, self.served):
            gauge.clear()  # NOTE: a removed worker leaves no stale series
        for url, w in self.router.workers.items():
            self.healthy.labels(worker=url).set(int(w.healthy))
            self.in_flight.labels(worker=url).set(w.in_flight)
            self.served.labels(worker=url).set(w.served)
        return bytes(generate_latest(self.registry))


def routing_text(path: str, body: dict[str, Any]) -> str:
    """The text whose prefix decides the worker (first prompt of a batch)."""
    if path == "/v1/chat/completions":
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(c.get("text", "") for c in content if isinstance(c, dict))
            parts.append(f"{m.get('role', '') if isinstance(m, dict) else ''}:{content or ''}\n")
        return "".join(parts)
    value = body.get("text", body.get("prompt", body.get("input_ids", "")))
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, list):
        return " ".join(str(t) for t in value)
    return value if isinstance(value, str) else ""


def build_app(config: RouterConfig, ready_line: str | None = None) -> FastAPI:
    """The router app; `ready_line` is printed once the app has started."""
    router = Router(config)
    state: dict[str, Any] = {}

    async def health_loop() -> None:
        client: httpx.AsyncClient = state["client"]
        while True:
            for url in list(router.workers):
                try:
                    r = await client.get(f"{url}/health", timeout=5.0)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    router.mark_success(url)
                else:
                    router.mark_failure(url)
            await asyncio.sleep(config.health_check_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # NOTE: httpx's default pool (100 connections) would cap the requests in flight to all workers
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s, connect=5.0),
                                            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                                keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S))
        # routed requests: shards of bounded concurrency (one pool's scans are O(requests in flight))
        state["upstream"] = ShardedClient(
            per_shard=config.requests_per_connection_pool,
            timeout=httpx.Timeout(config.request_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=config.requests_per_connection_pool,
                                keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S))
        task = asyncio.create_task(health_loop())
        announce = asyncio.create_task(_announce_when_listening(config.host, config.port, ready_line))
        yield
        announce.cancel()
        task.cancel()
        await state["upstream"].aclose()
        await state["client"].aclose()

    app = FastAPI(title="lmserver router", lifespan=lifespan)
    app.state.router = router
    metrics = RouterMetrics(router)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)

    @app.exception_handler(BodyTooLargeError)
    async def too_large(_: Request, exc: BodyTooLargeError) -> Response:
        return error_response(413, str(exc.detail), code="request_too_large")
    if config.api_key:
        expected = f"Bearer {config.api_key}".encode()

        @app.middleware("http")
        async def bearer_auth(request: Request, call_next: Callable[[Request], Any]) -> Response:
            given = request.headers.get("authorization", "").encode()
            if request.url.path != "/health" and not hmac.compare_digest(given, expected):
                metrics.http_requests.labels(path=request.url.path, status="401").inc()
                return JSONResponse({"error": {"message": "missing or wrong API key: send 'Authorization: Bearer "
                                                          "<key>'", "type": "authentication_error", "param": None,
                                               "code": "invalid_api_key"}}, 401)
            response: Response = await call_next(request)
            return response

    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return JSONResponse({"error": {"message": "request body is not valid JSON", "code": 400}}, 400)
        text = routing_text(path, body if isinstance(body, dict) else {})
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        upstream_clients: ShardedClient = state["upstream"]
        tried: set[str] = set()
        for _ in range(config.max_retries + 1):
            url = router.pick(text, tried)
            if url is None:
                break
            tried.add(url)
            worker = router.workers[url]
            worker.in_flight += 1
            shard, client = upstream_clients.acquire()
            try:
                upstream = await client.send(
                    client.build_request("POST", url + path, content=raw, headers=headers), stream=True
                )
            except httpx.HTTPError as exc:
                worker.in_flight -= 1
                upstream_clients.release(shard)
                logger.warning("worker %s failed before answering (%s); retrying elsewhere", url, exc)
                router.mark_failure(url)
                continue
            worker.served += 1
            router.mark_success(url)
            metrics.http_requests.labels(path=path, status=str(upstream.status_code)).inc()
            return RelayResponse(upstream, functools.partial(_finish, worker, upstream_clients, shard))
        metrics.http_requests.labels(path=path, status="503").inc()
        return JSONResponse(
            {"error": {"message": "no healthy worker could take the request", "code": 503}}, 503
        )

    for path in ROUTED_PATHS:

        async def route(request: Request, _path: str = path) -> Response:
            return await forward(_path, request)

        app.add_api_route(path, route, methods=["POST"])

    async def any_worker(path: str, request: Request) -> Response:
        client: httpx.AsyncClient = state["client"]
        for url in [u for u, w in router.workers.items() if w.healthy]:
            try:
                r = await client.get(url + path, headers=dict(request.headers), timeout=30.0)
            except httpx.HTTPError:
                router.mark_failure(url)
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return JSONResponse({"error": {"message": "no healthy worker", "code": 503}}, 503)

    for path in ("/v1/models", "/get_model_info", "/health_generate"):

        async def passthrough(request: Request, _path: str = path) -> Response:
            return await any_worker(_path, request)

        app.add_api_route(path, passthrough, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        ok = any(w.healthy for w in router.workers.values())
        return JSONResponse(
            {"healthy_workers": sum(w.healthy for w in router.workers.values())}, 200 if ok else 503
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/workers")
    async def workers() -> dict[str, Any]:
        upstream: ShardedClient = state["upstream"]
        return {"policy": router.policy.name, "workers": [vars(w) for w in router.workers.values()],
                "upstream_clients": upstream.num_shards, "upstream_in_flight": upstream.in_flight()}

    @app.post("/add_worker")
    async def add_worker(url: str) -> dict[str, Any]:
        url = url.rstrip("/")
        router.workers.setdefault(url, WorkerState(url))
        return {"added": url}

    @app.post("/remove_worker")
    async def remove_worker(url: str) -> dict[str, Any]:
        url = url.rstrip("/")
        if router.workers.pop(url, None) is not None:
            router.policy.remove_worker(url)
        return {"removed": url}

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        client: httpx.AsyncClient = state["client"]
        results: dict[str, int | str] = {}
        for url in router.workers:
            try:
                r = await client.post(url + "/flush_cache", headers=dict(request.headers))
                results[url] = r.status_code
            except httpx.HTTPError as exc:
                results[url] = str(exc)
        ok = all(v == 200 for v in results.values())
        return JSONResponse({"workers": results}, 200 if ok else 400)

    return app


async def _announce_when_listening(host: str, port: int, ready_line: str | None) -> None:
    """Prints `ready_line` once the port accepts connections (lifespan startup runs before the
    socket is bound, so printing there would let clients race the bind)."""
    if not ready_line:
        return
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        print(ready_line, flush=True)
        return


def _finish(worker: WorkerState, upstream_clients: ShardedClient, shard: int) -> None:
    worker.in_flight -= 1
    upstream_clients.release(shard)


class RelayResponse(StreamingResponse):
    """A worker's response streamed to the client. Whatever the client does (reads it all,
    disconnects before the first byte or in the middle), the upstream response is closed and
    `on_close` runs exactly once: a body iterator that never started would run no `finally`."""

    def __init__(self, upstream: httpx.Response, on_close: Callable[[], None]) -> None:
        self._upstream = upstream
        self._on_close = on_close
        self._closed = False
        super().__init__(self._chunks(), status_code=upstream.status_code,
                         media_type=upstream.headers.get("content-type"))

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._upstream.aiter_raw():
                yield chunk
        finally:
            await self._close()

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):  # NOTE: also when the request task is being cancelled
                await self._upstream.aclose()
        finally:
            self._on_close()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def serve(config: RouterConfig, ready_line: str | None = None) -> None:
    """Runs the router until SIGINT/SIGTERM."""
    import uvicorn

    if not config.workers:
        raise SystemExit("lmserver route: give at least one --worker URL")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    line = ready_line or f"router ready at http://{config.host}:{config.port} ({config.policy}, {len(config.workers)} workers)"
    # NOTE: uvicorn re-raises the stop signal after its graceful shutdown, to the handler that
    # was installed before it; a no-op handler here makes SIGINT/SIGTERM a clean exit (status 0).
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(build_app(config, ready_line=line), host=config.host, port=config.port, log_level="warning",
                timeout_keep_alive=SERVER_KEEP_ALIVE_S)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="lmserver route", description="cache-aware router in front of workers")
    p.add_argument("--worker", action="append", required=True, help="worker base URL (repeat)")
    p.add_argument(
        "--policy", default="cache_aware", choices=["cache_aware", "round_robin", "shortest_queue"]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--health-check-interval-s", type=float, default=5.0)
    p.add_argument("--max-request-bytes", type=int, default=RouterConfig.max_request_bytes,
                   help="largest request body accepted, in bytes (a 413 otherwise; 0: no limit)")
    p.add_argument("--api-key", default=os.environ.get("LMSERVER_API_KEY"),
                   help="bearer token required on every endpoint except /health (default: $LMSERVER_API_KEY); "
                        "sent on to the workers")
    d = CacheAwareConfig()
    p.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                   help="cache_aware: route by prefix when the best match covers more than this share of the text")
    p.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                   help="cache_aware: loads are unbalanced when max - min in-flight requests exceeds this ...")
    p.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                   help="... and max exceeds min times this; then the least loaded worker gets the request")
    args = p.parse_args(argv)
    if not 0.0 <= args.cache_threshold <= 1.0:
        p.error(f"--cache-threshold must be within [0, 1], got {args.cache_threshold}")
    serve(
        RouterConfig(
            workers=tuple(args.worker),
            policy=args.policy,
            host=args.host,
            port=args.port,
            health_check_interval_s=args.health_check_interval_s,
            api_key=args.api_key or None,
            max_request_bytes=args.max_request_bytes,
            cache_aware=CacheAwareConfig(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold),
        )
    )
    return 0
