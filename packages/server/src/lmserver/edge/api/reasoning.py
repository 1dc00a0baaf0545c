"""Reasoning output: split a model's `<think>...</think>` part from its answer (`--reasoning-parser`),
for whole texts and for growing streamed texts, and the regex prefix that lets a constraint
apply only after `</think>`. Torch-free, pure.

- `qwen3`: the reasoning is `<think>...</think>` at the start of the output; an output that does
  not start with `<think>` is all content (when streaming) unless a `</think>` closes it.
- `deepseek-r1`: the chat template opens `<think>` itself, so the output is reasoning up to
  `</think>` (an optional `<think>` first is dropped); without `</think>` it is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "not_containing"]

START, END = "<think>", "</think>"


def not_containing(word: str) -> str:
    """A regex (cfsm's subset: no lookaround) of the strings that do not contain `word`, for a
    `word` whose first character occurs only once in it (`</think>`)."""
    first, rest = word[0], word[1:]
    assert rest and first not in rest, word
    esc = [_esc(c) for c in word]
    # A: `<` + a proper prefix of the rest + a mismatching character other than `<`.
    full = ""
    for i in range(len(rest) - 1, -1, -1):
        miss = f"[^{esc[i + 1]}{esc[0]}]"
        full = miss if not full else f"(?:{miss}|{esc[i + 1]}{full})"
    attempt = f"{esc[0]}{full}"
    # P: `<` + a proper prefix of the rest (followed by another `<` or by the end).
    partial = ""
    for i in range(len(rest) - 2, -1, -1):
        partial = f"(?:{esc[i + 1]}{partial})?"
    partial = f"{esc[0]}{partial}"
    return f"(?:[^{esc[0]}]|(?:{partial})*{attempt})*(?:{partial})*"


def _esc(c: str) -> str:
    return "\\" + c if not c.isalnum() else c


@dataclass(frozen=True)
class ReasoningSplit:
    """`reasoning`: None when the output has no reasoning part; `content`: the rest."""

    reasoning: str | None
    content: str


class ReasoningParser:
    name: ClassVar[str]
    opens_in_prompt: ClassVar[bool]  # the template's generation prompt already opened <think>

    def split(self, text: str, final: bool = True) -> ReasoningSplit:
        """Splits `text`. With `final=False` (a streamed text that will grow), a tail that may
        become `<think>` / `</think>` is held back (in neither part), so each part only grows."""
        lead = len(text) - len(text.lstrip())
        body = text[lead:]
        if body.startswith(START):
            inner = body[len(START):]
        elif not final and START.startswith(body):
            return ReasoningSplit(None, "")  # may still become <think>
        elif self.opens_in_prompt:
            inner = text
        else:
            return ReasoningSplit(None, text)
        j = inner.find(END)
        if j >= 0:
            return ReasoningSplit(inner[:j], inner[j + len(END):].lstrip())
        if final:
            return ReasoningSplit(inner, "")
        return ReasoningSplit(inner[:len(inner) - _held(inner, END)], "")

    def constraint_prefix(self) -> str:
        """The regex of the reasoning part, to put before a constraint's regex."""
        opening = f"(?:{START})?" if self.opens_in_prompt else START
        return f"{opening}{not_containing(END)}{END}\\s*"


def _held(text: str, word: str) -> int:
    for k in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:k]):
            return k
    return 0


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    opens_in_prompt = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek-r1"
    opens_in_prompt = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}
