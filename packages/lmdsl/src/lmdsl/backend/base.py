"""The backend contract: plain data in (`Prompt`, `SamplingParams`), plain data out."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lmdsl.chat_template import ChatTemplate, get_chat_template
from lmdsl.errors import ConstraintNotSupportedError
from lmdsl.ir import SamplingParams


@dataclass(frozen=True)
class Prompt:
    """What a backend sees of a program state at one call.

    text: the whole prompt text (roles rendered with the backend's chat template).
    messages: the finished chat messages, plus the open turn's partial text as the last entry when
        a role is open; each {"role", "content"} with content a str or a list of OpenAI parts.
    images: image paths in prompt order; videos: (path, num_frames) pairs.
    open_role: the role whose turn is open (its prefix is in `text`), or None.
    """

    text: str
    messages: tuple[dict[str, Any], ...] = ()
    images: tuple[str, ...] = ()
    videos: tuple[tuple[str, int], ...] = ()
    open_role: str | None = None


@dataclass(frozen=True)
class GenResult:
    """One generation: `text` (a list of n texts when n > 1) and the backend's meta info.

    meta_info holds at least "prompt_tokens" and "completion_tokens" when the backend knows them,
    and "num_api_calls" (calls this result took; default 1).
    """

    text: str | list[str]
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ChoiceDecision:
    """The chosen option of a `select` and the scores that chose it."""

    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class TokenUsage:
    """Running prompt/completion token totals of one backend (all programs); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Mutates the totals."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens

    def reset(self) -> None:
        """Sets both totals to zero."""
        with self._lock:
            self.prompt_tokens = self.completion_tokens = 0


class Backend:
    """Base class of every backend; subclasses override what they support.

    Backends are shared by many states and threads: methods must not keep per-call state on self
    except behind a lock.
    """

    is_chat_model: bool = False
    chat_template: ChatTemplate = get_chat_template("default")

    def get_model_name(self) -> str:
        return type(self).__name__

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def flush_cache(self) -> Any:
        """Empties the server's prefix cache (servers only)."""
        raise ConstraintNotSupportedError(f"{type(self).__name__} has no server cache to flush")

    def get_server_info(self) -> Any:
        raise ConstraintNotSupportedError(f"{type(self).__name__} has no server info")

    @property
    def wants_prefix_hints(self) -> bool:
        """Whether prefix hints may help this backend (`LmdslConfig.prefix_hints="auto"` skips them
        otherwise). Default: yes (the default hint methods do nothing anyway)."""
        return True

    def cache_prefix(self, prefix_str: str) -> None:
        """Prefix hint: the backend may compute and cache `prefix_str`. Default: nothing."""

    def commit_lazy_operations(self, prompt: Prompt) -> None:
        """Called before a fork: a prefix hint for the committed prompt. Default: `cache_prefix`."""
        self.cache_prefix(prompt.text)

    def begin_program(self, prompt: Prompt) -> None:
        """Called once when a program starts. Default: nothing."""

    def end_program(self, prompts: list[Prompt]) -> None:
        """Called once when a program ends, with the final prompt of each state. Default: nothing."""

    def concatenate_and_append(self, parent: Prompt, children: list[Prompt]) -> None:
        """Called by `join("concate_and_append")` before the children's text is appended."""

    def generate(self, prompt: Prompt, params: SamplingParams) -> GenResult:
        raise NotImplementedError(f"{type(self).__name__} does not implement generate")

    def generate_stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yields (new text, meta info so far). Default: one chunk from `generate`."""
        result = self.generate(prompt, params)
        text = result.text if isinstance(result.text, str) else result.text[0]
        yield text, result.meta_info

    def select(self, prompt: Prompt, choices: list[str], temperature: float, choices_method: str) -> ChoiceDecision:
        raise ConstraintNotSupportedError(f"{type(self).__name__} does not support select")
