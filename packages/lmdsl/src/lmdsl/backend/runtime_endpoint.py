"""`RuntimeEndpoint`: the backend for servers speaking the native API (lmserver, SGLang).

The protocol is the native `/generate` contract: prompts are sent as rendered text (roles
rendered with the chat template picked from `/get_model_info`'s `model_path`), prefix hints are
`max_new_tokens: 0` requests, `select` reads `input_token_logprobs` of a batched request.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx

from lmdsl.backend.base import Backend, ChoiceDecision, GenResult, Prompt
from lmdsl.chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path
from lmdsl.choices import decide
from lmdsl.config import DEFAULT_CONFIG, LmdslConfig
from lmdsl.errors import BackendError
from lmdsl.ir import SamplingParams


def _image_payload(path: str) -> str:
    """A local file becomes base64 (the server may be elsewhere); URLs and base64 pass through."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode()
    return path


def choice_token_logprobs(entries: list[list[Any]], choice: str) -> list[float]:
    """The logprobs of the tokens that carry `choice`, from `input_token_logprobs` entries
    ([logprob, token_id, text]) that start a little before the choice.

    Tokens lying wholly in the prompt are dropped; a token spanning the boundary (the prompt's
    last characters merged with the choice's first) is kept. When the token texts do not spell
    the choice, the two prompt tokens the request asked for are dropped.
    """
    texts = [e[2] if isinstance(e[2], str) else "" for e in entries]
    joined = "".join(texts)
    if joined.endswith(choice):
        boundary = len(joined) - len(choice)
        kept, end = [], 0
        for entry, text in zip(entries, texts, strict=True):
            end += len(text)
            if end > boundary:
                kept.append(entry)
    else:
        kept = entries[2:] if len(entries) > 2 else entries[-1:]
    return [float(e[0]) if e[0] is not None else 0.0 for e in kept]


class RuntimeEndpoint(Backend):
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
        if isinstance(chat_template, ChatTemplate):
            self.chat_template = chat_template
        elif chat_template is not None:
            self.chat_template = get_chat_template(chat_template)
        else:
            self.chat_template = get_chat_template_by_model_path(self.model_path)
            image_token = self.model_info.get("image_token")  # lmserver names its model's placeholder
            if isinstance(image_token, str) and image_token:
                self.chat_template = dataclasses.replace(self.chat_template, image_token=image_token)

    @property
    def wants_prefix_hints(self) -> bool:
        return self.model_info.get("prefix_hints_useful") is not False

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

    def get_model_name(self) -> str:
        return self.model_path

    def flush_cache(self) -> Any:
        """Asks the server to empty its prefix cache."""
        return self._request("POST", "/flush_cache")

    def get_server_info(self) -> Any:
        return self._request("GET", "/get_server_info")

    # ---- requests
    def _base(self, prompt: Prompt) -> dict[str, Any]:
        data: dict[str, Any] = {"text": prompt.text}
        if prompt.images:
            images = [_image_payload(p) for p in prompt.images]
            data["image_data"] = images if len(images) > 1 else images[0]
        if prompt.videos:
            if self.model_info.get("video_frames_in_requests"):  # lmserver: the frame count travels along
                data["video_data"] = [{"url": _image_payload(p), "num_frames": n} for p, n in prompt.videos]
            else:
                data["video_data"] = [_image_payload(p) for p, _ in prompt.videos]
        return data

    def _sampling(self, prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
        data = self._base(prompt)
        data["sampling_params"] = params.to_native()
        for name in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
            value = getattr(params, name)
            if value is not None:
                data[name] = value
        return data

    def cache_prefix(self, prefix_str: str) -> None:
        self._request("POST", "/generate", {"text": prefix_str, "sampling_params": {"max_new_tokens": 0}})

    def commit_lazy_operations(self, prompt: Prompt) -> None:
        data = self._base(prompt)
        data["sampling_params"] = {"max_new_tokens": 0}
        self._request("POST", "/generate", data)

    def generate(self, prompt: Prompt, params: SamplingParams) -> GenResult:
        reply = self._request("POST", "/generate", self._sampling(prompt, params))
        if isinstance(reply, list):
            texts = [r["text"] for r in reply]
            meta = dict(reply[0]["meta_info"])
            meta["completion_tokens"] = sum(r["meta_info"].get("completion_tokens", 0) for r in reply)
            meta["all_meta_info"] = [r["meta_info"] for r in reply]
            return GenResult(texts if len(texts) > 1 else texts[0], meta)
        return GenResult(reply["text"], dict(reply["meta_info"]))

    def generate_stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        data = self._sampling(prompt, params)
        data["stream"] = True
        sent = ""
        try:
            with self.client.stream("POST", "/generate", json=data) as response:
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
                    event = json.loads(payload)
                    text = event["text"]
                    yield text[len(sent):], event.get("meta_info", {})
                    sent = text
        except httpx.HTTPError as e:
            raise BackendError(f"streaming POST {self.base_url}/generate failed: {e}") from e

    def select(self, prompt: Prompt, choices: list[str], temperature: float, choices_method: str) -> ChoiceDecision:
        prefill = self._base(prompt)
        prefill["sampling_params"] = {"max_new_tokens": 0}
        prompt_len = int(self._request("POST", "/generate", prefill)["meta_info"]["prompt_tokens"])
        data = self._base(prompt)
        for key in ("image_data", "video_data"):
            if key in data:  # NOTE: a batched request takes one entry per prompt
                data[key] = [data[key]] * len(choices)
        data.update(text=[prompt.text + c for c in choices], sampling_params={"max_new_tokens": 0, "temperature": 0},
                    return_logprob=True, return_text_in_logprobs=True, logprob_start_len=max(prompt_len - 2, 0))
        replies = self._request("POST", "/generate", data)
        entries = [r["meta_info"]["input_token_logprobs"] for r in replies]
        cond = [choice_token_logprobs(e, c) for e, c in zip(entries, choices, strict=True)]
        unconditional = None
        num_calls = 2
        if choices_method == "unconditional_likelihood_normalized":
            replies_u = self._request("POST", "/generate", {
                "text": list(choices), "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 0})
            num_calls = 3
            unconditional = []
            for r, lp in zip(replies_u, cond, strict=True):
                values = [float(e[0]) if e[0] is not None else 0.0 for e in r["meta_info"]["input_token_logprobs"]]
                values = values[-len(lp):] if lp else []
                unconditional.append([0.0] * (len(lp) - len(values)) + values)
        decision = decide(choices_method, choices, cond, unconditional)
        usage = {"num_api_calls": num_calls, "prompt_tokens": prompt_len + sum(
            int(r["meta_info"].get("prompt_tokens", 0)) for r in replies)}
        return ChoiceDecision(decision.decision, {**decision.meta_info, "input_token_logprobs": entries,
                                                  "choice_token_logprobs": cond, "usage": usage})
