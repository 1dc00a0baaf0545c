"""OpenAI chat `tools` / `tool_choice` / `parallel_tool_calls` and reasoning output, between the
request and the engine: validate the tools, plan the prompt and the constraint, and turn a
choice's text into `message` / streamed `delta`s (content, reasoning_content, tool_calls).

- `tool_choice` `none`: the tools are not offered and nothing is parsed. `auto` (the default with
  tools): offered, output unconstrained, then parsed with the `--tool-call-parser` format.
  `required` / a named function: the output is constrained to one call's JSON body,
  `{"name": ..., "arguments" | "parameters": {...}}` (the parser's key, without the format's
  wrapper tags: cfsm cannot put text before a JSON Schema), so it always parses and validates.
- A chat template that does not mention `tools` (the embedded SmolLM2's) gets the tools
  described in the system message in the parser's format; one that does not mention
  `tool_calls` gets earlier assistant calls rendered into their content.
- Streaming: content deltas until a call starts (a tail that may be a call marker is held
  back), then the calls once the choice finishes, one chunk per call holding its id, name and
  whole arguments.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from lmserver.edge.api.errors import APIError
from lmserver.edge.api.reasoning import ReasoningParser
from lmserver.edge.api.tool_parsers import ParseResult, ToolCall, ToolParser, new_call_id

__all__ = ["ChoiceOutput", "ToolPlan", "check_schema", "plan_tools", "prepare_messages"]

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


@dataclass(frozen=True)
class ToolPlan:
    """`tools`: offered to the template (None: not offered); `parser`: parses the output (None:
    no parsing); `schema`: the JSON Schema of the constrained call (None: unconstrained)."""

    tools: list[dict[str, Any]] | None = None
    parser: ToolParser | None = None
    schema: dict[str, Any] | None = None
    parallel: bool = True


def check_schema(schema: Any, param: str) -> None:
    """400 (naming `param`) unless `schema` is a JSON Schema: checked with `jsonschema`'s
    Draft 2020-12 metaschema when installed, else structurally."""
    try:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError
    except ImportError:
        _check_structure(schema, param)
        return
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise APIError(400, f"{param} is not a valid JSON Schema{' at ' + where if where else ''}: {exc.message}",
                       param=param) from None


def _check_structure(schema: Any, param: str) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON Schema object", param=param)
    t = schema.get("type")
    if t is not None and not (t in _TYPES if isinstance(t, str) else isinstance(t, list) and set(t) <= _TYPES):
        raise APIError(400, f"{param}.type must be one of {sorted(_TYPES)}", param=param)
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise APIError(400, f"{param}.properties must be an object", param=param)
    for k, v in props.items():
        _check_structure(v, f"{param}.properties.{k}")
    req = schema.get("required", [])
    if not (isinstance(req, list) and all(isinstance(x, str) for x in req)):
        raise APIError(400, f"{param}.required must be a list of strings", param=param)


def _functions(tools: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise APIError(400, f"tools[{i}] must be an object", param=f"tools[{i}]")
        if tool.get("type", "function") != "function":
            raise APIError(400, f"tools[{i}].type must be \"function\"", param=f"tools[{i}].type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}].function must be an object", param=f"tools[{i}].function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or '-'",
                           param=f"tools[{i}].function.name")
        if any(f["name"] == name for f in out):
            raise APIError(400, f"tools[{i}].function.name {name!r} is given twice", param=f"tools[{i}].function.name")
        if "parameters" in fn and fn["parameters"] is not None:
            check_schema(fn["parameters"], f"tools[{i}].function.parameters")
        out.append(fn)
    return out


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
               parser: ToolParser | None) -> ToolPlan:
    """Validates a request's tool fields (400s name the field) and plans their use."""
    functions = _functions(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    named: str | None = None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or '
                                '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        named = fn["name"]
        if not any(f["name"] == named for f in functions):
            raise APIError(400, f"tool_choice names the function {named!r}, which is not in tools",
                           param="tool_choice")
    elif tool_choice not in ("none", "auto", "required"):
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or a named function',
                       param="tool_choice")
    elif tool_choice == "required" and not functions:
        raise APIError(400, 'tool_choice "required" needs tools', param="tool_choice")
    if tool_choice == "none" or not functions:
        return ToolPlan()
    if parser is None and tool_choice == "auto":
        raise APIError(400, "tools need a tool-call parser; this server runs with --tool-call-parser none",
                       param="tools")
    from lmserver.edge.api.tool_parsers import QwenParser

    fmt = parser or QwenParser()
    offered = [{"type": "function", "function": f} for f in functions]
    if tool_choice == "auto":
        return ToolPlan(offered, fmt, None, parallel is not False)
    chosen = [f for f in functions if named is None or f["name"] == named]
    return ToolPlan(offered, fmt, fmt.call_schema(chosen), False)


def _hf_call(call: Any) -> Any:
    """An OpenAI assistant `tool_calls` item in HF's chat-template form (arguments as an object)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        with contextlib.suppress(ValueError):
            fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "type": call.get("type", "function"), "function": fn}


def prepare_messages(messages: list[dict[str, Any]], extras: list[dict[str, Any]], plan: ToolPlan,
                     chat_template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the `tools` argument for the chat template. `extras[i]` holds message
    i's `tool_calls` / `tool_call_id` / `name` as the client sent them."""
    template = chat_template or ""
    fmt = plan.parser
    out = []
    for m, extra in zip(messages, extras, strict=True):
        m = dict(m)
        calls = extra.get("tool_calls")
        if m["role"] == "assistant" and calls:
            if "tool_calls" in template or fmt is None:
                m["tool_calls"] = [_hf_call(c) for c in calls]
            else:
                hf = [_hf_call(c) for c in calls]
                rendered = [ToolCall.of(c["function"]["name"], c["function"].get("arguments") or {}) for c in hf
                            if isinstance(c, dict) and isinstance(c.get("function"), dict)
                            and isinstance(c["function"].get("arguments", {}), dict)]
                m["content"] = fmt.render(rendered, before=m["content"] if isinstance(m["content"], str) else "")
        if m["role"] == "tool":
            for key in ("tool_call_id", "name"):
                if extra.get(key) is not None:
                    m[key] = extra[key]
        out.append(m)
    if plan.tools is None or fmt is None:
        return out, None
    if "tools" in template:
        return out, plan.tools
    text = fmt.describe_tools(plan.tools)
    if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
        out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{text}")
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, None


def _call_json(i: int, call: ToolCall) -> dict[str, Any]:
    return {"index": i, "id": new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class ChoiceOutput:
    """One choice's text turned into an OpenAI `message` or streamed `delta`s. `plan.parser`
    None: no tool parsing; `reasoning` None: no reasoning split."""

    plan: ToolPlan
    reasoning: ReasoningParser | None
    _sent_reasoning: int = 0
    _sent_content: int = 0
    _calls: tuple[ToolCall, ...] = field(default=())

    def _split(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        s = self.reasoning.split(text, final)
        return s.reasoning, s.content

    def _parse(self, content: str) -> ParseResult:
        fmt = self.plan.parser
        if fmt is None:
            return ParseResult(content, ())
        got = fmt.parse_constrained(content) if self.plan.schema is not None else fmt.parse(content)
        if got.calls and not self.plan.parallel:
            return ParseResult(got.content, got.calls[:1])
        return got

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The `message` of a finished choice, and whether it holds tool calls."""
        reasoning, content = self._split(text, True)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning
        got = self._parse(content)
        if got.calls:
            msg["content"] = got.content.strip() or None
            msg["tool_calls"] = [_call_json(i, c) for i, c in enumerate(got.calls)]
            for c in msg["tool_calls"]:
                del c["index"]
        return msg, bool(got.calls)

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The `delta`s that bring a client from what was sent to `text` (the choice's whole
        text so far). Mutates the sent cursors."""
        out: list[dict[str, Any]] = []
        reasoning, content = self._split(text, finished)
        if reasoning is not None and len(reasoning) > self._sent_reasoning:
            out.append({"reasoning_content": reasoning[self._sent_reasoning:]})
            self._sent_reasoning = len(reasoning)
        fmt = self.plan.parser
        if fmt is None:
            safe = len(content)
        elif self.plan.schema is not None:
            safe = 0
        else:
            start = fmt.call_start(content)
            safe = start if start is not None else fmt.safe_content_len(content)
        if finished and fmt is not None:
            got = self._parse(content)
            if got.calls:
                rest = got.content[self._sent_content:] if got.content.startswith(content[:self._sent_content]) else ""
                if rest.strip():
                    out.append({"content": rest})
                self._calls = got.calls
                out.extend({"tool_calls": [_call_json(i, c)]} for i, c in enumerate(got.calls))
                return out
            safe = len(content)
        if safe > self._sent_content:
            out.append({"content": content[self._sent_content:safe]})
            self._sent_content = safe
        return out

    @property
    def called(self) -> bool:
        """Whether the streamed choice ended in tool calls."""
        return bool(self._calls)
