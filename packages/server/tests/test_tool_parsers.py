"""Tool-call parsers, reasoning splitting and the chat tool plumbing, without a model.

Oracles: calls drawn by hypothesis, serialized in each format (the format as the model card
documents it, written here independently of the parsers' `render`) with free text around,
parse back to the same calls; malformed inputs never raise; the "no `</think>`" regex agrees with
Python's `in`; streamed deltas concatenate to the non-streamed message."""

from __future__ import annotations

import json
from typing import Any

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.edge.api.chat_tools import ChoiceOutput, ToolPlan, check_schema, plan_tools, prepare_messages
from lmserver.edge.api.errors import APIError
from lmserver.edge.api.reasoning import REASONING_PARSERS, not_containing
from lmserver.edge.api.tool_parsers import (
    PARSERS,
    Llama3Parser,
    MistralParser,
    QwenParser,
    ToolCall,
    choose_parser,
)

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)
json_scalars = st.none() | st.booleans() | st.integers(-10**9, 10**9) | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
arguments = st.dictionaries(st.text(max_size=10), json_values, max_size=4)
calls_st = st.lists(st.tuples(names, arguments), min_size=1, max_size=4)
# free text cannot hold a call marker or start JSON
free_text = st.text(st.characters(blacklist_characters="{}[]<>", blacklist_categories=("Cs",)), max_size=30)


def _qwen(calls: list[tuple[str, dict[str, Any]]], before: str, after: str) -> str:
    blocks = "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    return before + blocks + after


def _mistral(calls: list[tuple[str, dict[str, Any]]], before: str, after: str) -> str:
    return before + "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls]) + after


def _llama3(calls: list[tuple[str, dict[str, Any]]], before: str, after: str) -> str:
    body = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return (before + "<|python_tag|>" + body if before.strip() else body) + after


FORMATS = {"qwen": _qwen, "mistral": _mistral, "llama3": _llama3}


def _decoded(calls: Any) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@given(calls=calls_st, before=free_text, after=free_text)
@settings(max_examples=150, deadline=None)
def test_parse_of_the_documented_format_gives_the_calls(fmt: str, calls: Any, before: str, after: str) -> None:
    parser = PARSERS[fmt]()
    got = parser.parse(FORMATS[fmt](calls, before, after))
    assert _decoded(got.calls) == calls
    assert got.content.strip() == (before + after).strip() or fmt == "llama3" and not before.strip()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@given(calls=calls_st, before=free_text, after=free_text)
@settings(max_examples=100, deadline=None)
def test_parse_inverts_render(fmt: str, calls: Any, before: str, after: str) -> None:
    parser = PARSERS[fmt]()
    objs = [ToolCall.of(n, a) for n, a in calls]
    before = before if before.strip() else ""
    assert list(parser.parse(parser.render(objs, before, after)).calls) == objs


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@given(calls=calls_st, cut=st.integers(0, 10**6), junk=st.text(max_size=20))
@settings(max_examples=150, deadline=None)
def test_malformed_text_never_raises_and_stays_content(fmt: str, calls: Any, cut: int, junk: str) -> None:
    parser = PARSERS[fmt]()
    text = FORMATS[fmt](calls, "", "")
    broken = text[:cut % (len(text) + 1)] + junk
    got = parser.parse(broken)  # never raises
    if not got.calls:
        assert got.content == broken
    parser.parse(junk)
    parser.parse_constrained(broken)


def test_parse_edge_cases() -> None:
    q = QwenParser()
    assert q.parse("<tool_call>\n{not json}\n</tool_call>").calls == ()
    assert q.parse("<tool_call>\n{not json}\n</tool_call>").content == "<tool_call>\n{not json}\n</tool_call>"
    # a call without its closing tag at the end of the output still counts (stop string trimmed)
    assert _decoded(q.parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}').calls) == [("f", {"x": 1})]
    # arguments written as JSON text
    assert _decoded(q.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>').calls) == [
        ("f", {"x": 1})]
    m = MistralParser()
    assert _decoded(m.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}').calls) == [
        ("get_weather", {"city": "Paris"})]
    assert Llama3Parser().parse("The answer is {1}.").calls == ()
    assert Llama3Parser().parse('{"name": "f"}').calls == (ToolCall("f", "{}"),)


def test_constrained_output_parses_and_schema_names_the_functions() -> None:
    fns = [{"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}, {"name": "b"}]
    for parser in (QwenParser(), Llama3Parser(), MistralParser()):
        schema = parser.call_schema(fns)
        assert [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["a", "b"]
        check_schema(schema, "s")
        text = json.dumps({"name": "a", parser.args_key: {"x": 3}}, indent=2)
        assert _decoded(parser.parse_constrained(text).calls) == [("a", {"x": 3})]
        assert parser.call_schema(fns[1:])["properties"]["name"] == {"const": "b"}


def test_choose_parser_reads_the_template() -> None:
    assert isinstance(choose_parser("auto", "{% if tools %}<tool_call>{% endif %}"), QwenParser)
    assert isinstance(choose_parser("auto", "[TOOL_CALLS]"), MistralParser)
    assert isinstance(choose_parser("auto", "<|start_header_id|>ipython"), Llama3Parser)
    assert isinstance(choose_parser("auto", "<|im_start|>"), QwenParser)  # SmolLM2: no format: qwen, described
    assert choose_parser("none", "<tool_call>") is None
    assert isinstance(choose_parser("mistral", None), MistralParser)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([{"type": "function", "function": {"parameters": {}}}], "auto", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": ""}}], "auto", "tools[0].function.name"),
    ([{"type": "retrieval"}], "auto", "tools[0].type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "auto",
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}], "auto",
     "tools[0].function.parameters"),
    ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(APIError) as err:
        plan_tools(tools, choice, None, QwenParser())
    assert err.value.status == 400 and err.value.param == param


def test_plans() -> None:
    assert plan_tools([WEATHER], "none", None, QwenParser()) == ToolPlan()
    assert plan_tools(None, None, None, QwenParser()) == ToolPlan()
    auto = plan_tools([WEATHER], None, None, QwenParser())
    assert auto.tools == [WEATHER] and auto.schema is None
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, Llama3Parser())
    assert named.schema is not None and named.schema["properties"]["name"] == {"const": "get_weather"}
    assert "parameters" in named.schema["properties"]


def test_prepare_messages_describes_tools_and_renders_earlier_calls() -> None:
    plan = plan_tools([WEATHER], "auto", None, QwenParser())
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": ""},
            {"role": "tool", "content": "sunny"}]
    extras = [{}, {"tool_calls": [{"id": "call_1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
              {"tool_call_id": "call_1"}]
    # a template without tools: described in a system message, earlier calls rendered as text
    out, tools = prepare_messages(msgs, extras, plan, "{{ messages }}")
    assert tools is None and out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert _decoded(QwenParser().parse(out[2]["content"]).calls) == [("get_weather", {"city": "Paris"})]
    assert out[3]["tool_call_id"] == "call_1"
    # a template that takes tools and tool_calls: HF's format (arguments as an object)
    out, tools = prepare_messages(msgs, extras, plan, "{{ tools }}{{ tool_calls }}")
    assert tools == [WEATHER] and out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def _stream(out: ChoiceOutput, text: str, step: int) -> dict[str, Any]:
    got: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    for end in [*range(0, len(text), step), len(text)]:
        for d in out.deltas(text[:end], end == len(text)):
            for k, v in d.items():
                got[k] = got[k] + v if k != "tool_calls" else got[k] + v
    return got


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@given(calls=calls_st, before=free_text, step=st.integers(1, 7), think=st.none() | free_text)
@settings(max_examples=60, deadline=None)
def test_stream_deltas_add_up_to_the_message(fmt: str, calls: Any, before: str, step: int,
                                             think: str | None) -> None:
    parser = PARSERS[fmt]()
    plan = ToolPlan([WEATHER], parser, None, True)
    reasoning = REASONING_PARSERS["qwen3"]() if think is not None else None
    text = (f"<think>{think}</think>" if think is not None else "") + FORMATS[fmt](calls, before, "")
    message, called = ChoiceOutput(plan, reasoning).message(text)
    out = ChoiceOutput(plan, reasoning)
    streamed = _stream(out, text, step)
    assert called and out.called
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed["tool_calls"]] == calls
    assert [c["index"] for c in streamed["tool_calls"]] == list(range(len(calls)))
    assert [c["function"] for c in message["tool_calls"]] == [c["function"] for c in streamed["tool_calls"]]
    assert (streamed["content"].strip() or None) == message["content"]
    if think is not None:
        assert streamed["reasoning_content"] == message["reasoning_content"] == think


@given(text=st.text(max_size=40), step=st.integers(1, 5))
@settings(max_examples=100, deadline=None)
def test_plain_text_streams_unchanged(text: str, step: int) -> None:
    out = ChoiceOutput(ToolPlan([WEATHER], QwenParser(), None, True), None)
    assert _stream(out, text, step)["content"] == text


@given(word_free=st.text("</thinkx> ", max_size=16))
@settings(max_examples=300, deadline=None)
def test_not_containing_regex_agrees_with_in(word_free: str) -> None:
    assert (regex.fullmatch(not_containing("</think>"), word_free) is not None) == ("</think>" not in word_free)


def test_reasoning_split() -> None:
    q, r1 = REASONING_PARSERS["qwen3"](), REASONING_PARSERS["deepseek-r1"]()
    assert (q.split("<think>hm</think>\n\nParis").reasoning, q.split("<think>hm</think>\n\nParis").content) == (
        "hm", "Paris")
    assert q.split("Paris").reasoning is None
    assert q.split("<think>unfinished").reasoning == "unfinished"
    assert r1.split("hm</think>Paris").reasoning == "hm" and r1.split("hm</think>Paris").content == "Paris"
    assert r1.split("still thinking").reasoning == "still thinking"
    assert q.split("<think>ab</thi", final=False).reasoning == "ab"
    prefix = q.constraint_prefix()
    assert regex.fullmatch(prefix + "(?:Paris)", "<think>x < y</think>\nParis")
    assert not regex.fullmatch(prefix + "(?:Paris)", "<think>x</think>y</think>Paris")
    assert regex.fullmatch(r1.constraint_prefix() + "(?:Paris)", "x</think>Paris")
