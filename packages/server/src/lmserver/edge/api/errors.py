"""Typed API errors and the handlers that answer them in OpenAI's error format.

Every error body is `{"error": {"message", "type", "param", "code"}}`, the shape the `openai`
client parses, on native routes as well.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmserver.edge.tokenizer_manager import EngineDeadError
from lmserver.io_struct import InvalidRequestError

logger = logging.getLogger("lmserver")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 499: "client_disconnected", 503: "service_unavailable", 500: "server_error"}

# Human messages for union-typed fields (pydantic reports one error per union branch).
_UNION_FIELDS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of content parts",
}


# Ranges named when a number field gets NaN or an infinity (pydantic would name one bound only).
_FINITE_RANGES = {"top_p": " in (0, 1]", "min_p": " in [0, 1]", "temperature": " >= 0",
                  "presence_penalty": " in [-2, 2]", "frequency_penalty": " in [-2, 2]",
                  "repetition_penalty": " in (0, 2]"}


class JSONBody(Response):
    """A JSON response serialized with orjson."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class APIError(Exception):
    """An HTTP error with an OpenAI-format body. `param` names the offending field."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")


def error_response(status: int, message: str, *, type: str | None = None, param: str | None = None,
                   code: str | None = None) -> JSONBody:
    body = {"error": {"message": message, "type": type or _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONBody(body, status_code=status)


def sse_error(message: str, status: int = 400) -> bytes:
    """An error as one SSE event (for failures after a stream has started)."""
    body = {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": None, "code": status}}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def format_validation_error(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """A one-line message naming the first bad field(s), and that field."""
    parts: list[str] = []
    first: str | None = None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('msg')}", None
        name = ".".join(p for p in loc if not any(c in p for c in "[]")) or "body"
        first = first or (loc[0] if loc else None)
        top = loc[-1] if loc and loc[-1] in _UNION_FIELDS else (loc[0] if loc else "")
        value = err.get("input")
        if isinstance(value, float) and not math.isfinite(value):
            msg = f"{name}: must be a finite number{_FINITE_RANGES.get(top, '')}, got {value}"
        elif top in _UNION_FIELDS:
            msg = f"{name}: {_UNION_FIELDS[top]}"
        else:
            msg = f"{name}: {err.get('msg')}"
        if msg not in parts:
            parts.append(msg)
        if len(parts) == 3:
            break
    return "invalid request: " + "; ".join(parts), first


async def read_json(request: Request) -> Any:
    """The request body parsed with orjson; malformed JSON raises APIError(400)."""
    body = await request.body()
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from None


def install_error_handlers(app: FastAPI) -> None:
    """Registers handlers so every error leaves the server in the OpenAI error format."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONBody:
        return error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONBody:
        return error_response(exc.status, str(exc))  # 503 for an OverloadedError

    @app.exception_handler(ValidationError)
    async def _pydantic(_: Request, exc: ValidationError) -> JSONBody:
        message, param = format_validation_error(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(RequestValidationError)
    async def _fastapi(_: Request, exc: RequestValidationError) -> JSONBody:
        message, param = format_validation_error(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONBody:
        return error_response(503, f"the engine is unavailable: {exc}")

    @app.exception_handler(asyncio.TimeoutError)
    async def _timeout(_: Request, exc: asyncio.TimeoutError) -> JSONBody:
        return error_response(503, "the engine did not answer in time (it may be overloaded); retry later")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONBody:
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow (RFC 9110)
        if exc.status_code == 413:
            response.headers["Connection"] = "close"  # the rest of the body stays unread
        return response

    @app.exception_handler(Exception)
    async def _other(_: Request, exc: Exception) -> JSONBody:
        logger.exception("internal error")
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
