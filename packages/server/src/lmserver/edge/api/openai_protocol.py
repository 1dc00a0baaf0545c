"""OpenAI request models (strict types; unknown fields are ignored) and their translation to
`SamplingParams`, plus the logprob formats of completions and chat completions."""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from lmserver.edge.api.errors import APIError
from lmserver.io_struct import SamplingParams, TokenLogprob
from lmserver.multimodal.frontend import MediaRef


class _Base(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


class JsonSchemaFormat(_Base):
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema", "ebnf", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    # {"type": "ebnf", "ebnf": "root ::= ..."} or {"type": "grammar", "grammar": "root ::= ..."} (GBNF)
    ebnf: str | None = None
    grammar: str | None = None


class _SamplingFields(_Base):
    """Fields shared by both endpoints, including the extra-body ones (SGLang names)."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # extra body
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int | None = Field(None, ge=0)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    rid: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def sampling_params(req: _SamplingFields, max_tokens: int | None) -> tuple[SamplingParams, bool]:
    """The native sampling parameters of an OpenAI request, and whether max_tokens was given."""
    json_schema = req.json_schema
    ebnf = req.ebnf
    strict: bool | None = None
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if json_schema is not None or req.regex is not None or ebnf is not None:
            raise APIError(400, "give only one of response_format, regex, json_schema and ebnf",
                           param="response_format")
        if fmt.type in ("ebnf", "grammar"):
            ebnf = fmt.ebnf if fmt.type == "ebnf" else fmt.grammar
            if ebnf is None:
                raise APIError(400, f"response_format {fmt.type} needs a {fmt.type!r} field with the GBNF text",
                               param="response_format")
        elif fmt.type == "json_object":
            json_schema = '{"type": "object"}'
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
            try:
                json_schema = orjson.dumps(fmt.json_schema.schema_).decode()
            except orjson.JSONEncodeError as exc:  # nested past orjson's 255 levels
                raise APIError(400, f"response_format json_schema.schema: {exc}", param="response_format") from None
            strict = fmt.json_schema.strict
    try:
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        max_new_tokens=max_tokens if max_tokens is not None else 1 << 30,
        min_new_tokens=req.min_tokens or 0,
        stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        no_stop_trim=req.no_stop_trim,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=req.min_p or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        n=req.n, logit_bias=bias, sampling_seed=req.seed, regex=req.regex, json_schema=json_schema, ebnf=ebnf,
        json_schema_strict=strict, skip_special_tokens=req.skip_special_tokens)
    params.validate()
    return params, max_tokens is not None


_MEDIA_PARTS = {"image_url": "image", "video_url": "video"}


def _media_part(i: int, part: dict[str, Any]) -> MediaRef:
    kind = _MEDIA_PARTS[part["type"]]
    value = part.get(part["type"])
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise APIError(400, f"messages[{i}].content: a {part['type']} part needs {{\"url\": \"...\"}} "
                            "(an http(s) or data: URL, a file path, or base64)", param="messages")
    return MediaRef(kind, url)


def message_extras(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Each message's tool fields as sent: `tool_calls` (assistant), `tool_call_id` and `name` (tool)."""
    out: list[dict[str, Any]] = []
    for m in req.messages:
        extra = dict(m.model_extra or {})
        if m.name is not None:
            extra["name"] = m.name
        out.append({k: extra[k] for k in ("tool_calls", "tool_call_id", "name") if k in extra})
    return out


def chat_messages(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[MediaRef]]:
    """Messages for the chat template, and their images / videos in order. Text-only contents
    are strings (parts joined); a content with images or videos stays a list of parts
    (`{"type": "text", "text": ...}`, `{"type": "image"}`, `{"type": "video"}`)."""
    out = []
    media: list[MediaRef] = []
    for i, m in enumerate(req.messages):
        content: Any = m.content
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for part in content:
                kind = part.get("type")
                if kind in _MEDIA_PARTS:
                    ref = _media_part(i, part)
                    media.append(ref)
                    parts.append({"type": ref.kind})
                elif kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    raise APIError(400, f"messages[{i}].content: parts must be text, image_url or video_url",
                                   param="messages")
            content = parts if any(p["type"] != "text" for p in parts) else "".join(p["text"] for p in parts)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content or ""})
    return out, media


def token_str(entry: TokenLogprob, decode: Any) -> str:
    return entry[2] if entry[2] is not None else str(decode([entry[1]]))


def completion_logprobs(entries: list[TokenLogprob], tops: list[list[TokenLogprob] | None],
                        decode: Any, text_offset0: int) -> dict[str, Any]:
    """OpenAI completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [token_str(e, decode) for e in entries]
    offsets, pos = [], text_offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = [None if tl is None else {token_str(e, decode): e[0] for e in tl} for tl in tops] if tops else None
    return {"tokens": tokens, "token_logprobs": [e[0] for e in entries], "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], tops: list[list[TokenLogprob] | None],
                  decode: Any) -> dict[str, Any]:
    """OpenAI chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for i, e in enumerate(entries):
        tok = token_str(e, decode)
        tl = tops[i] if i < len(tops) and tops[i] is not None else []
        content.append({"token": tok, "logprob": e[0], "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": token_str(t, decode), "logprob": t[0],
                                          "bytes": list(token_str(t, decode).encode())} for t in tl or []]})
    return {"content": content}
