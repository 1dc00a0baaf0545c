"""`MockBackend`: deterministic scripted outputs and logprobs; records every call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmdsl.backend.base import Backend, ChoiceDecision, GenResult, Prompt
from lmdsl.chat_template import ChatTemplate, get_chat_template_by_model_path
from lmdsl.choices import decide
from lmdsl.errors import BackendError
from lmdsl.ir import SamplingParams
from lmdsl.spec import find_first_stop

Rule = str | Sequence[str] | BaseException


@dataclass(frozen=True)
class MockCall:
    """One recorded backend call. kind: generate, stream, select, cache_prefix, begin, end, concatenate."""

    kind: str
    prompt: Prompt | None = None
    params: SamplingParams | None = None
    choices: tuple[str, ...] = ()
    result: Any = None


def mock_tokens(text: str) -> list[str]:
    """The mock's tokenizer: whitespace-led words (" Alice", "\\n", "Age:")."""
    tokens: list[str] = []
    word = ""
    for ch in text:
        if ch.isspace() and word.strip():
            tokens.append(word)
            word = ""
        word += ch
    if word:
        tokens.append(word)
    return tokens


class MockBackend(Backend):
    """A backend with scripted behaviour, for tests.

    rules: prompt suffix -> output (a str; a list of str for n > 1; an exception to raise). The
        longest suffix the prompt ends with wins; `respond(prompt, params)` is asked when none
        matches, then `default`. Outputs are cut at the first stop string and at max_new_tokens
        (`mock_tokens`).
    select_logprobs: choice -> token logprobs given the prompt (default: -1.0 per token), or a
        function (prompt, choice) -> logprobs; unconditional_logprobs: the same without prompt.
    delay_s: sleep per call (per chunk when streaming), to make concurrency observable.
    Every call is appended to `calls` (mutated under a lock).
    """

    def __init__(
        self,
        rules: Mapping[str, Rule] | None = None,
        *,
        respond: Callable[[Prompt, SamplingParams], str] | None = None,
        default: str = "mock",
        select_logprobs: Mapping[str, Sequence[float]] | Callable[[Prompt, str], Sequence[float]] | None = None,
        unconditional_logprobs: Mapping[str, Sequence[float]] | None = None,
        model_name: str = "mock-model",
        chat_template: ChatTemplate | None = None,
        is_chat_model: bool = False,
        delay_s: float = 0.0,
    ) -> None:
        self.rules = dict(rules or {})
        self.respond = respond
        self.default = default
        self.select_logprobs = select_logprobs
        self.unconditional_logprobs = dict(unconditional_logprobs or {})
        self.model_name = model_name
        self.chat_template = chat_template or get_chat_template_by_model_path(model_name)
        self.is_chat_model = is_chat_model
        self.delay_s = delay_s
        self.calls: list[MockCall] = []
        self._lock = threading.Lock()

    def _record(self, call: MockCall) -> None:
        with self._lock:
            self.calls.append(call)

    def calls_of(self, kind: str) -> list[MockCall]:
        """The recorded calls of one kind, in call order."""
        with self._lock:
            return [c for c in self.calls if c.kind == kind]

    def get_model_name(self) -> str:
        return self.model_name

    def cache_prefix(self, prefix_str: str) -> None:
        self._record(MockCall("cache_prefix", Prompt(prefix_str)))

    def begin_program(self, prompt: Prompt) -> None:
        self._record(MockCall("begin", prompt))

    def end_program(self, prompts: list[Prompt]) -> None:
        self._record(MockCall("end", prompts[0] if prompts else None))

    def concatenate_and_append(self, parent: Prompt, children: list[Prompt]) -> None:
        self._record(MockCall("concatenate", parent, result=[c.text for c in children]))

    def _lookup(self, prompt: Prompt, params: SamplingParams) -> Rule:
        best = None
        for suffix in self.rules:
            if prompt.text.endswith(suffix) and (best is None or len(suffix) > len(best)):
                best = suffix
        if best is not None:
            return self.rules[best]
        if self.respond is not None:
            return self.respond(prompt, params)
        return self.default

    @staticmethod
    def _cut(text: str, params: SamplingParams) -> tuple[str, str]:
        reason = "stop"
        pos = find_first_stop(text, params.stop or ())
        if pos != -1:
            text = text[:pos]
        tokens = mock_tokens(text)
        if params.max_new_tokens is not None and len(tokens) > params.max_new_tokens:
            text, reason = "".join(tokens[: params.max_new_tokens]), "length"
        return text, reason

    def generate(self, prompt: Prompt, params: SamplingParams) -> GenResult:
        if self.delay_s:
            time.sleep(self.delay_s)
        rule = self._lookup(prompt, params)
        if isinstance(rule, BaseException):
            self._record(MockCall("generate", prompt, params, result=rule))
            raise rule
        n = params.n or 1
        outputs = [rule] * n if isinstance(rule, str) else list(rule)[:n]
        if len(outputs) < n:
            raise BackendError(f"MockBackend rule gives {len(outputs)} outputs but n={n}")
        cut = [self._cut(o, params) for o in outputs]
        text: str | list[str] = cut[0][0] if n == 1 else [c[0] for c in cut]
        meta = {"prompt_tokens": len(mock_tokens(prompt.text)), "completion_tokens": len(mock_tokens(cut[0][0])),
                "finish_reason": {"type": cut[0][1]}, "num_api_calls": 1}
        self._record(MockCall("generate", prompt, params, result=text))
        return GenResult(text, meta)

    def generate_stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        result = self.generate(prompt, params)
        assert isinstance(result.text, str)
        self._record(MockCall("stream", prompt, params, result=result.text))
        for token in mock_tokens(result.text):
            if self.delay_s:
                time.sleep(self.delay_s)
            yield token, result.meta_info

    def _logprobs(self, prompt: Prompt, choice: str) -> list[float]:
        table = self.select_logprobs
        if callable(table):
            return list(table(prompt, choice))
        if table is not None and choice in table:
            return list(table[choice])
        return [-1.0] * len(mock_tokens(choice))

    def select(self, prompt: Prompt, choices: list[str], temperature: float, choices_method: str) -> ChoiceDecision:
        if self.delay_s:
            time.sleep(self.delay_s)
        logprobs = [self._logprobs(prompt, c) for c in choices]
        unconditional = [list(self.unconditional_logprobs.get(c, [-1.0] * len(lp))) for c, lp in zip(choices, logprobs, strict=True)]
        decision = decide(choices_method, choices, logprobs, unconditional)
        self._record(MockCall("select", prompt, None, tuple(choices), decision.decision))
        meta = {**decision.meta_info, "usage": {"num_api_calls": 1, "prompt_tokens": len(mock_tokens(prompt.text))}}
        return ChoiceDecision(decision.decision, meta)
