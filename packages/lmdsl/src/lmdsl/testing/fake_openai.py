"""A fake OpenAI-compatible server (`/v1/models`, `/v1/completions`, `/v1/chat/completions`).

Completions continue the prompt with a `TranscriptLM`; chat replies come from `chat` (a function
of the messages, or a list of replies used in turn, the last one repeating). Tokens are
`mock_tokens` (whitespace-led words) for usage counts and echoed logprobs; `logit_bias` keys are
`CharTokenizer` ids (one token per character). `regex` in the extra body cuts the reply to its
longest prefix that matches. `supports_echo_logprobs=False` refuses `echo` with 400, like
endpoints without prompt logprobs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from lmdsl.spec import find_first_stop
from lmdsl.testing.fake_lm import FakeLM
from lmdsl.testing.fake_server import FakeHTTPServer, Reply
from lmdsl.testing.mock import mock_tokens


class CharTokenizer:
    """One token per character; ids are code points (what the fake's logit_bias understands)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class FakeOpenAIServer(FakeHTTPServer):
    def __init__(
        self,
        lm: FakeLM,
        chat: Callable[[list[dict[str, Any]]], str] | list[str] | None = None,
        *,
        model: str = "fake-model",
        supports_echo_logprobs: bool = True,
    ) -> None:
        super().__init__()
        self.lm = lm
        self.chat = chat
        self.model = model
        self.supports_echo_logprobs = supports_echo_logprobs
        self._chat_turn = 0

    def handle(self, method: str, path: str, body: Any, headers: dict[str, str]) -> Reply:
        if path == "/v1/models":
            return Reply({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                      "owned_by": "fake"}]})
        if path == "/v1/completions":
            return self._completions(body)
        if path == "/v1/chat/completions":
            return self._chat(body)
        return Reply({"error": {"message": f"no route {method} {path}"}}, 404)

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    @staticmethod
    def _finish(text: str, body: dict[str, Any]) -> tuple[str, str]:
        stop = body.get("stop") or ()
        pos = find_first_stop(text, (stop,) if isinstance(stop, str) else tuple(stop))
        reason = "stop"
        if pos != -1:
            text = text[:pos]
        tokens = mock_tokens(text)
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and len(tokens) > max_tokens:
            text, reason = "".join(tokens[:max_tokens]), "length"
        regex = body.get("regex")
        if regex is not None:
            fitting = [k for k in range(len(text), 0, -1) if re.fullmatch(regex, text[:k])]
            if not fitting:
                raise ValueError(f"the fake cannot satisfy regex {regex!r} with {text!r}")
            text = text[: fitting[0]]
        return text, reason

    def _echo_logprobs(self, text: str) -> dict[str, Any]:
        tokens = mock_tokens(text)
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        lps = [None] + [self.lm.logprob("".join(tokens[:k]), tokens[k]) for k in range(1, len(tokens))]
        return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets, "top_logprobs": None}

    def _completions(self, body: dict[str, Any]) -> Reply:
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        if body.get("echo") and not self.supports_echo_logprobs:
            return Reply({"error": {"message": "echo is not supported", "type": "invalid_request_error"}}, 400)
        choices: list[dict[str, Any]] = []
        prompt_tokens = completion_tokens = 0
        n = int(body.get("n") or 1)
        for prompt in prompts:
            prompt_tokens += len(mock_tokens(prompt))
            if body.get("logit_bias"):
                allowed = sorted(int(k) for k, v in body["logit_bias"].items() if v >= 50)
                preferred = self.lm.continuation(prompt)[:1]
                text = preferred if preferred and ord(preferred) in allowed else chr(allowed[0])
                reason = "length"
            elif body.get("max_tokens") == 0:
                text, reason = "", "length"
            else:
                text, reason = self._finish(self.lm.continuation(prompt), body)
            for _ in range(n):
                completion_tokens += len(mock_tokens(text))
                choice: dict[str, Any] = {"index": len(choices), "text": (prompt + text) if body.get("echo") else text,
                                          "finish_reason": reason, "logprobs": None}
                if body.get("echo") and body.get("logprobs") is not None:
                    choice["logprobs"] = self._echo_logprobs(prompt + text)
                choices.append(choice)
        if body.get("stream"):
            return Reply(events=self._stream(choices[0]["text"], chat=False))
        return Reply({"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body["model"],
                      "choices": choices, "usage": self._usage(prompt_tokens, completion_tokens)})

    def _chat_reply(self, messages: list[dict[str, Any]]) -> str:
        if callable(self.chat):
            return self.chat(messages)
        if isinstance(self.chat, list):
            with self._lock:
                reply = self.chat[min(self._chat_turn, len(self.chat) - 1)]
                self._chat_turn += 1
            return reply
        last = messages[-1]["content"]
        return self.lm.continuation(last if isinstance(last, str) else "")

    def _chat(self, body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        text, reason = self._finish(self._chat_reply(messages), body)
        prompt_tokens = sum(3 + len(mock_tokens(m["content"] if isinstance(m["content"], str) else "x"))
                            for m in messages)
        if body.get("stream"):
            return Reply(events=self._stream(text, chat=True))
        n = int(body.get("n") or 1)
        choices = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                   for i in range(n)]
        return Reply({"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": body["model"],
                      "choices": choices, "usage": self._usage(prompt_tokens, n * len(mock_tokens(text)))})

    def _stream(self, text: str, chat: bool) -> Iterator[Any]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        for token in mock_tokens(text):
            choice = ({"index": 0, "delta": {"content": token}, "finish_reason": None} if chat
                      else {"index": 0, "text": token, "finish_reason": None})
            yield {"id": "fake", "object": kind, "created": 0, "model": self.model, "choices": [choice]}
        last = ({"index": 0, "delta": {}, "finish_reason": "stop"} if chat
                else {"index": 0, "text": "", "finish_reason": "stop"})
        yield {"id": "fake", "object": kind, "created": 0, "model": self.model, "choices": [last]}
        yield "[DONE]"
