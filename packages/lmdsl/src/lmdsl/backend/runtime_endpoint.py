"""`RuntimeEndpoint`: the backend for servers speaking the native API (lmserver, SGLang).

The protocol is the native `/generate` contract (`NativeBackend`): prompts are sent as rendered
text (roles rendered with the chat template picked from `/get_model_info`'s `model_path`), prefix
hints are `max_new_tokens: 0` requests, `select` reads `input_token_logprobs` of a batched request.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx

from lmdsl.backend.native import Body, NativeBackend, choice_token_logprobs, pick_chat_template
from lmdsl.chat_template import ChatTemplate
from lmdsl.config import DEFAULT_CONFIG, LmdslConfig
from lmdsl.errors import BackendError

__all__ = ["RuntimeEndpoint", "choice_token_logprobs"]


class RuntimeEndpoint(NativeBackend):
    """A native-API server at `base_url` (e.g. "http://127.0.0.1:30000").

    chat_template: a template name or object, overriding the one picked from the model path.
    Construction calls `/get_model_info` once (BackendError if the server cannot be reached); its
    `prefix_hints_useful` field (lmserver's; absent from SGLang's, which then gets hints) is
    `wants_prefix_hints`.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        chat_template: str | ChatTemplate | None = None,
        config: LmdslConfig = DEFAULT_CONFIG,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # NOTE: one client shared by every thread of every program; its pool keeps as many idle
        # connections as it may open (httpx's default keeps 20 of 100, so 64 programs in flight
        # close and reopen connections all the time, where a ReadError appeared on the H200); no cap
        # on open connections: 32 tree-of-thought programs have 512 calls in flight. A `transport`
        # passed in keeps its own limits (httpx applies `limits` to its default transport only).
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=config.http_timeout_s,
                                   transport=transport,
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024))
        self.model_info = self._request("GET", "/get_model_info")
        self.model_path = str(self.model_info.get("model_path", ""))
        self.chat_template = pick_chat_template(self.model_info, chat_template)

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            response = self.client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise BackendError(f"{method} {self.base_url}{path} failed: {type(e).__name__}: {e}") from e
        if response.status_code >= 400:
            raise BackendError(
                f"{method} {self.base_url}{path} returned {response.status_code}: {response.text[:500]}",
                response.status_code,
            )
        try:
            return response.json()
        except ValueError as e:
            raise BackendError(f"{method} {self.base_url}{path} returned non-JSON: {response.text[:200]!r}") from e

    def flush_cache(self) -> Any:
        """Asks the server to empty its prefix cache."""
        return self._request("POST", "/flush_cache")

    def get_server_info(self) -> Any:
        return self._request("GET", "/get_server_info")

    # ---- transport
    def media_payload(self, ref: str) -> str:
        """A local file becomes base64 (the server may be elsewhere); URLs and base64 pass through."""
        if os.path.isfile(ref):
            with open(ref, "rb") as f:
                return base64.b64encode(f.read()).decode()
        return ref

    def native_generate(self, body: Body) -> Any:
        return self._request("POST", "/generate", body)

    def native_stream(self, body: Body) -> Iterator[dict[str, Any]]:
        try:
            with self.client.stream("POST", "/generate", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise BackendError(f"POST {self.base_url}/generate returned {response.status_code}: "
                                       f"{response.text[:500]}", response.status_code)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        break
                    yield json.loads(payload)
        except httpx.HTTPError as e:
            raise BackendError(f"streaming POST {self.base_url}/generate failed: {e}") from e
