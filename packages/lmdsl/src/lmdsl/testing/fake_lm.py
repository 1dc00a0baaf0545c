"""A deterministic stand-in for a language model, shared by the fake HTTP servers.

`TranscriptLM` knows one ideal transcript and continues any prompt with the rest of it: it finds
the longest end of the prompt that occurs in the transcript and returns what follows. A program
that follows the transcript's template gets the same answers however it splits its calls, which
is what API speculative execution relies on.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

from lmdsl.spec import find_first_stop
from lmdsl.testing.mock import mock_tokens


def token_id(token: str) -> int:
    """A stable id for a fake token."""
    return zlib.crc32(token.encode()) % 50_000


def default_logprob(context: str, token: str) -> float:
    """Fake token logprob: shorter tokens are likelier; deterministic."""
    return -0.1 * len(token.strip() or token)


class FakeLM:
    """A greedy fake model: `continuation(prompt)` is all it would write; `logprob(context, token)` scores."""

    logprob: Callable[[str, str], float] = staticmethod(default_logprob)

    def continuation(self, prompt: str) -> str:
        raise NotImplementedError

    def complete(self, prompt: str, max_tokens: int, stop: tuple[str, ...]) -> tuple[str, str]:
        """(text, finish reason "stop" or "length") of a greedy completion."""
        text = self.continuation(prompt)
        reason = "stop"
        pos = find_first_stop(text, stop)
        if pos != -1:
            text = text[:pos]
        tokens = mock_tokens(text)
        if len(tokens) > max_tokens:
            text, reason = "".join(tokens[:max_tokens]), "length"
        return text, reason


class FunctionLM(FakeLM):
    """Continues a prompt with `fn(prompt)`."""

    def __init__(self, fn: Callable[[str], str], logprob: Callable[[str, str], float] = default_logprob) -> None:
        self.fn = fn
        self.logprob = logprob  # type: ignore[method-assign]

    def continuation(self, prompt: str) -> str:
        return self.fn(prompt)


@dataclass
class TranscriptLM(FakeLM):
    """Continues prompts from `transcript`.

    The longest end of the prompt (at least `min_overlap` characters) found in the transcript is
    located (first occurrence) and what follows it is the continuation; `fallback` otherwise.
    """

    transcript: str
    fallback: str = ""
    logprob: Callable[[str, str], float] = default_logprob
    min_overlap: int = 3

    def continuation(self, prompt: str) -> str:
        for j in range(min(len(prompt), len(self.transcript)), self.min_overlap - 1, -1):
            i = self.transcript.find(prompt[-j:])
            if i != -1:
                return self.transcript[i + j:]
        return self.fallback


class CharMarkovLM(FakeLM):
    """An autoregressive greedy model: the next character follows the first occurrence, in `corpus`,
    of the prompt's last `order` characters. Being autoregressive, it is self-consistent: continuing
    a prompt extended by the start of its own continuation gives the rest of that continuation."""

    def __init__(self, corpus: str, order: int = 8, max_chars: int = 400) -> None:
        self.order = order
        self.max_chars = max_chars
        self.table: dict[str, str] = {}
        for i in range(len(corpus) - order):
            self.table.setdefault(corpus[i:i + order], corpus[i + order])

    def continuation(self, prompt: str) -> str:
        out = ""
        context = prompt
        while len(out) < self.max_chars:
            nxt = self.table.get(context[-self.order:])
            if nxt is None:
                break
            out += nxt
            context += nxt
        return out
