"""Tool-call formats of the chat models we serve: parse a model's text into calls, render calls
as the model would write them, and build the JSON Schema that forces one call. Torch-free, pure.

One class per format, registered in `PARSERS` by its `--tool-call-parser` name:

- `llama3`: Llama 3.x JSON calls, `{"name": ..., "parameters": {...}}` (several joined by `;`),
  the whole call region optionally introduced by `<|python_tag|>`.
- `qwen`: Qwen2 / Qwen3 / Hermes, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  possibly several, with free text around them.
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (also the newer
  `[TOOL_CALLS]name[ARGS]{...}` form).

`parse` never raises: text that does not parse as a call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["PARSERS", "ParseResult", "ToolCall", "ToolParser", "choose_parser", "new_call_id"]

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (compact, key order kept)."""

    name: str
    arguments: str

    @staticmethod
    def of(name: str, arguments: Any) -> ToolCall:
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


@dataclass(frozen=True)
class ParseResult:
    """`content`: the text outside the calls (concatenated, unstripped); `calls` in order."""

    content: str
    calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _decode(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at `pos` (after whitespace) and the index past it, or None."""
    pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def _call_of(obj: Any, keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded `{"name": str, <key>: object | JSON text}`, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as JSON text
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            return ToolCall.of(obj["name"], args) if isinstance(args, dict) else None
    return ToolCall.of(obj["name"], {})


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker (kept back
    while streaming: it may become a marker)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ToolParser:
    """A tool-call format. Subclasses set `name`, `markers`, `args_key` and implement `parse`."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # texts that start a call region
    args_key: ClassVar[str]  # "arguments" or "parameters"
    special_markers: ClassVar[bool] = False  # markers are special tokens (kept only without skip_special_tokens)

    def parse(self, text: str) -> ParseResult:
        raise NotImplementedError

    def render(self, calls: list[ToolCall], before: str = "", after: str = "") -> str:
        """`calls` as the model writes them, with free text around (a test oracle and the
        text of earlier assistant turns for templates that do not render `tool_calls`)."""
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Index where a call region starts in `text` (a marker), or None."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def safe_content_len(self, text: str) -> int:
        """While streaming `text` with no call start yet: how much of it is surely content."""
        return len(text) - _held_back(text, self.markers)

    def parse_constrained(self, text: str) -> ParseResult:
        """The output of `call_schema`'s constraint: one call object (or a list of them)."""
        got = _decode(text, 0)
        if got is None or text[got[1]:].strip():
            return ParseResult(text, ())
        objs = got[0] if isinstance(got[0], list) else [got[0]]
        calls = [_call_of(o, (self.args_key,)) for o in objs]
        if not calls or any(c is None for c in calls):
            return ParseResult(text, ())
        return ParseResult("", tuple(c for c in calls if c is not None))

    def call_schema(self, functions: list[dict[str, Any]]) -> dict[str, Any]:
        """JSON Schema of one call of one of `functions` (OpenAI `function` objects):
        `{"name": const, <args_key>: parameters}`, an anyOf for several."""
        options = [{"type": "object",
                    "properties": {"name": {"const": f["name"]},
                                   self.args_key: f.get("parameters") or {"type": "object"}},
                    "required": ["name", self.args_key], "additionalProperties": False} for f in functions]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def describe_tools(self, tools: list[dict[str, Any]]) -> str:
        """A system-prompt text offering `tools` in this format (for templates that ignore `tools`)."""
        sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = self.render([ToolCall("<function-name>", '{"<arg>": "<value>"}')])
        return ("You may call one or more functions to assist with the user query. The functions are:\n"
                f"{sigs}\nTo call a function, answer with:\n{example}")


def _obj(call: ToolCall, key: str) -> str:
    return json.dumps({"name": call.name, key: json.loads(call.arguments)}, ensure_ascii=False)


class QwenParser(ToolParser):
    name = "qwen"
    markers = ("<tool_call>",)
    args_key = "arguments"
    _open, _close = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParseResult:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (i := text.find(self._open, pos)) >= 0:
            got = _decode(text, i + len(self._open))
            call = _call_of(got[0], ("arguments", "parameters")) if got else None
            if got is None or call is None:
                content.append(text[pos:i + len(self._open)])
                pos = i + len(self._open)
                continue
            end = _WS.match(text, got[1]).end()  # type: ignore[union-attr]
            if text.startswith(self._close, end):
                end += len(self._close)
            elif text[end:].strip():  # no closing tag and more text: not a call
                content.append(text[pos:i + len(self._open)])
                pos = i + len(self._open)
                continue
            if not (calls and not text[pos:i].strip()):  # NOTE: whitespace between two calls is no content
                content.append(text[pos:i])
            calls.append(call)
            pos = end
        content.append(text[pos:])
        return ParseResult("".join(content), tuple(calls))

    def render(self, calls: list[ToolCall], before: str = "", after: str = "") -> str:
        body = "\n".join(f"{self._open}\n{_obj(c, 'arguments')}\n{self._close}" for c in calls)
        return before + body + after


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    args_key = "arguments"
    special_markers = True

    def parse(self, text: str) -> ParseResult:
        m = self.markers[0]
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (i := text.find(m, pos)) >= 0:
            start = i + len(m)
            got = _decode(text, start)
            found: list[ToolCall | None] = []
            end = start
            if got is not None:
                objs = got[0] if isinstance(got[0], list) else [got[0]]
                found = [_call_of(o, ("arguments", "parameters")) for o in objs]
                end = got[1]
            elif (k := text.find("[ARGS]", start)) > start and re.fullmatch(r"[\w.-]+", text[start:k].strip()):
                args = _decode(text, k + len("[ARGS]"))
                if args is not None:
                    found, end = [_call_of({"name": text[start:k].strip(), "arguments": args[0]}, ("arguments",))], \
                        args[1]
            if not found or any(c is None for c in found):
                content.append(text[pos:start])
                pos = start
                continue
            if not (calls and not text[pos:i].strip()):
                content.append(text[pos:i])
            calls.extend(c for c in found if c is not None)
            pos = end
        content.append(text[pos:])
        return ParseResult("".join(content), tuple(calls))

    def render(self, calls: list[ToolCall], before: str = "", after: str = "") -> str:
        body = ", ".join(_obj(c, "arguments") for c in calls)
        return f"{before}{self.markers[0]} [{body}]{after}"


class Llama3Parser(ToolParser):
    """The call region starts at `<|python_tag|>` or when the whole (stripped) output starts
    with `{`; it holds JSON objects separated by `;` or whitespace. Free text before the tag is
    content; text after the calls is content too."""

    name = "llama3"
    markers = ("<|python_tag|>",)
    args_key = "parameters"
    special_markers = True

    def call_start(self, text: str) -> int | None:
        stripped = len(text) - len(text.lstrip())
        if text[stripped:stripped + 1] == "{":
            return stripped
        return super().call_start(text)

    def safe_content_len(self, text: str) -> int:
        if not text.strip():
            return 0  # the output may still start with "{"
        return super().safe_content_len(text)

    def parse(self, text: str) -> ParseResult:
        start = self.call_start(text)
        if start is None:
            return ParseResult(text, ())
        pos = start + len(self.markers[0]) if text.startswith(self.markers[0], start) else start
        calls: list[ToolCall] = []
        while True:
            got = _decode(text, pos)
            call = _call_of(got[0], ("parameters", "arguments")) if got else None
            if got is None or call is None:
                break
            calls.append(call)
            pos = got[1]
            sep = re.compile(r"\s*;?\s*").match(text, pos)
            assert sep is not None
            if not text.startswith("{", sep.end()):
                break
            pos = sep.end()
        if not calls:
            return ParseResult(text, ())
        return ParseResult(text[:start] + text[pos:], tuple(calls))

    def render(self, calls: list[ToolCall], before: str = "", after: str = "") -> str:
        body = "; ".join(_obj(c, "parameters") for c in calls)
        return f"{before}{self.markers[0]}{body}{after}" if before else body + after


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Llama3Parser, QwenParser, MistralParser)}


def choose_parser(setting: str, chat_template: str | None) -> ToolParser | None:
    """The parser of `--tool-call-parser` (`none`: None). `auto` reads the chat template:
    `<tool_call>` picks qwen, `[TOOL_CALLS]` mistral, `<|python_tag|>` or `ipython` llama3; a
    template with none of these (the embedded SmolLM2's) gets qwen, whose format the server
    then describes in the system prompt."""
    if setting == "none":
        return None
    if setting != "auto":
        return PARSERS[setting]()
    template = chat_template or ""
    if "<tool_call>" in template:
        return QwenParser()
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3Parser()
    return QwenParser()
