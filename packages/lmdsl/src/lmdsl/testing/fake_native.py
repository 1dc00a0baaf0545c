"""A fake of the native HTTP API (`/generate`, `/get_model_info`, ...) driven by a `TranscriptLM`.

It follows the protocol contract of the native API: `text` single or batched, `max_new_tokens: 0`
for prefill-only requests (prefix hints, prompt token counts), input/output token logprobs from
`logprob_start_len`, `n`, stop strings, and streaming with cumulative text over SSE.
Tokens are `mock_tokens` (whitespace-led words).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lmdsl.testing.fake_lm import FakeLM, token_id
from lmdsl.testing.fake_server import FakeHTTPServer, Reply
from lmdsl.testing.mock import mock_tokens


class FakeNativeServer(FakeHTTPServer):
    """`model_path` is what `/get_model_info` reports, with `model_info` (more fields, e.g. lmserver's
    `prefix_hints_useful`); `api_key`, when set, is required as a Bearer token."""

    def __init__(self, lm: FakeLM, model_path: str = "/models/SmolLM2-135M-Instruct", api_key: str | None = None,
                 model_info: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.lm = lm
        self.model_path = model_path
        self.api_key = api_key
        self.model_info = dict(model_info or {})

    def handle(self, method: str, path: str, body: Any, headers: dict[str, str]) -> Reply:
        if self.api_key is not None and headers.get("Authorization") != f"Bearer {self.api_key}":
            return Reply({"error": {"message": "invalid api key"}}, 401)
        if path == "/health":
            return Reply({})
        if path == "/get_model_info":
            return Reply({"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                          "preferred_sampling_params": None, **self.model_info})
        if path == "/flush_cache":
            return Reply({"success": True})
        if path in ("/get_server_info", "/server_info"):
            return Reply({"model_path": self.model_path, "fake": True})
        if path == "/generate":
            return self._generate(body)
        return Reply({"error": {"message": f"no route {method} {path}"}}, 404)

    def _logprobs(self, text: str, start: int, with_text: bool) -> list[list[Any]]:
        tokens = mock_tokens(text)
        out: list[list[Any]] = []
        for k in range(max(start, 0), len(tokens)):
            lp = None if k == 0 else self.lm.logprob("".join(tokens[:k]), tokens[k])
            out.append([lp, token_id(tokens[k]), tokens[k] if with_text else None])
        return out

    def _one(self, text: str, params: dict[str, Any], body: dict[str, Any], rid: str) -> dict[str, Any]:
        # NOTE: image_data is accepted and ignored by the fake (the request log keeps it).
        max_new = int(params.get("max_new_tokens", 128))
        stop = params.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        completion, reason = ("", "length") if max_new == 0 else self.lm.complete(text, max_new, stop)
        prompt_tokens = len(mock_tokens(text))
        meta: dict[str, Any] = {
            "id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": len(mock_tokens(completion)),
            "cached_tokens": 0, "finish_reason": {"type": reason}, "e2e_latency": 0.0,
        }
        if body.get("return_logprob"):
            with_text = bool(body.get("return_text_in_logprobs"))
            start = body.get("logprob_start_len", -1)
            meta["input_token_logprobs"] = [] if start in (None, -1) else self._logprobs(text, start, with_text)
            full = self._logprobs(text + completion, prompt_tokens, with_text)
            meta["output_token_logprobs"] = full
        return {"text": completion, "meta_info": meta}

    def _generate(self, body: dict[str, Any]) -> Reply:
        if ("text" in body) == ("input_ids" in body):
            return Reply({"error": {"message": "give exactly one of text or input_ids"}}, 400)
        if "input_ids" in body:
            return Reply({"error": {"message": "the fake server takes text only"}}, 400)
        texts = body["text"]
        batched = isinstance(texts, list)
        texts = texts if batched else [texts]
        params_in = body.get("sampling_params") or {}
        params_list = params_in if isinstance(params_in, list) else [params_in] * len(texts)
        n = int(params_list[0].get("n", 1))
        if body.get("stream"):
            if batched or n > 1:
                return Reply({"error": {"message": "the fake streams single prompts only"}}, 400)
            return Reply(events=self._stream(texts[0], params_list[0], body))
        out = []
        for i, (text, params) in enumerate(zip(texts, params_list, strict=True)):
            results = [self._one(text, params, body, f"r{i}-{j}") for j in range(n)]
            out.extend(results)
        return Reply(out if batched or n > 1 else out[0])

    def _stream(self, text: str, params: dict[str, Any], body: dict[str, Any]) -> Iterator[Any]:
        final = self._one(text, params, body, "s0")
        cumulative = ""
        for token in mock_tokens(final["text"]):
            cumulative += token
            yield {"text": cumulative, "meta_info": {**final["meta_info"], "completion_tokens": len(mock_tokens(cumulative))}}
        yield "[DONE]"
