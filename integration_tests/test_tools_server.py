"""Tool calling and reasoning output of the OpenAI chat API: the real server (embedded SmolLM2,
CPU) driven by the official `openai` client. Oracles: `jsonschema` validates the arguments of
every call against the tool's schema; the `regex` module checks the constrained reasoning shape;
stream and non-stream answers agree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import regex

from lmserver.testing import ServerProcess

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1"}
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                                  "maxLength": 20}},
                                                        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
KW: dict[str, Any] = {"model": "default", "messages": ASK, "temperature": 0, "max_tokens": 80}


@pytest.fixture(scope="module")
def server() -> Any:
    srv = ServerProcess(["--context-length", "2048"], core=None, env=ENV)
    srv.start(timeout_s=900)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def _check_calls(calls: Any, tools: list[dict[str, Any]]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def _streamed(chunks: list[Any]) -> tuple[str, list[dict[str, Any]], str | None]:
    content, calls = "", []
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            assert tc.index == len(calls) and tc.id and tc.function.name
            calls.append({"name": tc.function.name, "arguments": tc.function.arguments})
    return content, calls, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_calls_validate_in_stream_and_non_stream(oai: openai.OpenAI, choice: Any) -> None:
    tools = [WEATHER, TIME]
    r = oai.chat.completions.create(tools=tools, tool_choice=choice, **KW)  # type: ignore[arg-type]
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    _check_calls(msg.tool_calls, tools)
    if isinstance(choice, dict):
        assert [c.function.name for c in msg.tool_calls or []] == ["get_time"]
    chunks = list(oai.chat.completions.create(tools=tools, tool_choice=choice, stream=True, **KW))  # type: ignore[arg-type]
    content, calls, finish = _streamed(chunks)
    assert finish == "tool_calls" and content == ""
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]


def test_auto_answers_content_or_valid_calls_and_none_offers_no_tools(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(tools=[WEATHER], tool_choice="auto", **KW)  # type: ignore[arg-type]
    msg = r.choices[0].message
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        _check_calls(msg.tool_calls, [WEATHER])
    else:
        assert msg.content and r.choices[0].finish_reason in ("stop", "length")
    plain = oai.chat.completions.create(**KW)
    none = oai.chat.completions.create(tools=[WEATHER], tool_choice="none", **KW)  # type: ignore[arg-type]
    assert none.choices[0].message.content == plain.choices[0].message.content  # tools not even offered
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < r.usage.prompt_tokens


def test_a_conversation_with_earlier_calls_and_tool_results(oai: openai.OpenAI) -> None:
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = oai.chat.completions.create(**dict(KW, messages=messages, max_tokens=8), tools=[WEATHER])  # type: ignore[arg-type]
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "auto",
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {"minLength": -1}}}}}],
     "required", "tools[0].function.parameters"),
    ([{"type": "function", "function": {"description": "no name"}}], "auto", "tools[0].function.name"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
])
def test_bad_tools_are_400s(oai: openai.OpenAI, tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(tools=tools, tool_choice=choice, **KW)
    assert err.value.body["param"] == param  # type: ignore[index]


def test_readme_example(server: Any) -> None:
    readme = (Path(__file__).parents[1] / "packages/server/README.md").read_text()
    section = readme[readme.index("## Tool calling and reasoning"):]
    code = regex.search(r"```python\n(.*?)```", section, regex.S)
    assert code is not None
    namespace: dict[str, Any] = {"BASE_URL": server.base_url + "/v1"}
    exec(compile(code.group(1).replace('"http://127.0.0.1:30000/v1"', "BASE_URL"), "README.md", "exec"),  # noqa: S102
         namespace)
    jsonschema.validate(namespace["args"], namespace["weather"]["function"]["parameters"])


def test_reasoning_content_is_split_and_the_constraint_applies_after_think() -> None:
    with ServerProcess(["--context-length", "2048", "--reasoning-parser", "qwen3"], core=None, env=ENV) as srv:
        close = httpx.post(srv.base_url + "/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        # the server's regex forces `<think>...</think>` before the answer; a bias on the tokens of
        # "</think>" ends the thinking soon (the tiny model would think on past max_tokens)
        kw: dict[str, Any] = dict(model="default", messages=[{"role": "user", "content": "Capital of France?"}],
                                  temperature=0, max_tokens=60, logit_bias={str(t): 5 for t in close["tokens"]},
                                  extra_body={"regex": "Paris|London"})
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        reasoning = msg.model_extra["reasoning_content"]  # type: ignore[index]
        assert r.choices[0].finish_reason == "stop" and msg.content in ("Paris", "London")
        assert reasoning and "</think>" not in reasoning
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == msg.content
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
        # a JSON Schema constraint cannot start after the reasoning part yet: a clear 400
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(tools=[WEATHER], tool_choice="required", **dict(kw, extra_body={}))
        plain = client.chat.completions.create(**dict(kw, extra_body={}, logit_bias={}, max_tokens=8))
        assert plain.choices[0].message.model_extra["reasoning_content"] is None  # type: ignore[index]
        client.close()
