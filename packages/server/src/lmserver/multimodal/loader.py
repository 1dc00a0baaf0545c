"""Bytes of one image / video reference: a file path, a `data:` URL, base64 text, or an http(s)
URL fetched with a timeout and a size limit. Every failure is an InvalidRequestError (a 400).

Runs in the HTTP process, off the engine; URL fetches are async (httpx), files and base64 are
read in a thread by the caller when they may be large.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urlparse

import httpx

from lmserver.io_struct import InvalidRequestError


@dataclass(frozen=True)
class LoadLimits:
    max_bytes: int = 64 << 20
    timeout_s: float = 10.0


def _too_large(what: str, limits: LoadLimits) -> InvalidRequestError:
    return InvalidRequestError(f"{what} is larger than the server's limit of {limits.max_bytes} bytes "
                               "(--mm-max-fetch-bytes)")


def _short(source: str) -> str:
    return source if len(source) <= 80 else source[:77] + "..."


def decode_base64(text: str, what: str) -> bytes:
    """Strict base64 (standard or URL-safe alphabet, whitespace ignored); raises InvalidRequestError."""
    compact = "".join(text.split())
    if "-" in compact or "_" in compact:
        compact = compact.replace("-", "+").replace("_", "/")
    compact += "=" * (-len(compact) % 4)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{what} is not valid base64") from None
    if not data:
        raise InvalidRequestError(f"{what} is empty")
    return data


def _data_url(source: str, limits: LoadLimits) -> bytes:
    header, sep, payload = source[5:].partition(",")
    if not sep:
        raise InvalidRequestError("a data: URL needs a ',' before its payload (data:image/png;base64,...)")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise _too_large("the data: URL", limits)
    if header.endswith(";base64"):
        return decode_base64(payload, "the data: URL's payload")
    data = unquote_to_bytes(payload)
    if not data:
        raise InvalidRequestError("the data: URL is empty")
    return data


def read_file(path: str, limits: LoadLimits) -> bytes:
    """A local file's bytes (size-checked before reading)."""
    try:
        size = os.path.getsize(path)
        if size > limits.max_bytes:
            raise _too_large(f"file {_short(path)!r}", limits)
        with open(path, "rb") as handle:
            data = handle.read(limits.max_bytes + 1)
    except OSError as exc:
        raise InvalidRequestError(f"cannot read file {_short(path)!r}: {exc.strerror or exc}") from None
    if not data:
        raise InvalidRequestError(f"file {_short(path)!r} is empty")
    return data


def load_local(source: str, limits: LoadLimits) -> bytes:
    """Bytes of a reference that needs no network: a `data:` URL, `file://` URL, path or base64."""
    if source.startswith("data:"):
        return _data_url(source, limits)
    if source.startswith("file://"):
        return read_file(unquote_to_bytes(urlparse(source).path).decode(errors="replace"), limits)
    if os.path.isfile(source):
        return read_file(source, limits)
    if len(source) * 3 // 4 > limits.max_bytes:
        raise _too_large("the base64 payload", limits)
    try:
        return decode_base64(source, "base64")
    except InvalidRequestError:
        raise InvalidRequestError(
            f"{_short(source)!r} is not an existing file, an http(s) / data: URL, or base64 data") from None


async def fetch_url(client: httpx.AsyncClient, url: str, limits: LoadLimits) -> bytes:
    """GET `url` (redirects followed) within the timeout and size limit."""
    try:
        async with client.stream("GET", url, timeout=limits.timeout_s, follow_redirects=True) as resp:
            if resp.status_code != 200:
                raise InvalidRequestError(f"fetching {_short(url)} answered HTTP {resp.status_code}")
            declared = resp.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                raise _too_large(f"{_short(url)}", limits)
            chunks: list[bytes] = []
            total = 0
            async for chunk in resp.aiter_bytes():
                total += len(chunk)
                if total > limits.max_bytes:
                    raise _too_large(f"{_short(url)}", limits)
                chunks.append(chunk)
    except httpx.TimeoutException:
        raise InvalidRequestError(f"fetching {_short(url)} timed out after {limits.timeout_s:g} s "
                                  "(--mm-fetch-timeout-s)") from None
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"cannot fetch {_short(url)}: {type(exc).__name__}: {exc}") from None
    data = b"".join(chunks)
    if not data:
        raise InvalidRequestError(f"{_short(url)} returned no data")
    return data


def is_remote(source: str) -> bool:
    return source.startswith(("http://", "https://"))
