"""The FastAPI application: routes, bearer authentication, request body limit, errors, /metrics."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmserver.edge.api import native, openai_routes
from lmserver.edge.api.errors import JSONBody, error_response, install_error_handlers
from lmserver.edge.metrics import CONTENT_TYPE, ServerMetrics
from lmserver.edge.tokenizer_manager import TokenizerManager

_OPEN_PATHS = {"/health"}


class BearerAuth:
    """Pure ASGI middleware: every path except /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, expected: bytes) -> None:
        self.app, self.expected = app, expected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLargeError(StarletteHTTPException):
    """A request body over `--max-request-bytes` (answered 413 by the HTTP error handler)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes "
                              "(--max-request-bytes)")


class BodyLimit:
    """Pure ASGI middleware bounding request bodies to `max_bytes`.

    A declared Content-Length over the limit is answered 413 before any of the body is read;
    a chunked body is counted as it arrives and the read that passes the limit raises
    BodyTooLargeError (a 413), so at most `max_bytes` plus one chunk is ever buffered.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            exc = BodyTooLargeError(self.max_bytes)
            # NOTE: "Connection: close": the unread body must not be parsed as the next request
            response = error_response(413, str(exc.detail), code="request_too_large")
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


class HttpMetrics:
    """Pure ASGI middleware counting answered HTTP requests by route path and status code."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, paths: set[str]) -> None:
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self.paths else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(path=path, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _openapi_with_bodies(app: FastAPI) -> dict[str, Any]:
    """FastAPI's description of `app` plus the request bodies the OpenAI routes parse themselves
    (their pydantic models, so clients and fuzzers see the fields); built once."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    from lmserver.edge.api.openai_protocol import ChatCompletionRequest, CompletionRequest

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        operation = schema.get("paths", {}).get(path, {}).get("post")
        if operation is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = schema
    return schema


def create_app(mgr: TokenizerManager) -> FastAPI:
    """An app serving `mgr` (stored as `app.state.manager`); `mgr.config.api_key` turns on auth."""
    # NOTE: /openapi.json describes every endpoint (clients and API fuzzers read it); no /docs page (it loads its
    # scripts from a CDN)
    app = FastAPI(title="lmserver", default_response_class=JSONBody, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.manager = mgr
    install_error_handlers(app)
    app.include_router(native.router)
    app.include_router(openai_routes.router)
    app.openapi = lambda: _openapi_with_bodies(app)  # type: ignore[method-assign]

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(mgr.metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(BodyLimit, max_bytes=mgr.config.max_request_bytes)
    if mgr.config.api_key:  # NOTE: outside BodyLimit: a request without the key is refused before its size matters
        app.add_middleware(BearerAuth, expected=f"Bearer {mgr.config.api_key}".encode())
    routes = [*native.router.routes, *openai_routes.router.routes, *app.routes]
    paths = {str(route.path) for route in routes if hasattr(route, "path")}
    app.add_middleware(HttpMetrics, metrics=mgr.metrics, paths=paths)  # outermost: counts 401s too
    return app
