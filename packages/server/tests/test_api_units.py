"""Unit tests of the API helpers: stream pacing, merging generations, OpenAI -> native params."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from lmserver.edge.api.errors import APIError
from lmserver.edge.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    sampling_params,
)
from lmserver.edge.api.streams import due, merge, new_text
from lmserver.edge.tokenizer_manager import GenState
from lmserver.multimodal.frontend import MediaRef


def test_due_streams_first_every_interval_and_last() -> None:
    s = GenState(rid="r", prompt_tokens=3)
    emitted = []
    for n in range(1, 11):
        s.completion_tokens, s.finished = n, n == 10
        if due(s, 4):
            emitted.append(n)
    assert emitted == [1, 5, 9, 10]


def test_new_text_returns_each_character_once() -> None:
    s = GenState(rid="r", prompt_tokens=1)
    parts = []
    for piece in ["Hel", "lo", "", " world"]:
        s.text += piece
        parts.append(new_text(s))
    assert parts == ["Hel", "lo", "", " world"] and "".join(parts) == s.text


async def _gen(rid: str, n: int, fail_at: int | None = None) -> AsyncIterator[GenState]:
    s = GenState(rid=rid, prompt_tokens=1)
    for i in range(n):
        await asyncio.sleep(0)
        if i == fail_at:
            raise ValueError(f"{rid} failed")
        s.completion_tokens = i + 1
        yield s


def test_merge_interleaves_all_items_with_their_index() -> None:
    async def run() -> list[tuple[int, int]]:
        return [(i, s.completion_tokens) async for i, s in merge([_gen("a", 3), _gen("b", 2)])]

    got = asyncio.run(run())
    assert sorted(got) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]
    assert [c for i, c in got if i == 0] == [1, 2, 3]


def test_merge_propagates_the_first_error() -> None:
    async def run() -> None:
        async for _ in merge([_gen("a", 5), _gen("b", 5, fail_at=2)]):
            pass

    with pytest.raises(ValueError, match="b failed"):
        asyncio.run(run())


def test_openai_params_map_to_native_names() -> None:
    req = CompletionRequest.model_validate_json(json.dumps({
        "prompt": "x", "max_tokens": 7, "temperature": 0.5, "stop": "\n", "seed": 3, "top_k": 4, "min_p": 0.1,
        "repetition_penalty": 1.2, "logit_bias": {"12": -5}, "n": 2}))
    p, given = sampling_params(req, req.max_tokens)
    assert given and (p.max_new_tokens, p.temperature, p.stop, p.sampling_seed, p.top_k) == (7, 0.5, ["\n"], 3, 4)
    assert (p.min_p, p.repetition_penalty, p.logit_bias, p.n) == (0.1, 1.2, {12: -5.0}, 2)


def test_response_format_becomes_a_json_schema_string() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = ChatCompletionRequest.model_validate_json(json.dumps({
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}))
    p, given = sampling_params(req, None)
    assert json.loads(p.json_schema or "") == schema and not given
    req = ChatCompletionRequest.model_validate_json(json.dumps({
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}))
    assert json.loads(sampling_params(req, None)[0].json_schema or "") == {"type": "object"}


def test_ebnf_forms_and_content_parts_are_joined() -> None:
    req = ChatCompletionRequest.model_validate_json(json.dumps({
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "ebnf": "root ::= 'x'"}))
    assert sampling_params(req, None)[0].ebnf == "root ::= 'x'"
    for fmt in ({"type": "ebnf", "ebnf": "root ::= 'y'"}, {"type": "grammar", "grammar": "root ::= 'y'"}):
        r = ChatCompletionRequest.model_validate_json(json.dumps({
            "messages": [{"role": "user", "content": "x"}], "response_format": fmt}))
        assert sampling_params(r, None)[0].ebnf == "root ::= 'y'"
    for body in ({"response_format": {"type": "ebnf"}},
                 {"response_format": {"type": "ebnf", "ebnf": "root ::= 'y'"}, "regex": "a"}):
        r = ChatCompletionRequest.model_validate_json(json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                                  **body}))
        with pytest.raises(APIError, match="response_format"):
            sampling_params(r, None)
    assert chat_messages(req) == ([{"role": "system", "content": "ab"}], [])
    img = ChatCompletionRequest.model_validate_json(json.dumps({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                  {"type": "image_url", "image_url": {"url": "x.png"}},
                                                  {"type": "video_url", "video_url": {"url": "v.mp4"}}]}]}))
    messages, media = chat_messages(img)
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image"},
                                                     {"type": "video"}]}]
    assert media == [MediaRef("image", "x.png"), MediaRef("video", "v.mp4")]
    for bad in ({"type": "audio", "audio": {}}, {"type": "image_url", "image_url": {"url": ""}},
                {"type": "image_url", "image_url": {}}):
        req = ChatCompletionRequest.model_validate_json(json.dumps({
            "messages": [{"role": "user", "content": [bad]}]}))
        with pytest.raises(APIError, match="content"):
            chat_messages(req)


def test_model_names_served_like_sglang_unless_strict() -> None:
    from types import SimpleNamespace

    from lmserver.config import ServerConfig
    from lmserver.edge.api.openai_routes import _check_model, served_model_name

    ready = SimpleNamespace(model_path="/some/cache/SmolLM2-135M-Instruct/")
    loose = SimpleNamespace(config=ServerConfig(), ready=ready)
    strict = SimpleNamespace(config=ServerConfig(strict_model_name=True), ready=ready)
    named = SimpleNamespace(config=ServerConfig(served_model_name="mine"), ready=ready)
    assert served_model_name(loose) == "SmolLM2-135M-Instruct"  # the folder's name, not the host's path
    assert served_model_name(named) == "mine"
    assert _check_model(loose, "gpt-3.5-turbo-instruct") == "SmolLM2-135M-Instruct"
    for alias in (None, "default", "SmolLM2-135M-Instruct", "/some/cache/SmolLM2-135M-Instruct/"):
        assert _check_model(strict, alias) == "SmolLM2-135M-Instruct"
    with pytest.raises(APIError) as err:
        _check_model(strict, "gpt-3.5-turbo-instruct")
    assert err.value.status == 404
