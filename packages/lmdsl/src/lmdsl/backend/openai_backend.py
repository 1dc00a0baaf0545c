"""`OpenAI`: any OpenAI-compatible endpoint through `/v1/completions` and `/v1/chat/completions`.

Needs the `openai` package (`pip install "lmdsl[openai]"`). Constraints the OpenAI API itself
cannot express (`regex`, `dtype`) are sent in the extra body only when `constrained_decoding=True`
(lmserver, SGLang and vLLM accept them); otherwise they raise `ConstraintNotSupportedError`.
"""

from __future__ import annotations

import base64
import json
import mimetypes
import os
import re
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from lmdsl.backend.base import Backend, ChoiceDecision, GenResult, Prompt, TokenUsage
from lmdsl.chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path
from lmdsl.choices import decide
from lmdsl.errors import BackendError, ConstraintNotSupportedError, LmdslError
from lmdsl.ir import SamplingParams

_COMPLETION_ONLY = re.compile(r"(gpt-3\.5-turbo-instruct|davinci|babbage)")
_SELECT_MODES = ("auto", "logprobs", "logit_bias")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


def _data_url(path: str) -> str:
    if os.path.isfile(path):
        mime = mimetypes.guess_type(path)[0] or "image/png"
        with open(path, "rb") as f:
            return f"data:{mime};base64,{base64.b64encode(f.read()).decode()}"
    return path


def _chat_messages(messages: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] == "image_url":
                    parts.append({"type": "image_url", "image_url": {"url": _data_url(part["image_url"]["url"])}})
                elif part["type"] == "video_url":
                    raise ConstraintNotSupportedError("the OpenAI backend cannot send videos; use RuntimeEndpoint")
                else:
                    parts.append(part)
            content = parts
        out.append({"role": m["role"], "content": content})
    return out


def _reason(value: Any) -> dict[str, Any]:
    return {"type": "length" if value == "length" else "stop"}


class OpenAI(Backend):
    """An OpenAI-compatible model.

    is_chat_model: None guesses from the name (legacy completion models such as
        gpt-3.5-turbo-instruct are completion models; others chat).
    constrained_decoding: the endpoint accepts `regex` in the extra body and `response_format`
        json_schema on completions (lmserver, SGLang, vLLM); enables regex/dtype gens and chat select.
    select_method: for completion models, "logprobs" scores choices with echoed prompt logprobs,
        "logit_bias" picks greedily token by token with logit_bias (needs `tokenizer`; tiktoken is
        used when installed), "auto" tries logprobs and falls back to logit_bias once refused.
    client_kwargs go to `openai.OpenAI` (timeout, max_retries, default_headers, ...).
    """

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        is_chat_model: bool | None = None,
        chat_template: str | ChatTemplate | None = None,
        *,
        constrained_decoding: bool = False,
        tokenizer: Tokenizer | None = None,
        select_method: str = "auto",
        **client_kwargs: Any,
    ) -> None:
        try:
            import openai
        except ImportError as e:
            raise ImportError('the OpenAI backend needs the openai package: pip install "lmdsl[openai]"') from e
        if select_method not in _SELECT_MODES:
            raise ValueError(f"OpenAI(select_method={select_method!r}): use one of {_SELECT_MODES}")
        self._openai = openai
        self.model_name = model_name
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
                                    **client_kwargs)
        self.is_chat_model = (not _COMPLETION_ONLY.search(model_name)) if is_chat_model is None else is_chat_model
        if isinstance(chat_template, ChatTemplate):
            self.chat_template = chat_template
        elif chat_template is not None:
            self.chat_template = get_chat_template(chat_template)
        else:
            self.chat_template = (get_chat_template("default") if self.is_chat_model
                                  else get_chat_template_by_model_path(model_name))
        self.constrained_decoding = constrained_decoding
        self.tokenizer = tokenizer
        self.select_method = select_method
        self.token_usage = TokenUsage()
        self._lock = threading.Lock()

    def get_model_name(self) -> str:
        return self.model_name

    # ---- request building
    def _call(self, fn: Any, **kwargs: Any) -> Any:
        """One API call; counts its tokens in `token_usage` (not for streams, which report none)."""
        try:
            reply = fn(**kwargs)
            usage = getattr(reply, "usage", None)
            if usage is not None:
                self.token_usage.add(usage.prompt_tokens or 0, usage.completion_tokens or 0)
            return reply
        except self._openai.APIStatusError as e:
            raise BackendError(f"{self.model_name}: HTTP {e.status_code}: {e.message}", e.status_code) from e
        except self._openai.APIError as e:
            raise BackendError(f"{self.model_name}: {type(e).__name__}: {e}") from e

    def _kwargs(self, params: SamplingParams) -> dict[str, Any]:
        kw: dict[str, Any] = {"model": self.model_name, "max_tokens": params.max_new_tokens,
                              "temperature": params.temperature, "top_p": params.top_p}
        if params.n is not None and params.n != 1:
            kw["n"] = params.n
        if params.stop:
            kw["stop"] = list(params.stop)
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(params, name):
                kw[name] = getattr(params, name)
        extra: dict[str, Any] = {}
        if params.top_k is not None and params.top_k != -1:
            extra["top_k"] = params.top_k
        if params.min_p:
            extra["min_p"] = params.min_p
        if params.ignore_eos:
            extra["ignore_eos"] = True
        if params.stop_token_ids:
            extra["stop_token_ids"] = list(params.stop_token_ids)
        regex = params.constraint_regex()
        if regex is not None:
            if not self.constrained_decoding:
                raise ConstraintNotSupportedError(
                    f"{self.model_name}: regex/dtype constraints need an endpoint that accepts 'regex' in the extra "
                    "body (lmserver, SGLang, vLLM); pass OpenAI(..., constrained_decoding=True) if this one does")
            extra["regex"] = regex
        if params.ebnf is not None:
            if not self.constrained_decoding:
                raise ConstraintNotSupportedError(
                    f"{self.model_name}: ebnf constraints need an endpoint that accepts 'ebnf' in the extra body "
                    "(lmserver, SGLang); pass OpenAI(..., constrained_decoding=True) if this one does")
            extra["ebnf"] = params.ebnf
        if params.json_schema is not None:
            schema = {"type": "json_schema", "json_schema": {"name": "output", "schema": json.loads(params.json_schema)}}
            if self.is_chat_model:
                kw["response_format"] = schema
            elif self.constrained_decoding:
                extra["response_format"] = schema
            else:
                raise ConstraintNotSupportedError(
                    f"{self.model_name}: json_schema on a completion model needs constrained_decoding=True")
        if extra:
            kw["extra_body"] = extra
        return kw

    def _chat_input(self, prompt: Prompt) -> list[dict[str, Any]]:
        last = prompt.messages[-1] if prompt.messages else None
        if prompt.open_role != "assistant" or last is None or last["content"] not in ("", []):
            raise LmdslError(
                f"{self.model_name} is a chat model: a gen must come right after the assistant turn begins "
                "(s += sgl.assistant(sgl.gen(...))). For text before a gen inside the turn, use "
                "@function(num_api_spec_tokens=...) (API speculative execution)."
            )
        return _chat_messages(prompt.messages[:-1])

    @staticmethod
    def _meta(reply: Any) -> dict[str, Any]:
        usage = reply.usage
        return {"prompt_tokens": usage.prompt_tokens if usage else None,
                "completion_tokens": usage.completion_tokens if usage else None,
                "finish_reason": _reason(reply.choices[0].finish_reason), "num_api_calls": 1}

    # ---- backend contract
    def generate(self, prompt: Prompt, params: SamplingParams) -> GenResult:
        kw = self._kwargs(params)
        if self.is_chat_model:
            reply = self._call(self.client.chat.completions.create, messages=self._chat_input(prompt), **kw)
            texts = [c.message.content or "" for c in reply.choices]
        else:
            reply = self._call(self.client.completions.create, prompt=prompt.text, **kw)
            texts = [c.text for c in reply.choices]
        return GenResult(texts if len(texts) > 1 else texts[0], self._meta(reply))

    def generate_stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        kw = self._kwargs(params)
        if self.is_chat_model:
            stream = self._call(self.client.chat.completions.create, messages=self._chat_input(prompt), stream=True, **kw)
        else:
            stream = self._call(self.client.completions.create, prompt=prompt.text, stream=True, **kw)
        meta: dict[str, Any] = {"num_api_calls": 1}
        try:
            for chunk in stream:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                delta = (choice.delta.content if self.is_chat_model else choice.text) or ""
                if choice.finish_reason is not None:
                    meta["finish_reason"] = _reason(choice.finish_reason)
                if delta:
                    yield delta, meta
        except self._openai.APIError as e:
            raise BackendError(f"{self.model_name}: stream failed: {e}") from e

    def select(self, prompt: Prompt, choices: list[str], temperature: float, choices_method: str) -> ChoiceDecision:
        if self.is_chat_model:
            return self._select_by_regex(prompt, choices, temperature)
        mode = self.select_method
        if mode in ("auto", "logprobs"):
            try:
                return self._select_by_logprobs(prompt, choices, choices_method)
            except BackendError as e:
                if mode == "logprobs" or e.status_code not in (400, 404, 422, 501):
                    raise
                with self._lock:
                    self.select_method = "logit_bias"
        return self._select_by_logit_bias(prompt, choices, temperature)

    def _select_by_regex(self, prompt: Prompt, choices: list[str], temperature: float) -> ChoiceDecision:
        if not self.constrained_decoding:
            raise ConstraintNotSupportedError(
                f"{self.model_name} is a chat model: select needs constrained_decoding=True (regex in the extra "
                "body), or use a completion model")
        params = SamplingParams(max_new_tokens=max(len(c) for c in choices) + 8, temperature=temperature,
                                regex="(" + "|".join(re.escape(c) for c in choices) + ")")
        result = self.generate(prompt, params)
        if result.text not in choices:
            raise BackendError(f"{self.model_name}: constrained select returned {result.text!r}, not one of {choices}")
        return ChoiceDecision(str(result.text), {"usage": result.meta_info})

    @staticmethod
    def _choice_logprobs(logprobs: Any, start: int) -> list[float]:
        out = []
        for token, lp, offset in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.text_offset, strict=True):
            if offset + len(token) > start:
                out.append(float(lp) if lp is not None else 0.0)
        return out

    def _select_by_logprobs(self, prompt: Prompt, choices: list[str], method: str) -> ChoiceDecision:
        kw = {"model": self.model_name, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
        reply = self._call(self.client.completions.create, prompt=[prompt.text + c for c in choices], **kw)
        ordered = sorted(reply.choices, key=lambda c: c.index)
        cond = [self._choice_logprobs(c.logprobs, len(prompt.text)) for c in ordered]
        usage = {"num_api_calls": 1, "prompt_tokens": reply.usage.prompt_tokens if reply.usage else 0}
        unconditional = None
        if method == "unconditional_likelihood_normalized":
            alone = self._call(self.client.completions.create, prompt=list(choices), **kw)
            usage["num_api_calls"] += 1
            unconditional = []
            for c, lp in zip(sorted(alone.choices, key=lambda c: c.index), cond, strict=True):
                values = self._choice_logprobs(c.logprobs, 0)[-len(lp):] if lp else []
                unconditional.append([0.0] * (len(lp) - len(values)) + values)
        decision = decide(method, choices, cond, unconditional)
        return ChoiceDecision(decision.decision, {**decision.meta_info, "choice_token_logprobs": cond, "usage": usage})

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            try:
                import tiktoken

                self.tokenizer = tiktoken.encoding_for_model(self.model_name)
            except Exception as e:
                raise ConstraintNotSupportedError(
                    f"{self.model_name}: this endpoint has no prompt logprobs, so select uses logit_bias, which "
                    "needs the model's tokenizer: pass OpenAI(..., tokenizer=...) (an object with encode(str))"
                ) from e
        assert self.tokenizer is not None
        return list(self.tokenizer.encode(text))

    def _select_by_logit_bias(self, prompt: Prompt, choices: list[str], temperature: float) -> ChoiceDecision:
        token_ids = [self._encode(c) for c in choices]
        if not all(token_ids):
            raise ValueError("select: every choice must be non-empty")
        alive = [True] * len(choices)
        scores = [0] * len(choices)
        text = prompt.text
        usage = {"num_api_calls": 0, "prompt_tokens": 0, "completion_tokens": 0}
        for step in range(max(len(t) for t in token_ids)):
            bias = {str(t[step]): 100 for t, a in zip(token_ids, alive, strict=True) if a}
            reply = self._call(self.client.completions.create, model=self.model_name, prompt=text, max_tokens=1,
                               temperature=temperature, logit_bias=bias)
            usage["num_api_calls"] += 1
            if reply.usage:
                usage["prompt_tokens"] += reply.usage.prompt_tokens
                usage["completion_tokens"] += reply.usage.completion_tokens
            piece = reply.choices[0].text
            got = self._encode(piece)[:1]
            matched = False
            for i, ids in enumerate(token_ids):
                if alive[i]:
                    matched |= got == [ids[step]]
                    scores[i] += got == [ids[step]]
                    alive[i] = got == [ids[step]] and step < len(ids) - 1
            complete = [i for i in range(len(choices)) if scores[i] == len(token_ids[i])]
            if not matched or sum(alive) == 0 or (sum(alive) == 1 and not complete):
                break
            text += piece
        candidates = [i for i in range(len(choices)) if scores[i] == len(token_ids[i]) or alive[i]]
        if not candidates:
            raise BackendError(f"{self.model_name}: logit_bias select matched no choice (scores {scores})")
        best = max(candidates, key=lambda i: (scores[i], -i))
        return ChoiceDecision(choices[best], {"scores": scores, "usage": usage})
