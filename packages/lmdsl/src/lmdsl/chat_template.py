"""Chat templates: how roles render into prompt text, chosen from the model name a backend reports."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from lmdsl.errors import ChatTemplateError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    """Role prefixes and suffixes of one model family.

    role_prefix_and_suffix: role -> (text before the message, text after it).
    default_system_prompt: inserted as a system message when a program's first role is not
        `system` (None: nothing is inserted).
    stop_str: strings that end an assistant turn (backends add them to a chat `gen`'s stops).
    image_token: text standing for one image in the prompt.
    """

    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    image_token: str = "<image>"
    bos: str = field(default="")

    def prefix(self, role: str) -> str:
        return self._pair(role)[0]

    def suffix(self, role: str) -> str:
        return self._pair(role)[1]

    def _pair(self, role: str) -> tuple[str, str]:
        try:
            return self.role_prefix_and_suffix[role]
        except KeyError:
            raise ChatTemplateError(
                f"chat template {self.name!r} has no role {role!r}; roles: {sorted(self.role_prefix_and_suffix)}"
            ) from None

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of `messages` ({"role", "content"} dicts), without a trailing turn."""
        out = self.bos
        if messages and messages[0]["role"] != "system" and self.default_system_prompt is not None:
            out += self.prefix("system") + self.default_system_prompt + self.suffix("system")
        for m in messages:
            out += self.prefix(m["role"]) + m["content"] + self.suffix(m["role"])
        return out


_TEMPLATES: dict[str, ChatTemplate] = {}
# (name pattern, template name): the first pattern found in the lower-cased model path wins.
_MATCHERS: list[tuple[Callable[[str], bool], str]] = []


def register_chat_template(template: ChatTemplate, *patterns: str) -> None:
    """Adds `template` to the registry; `patterns` are regexes searched in lower-cased model paths.

    Mutates the module registry (registration happens at import time, or once in user setup).
    """
    _TEMPLATES[template.name] = template
    for pattern in patterns:
        _MATCHERS.append((re.compile(pattern).search, template.name))  # type: ignore[arg-type]


def get_chat_template(name: str) -> ChatTemplate:
    """The template registered as `name` (ChatTemplateError listing the names otherwise)."""
    try:
        return _TEMPLATES[name]
    except KeyError:
        raise ChatTemplateError(f"unknown chat template {name!r}; known: {sorted(_TEMPLATES)}") from None


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    """The template for a model name or folder path ("default" when no pattern matches)."""
    lowered = model_path.lower()
    for match, name in _MATCHERS:
        if match(lowered):
            return _TEMPLATES[name]
    return _TEMPLATES["default"]


register_chat_template(ChatTemplate(
    "default",
    {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
))
register_chat_template(ChatTemplate(
    "chatml",
    {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES},
    stop_str=("<|im_end|>",),
    image_token="<image>",
), r"smollm", r"chatml", r"(^|[/_-])yi-")
register_chat_template(ChatTemplate(
    "qwen",
    {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES},
    default_system_prompt="You are a helpful assistant.",
    stop_str=("<|im_end|>",),
    image_token="<|vision_start|><|image_pad|><|vision_end|>",
), r"qwen")
register_chat_template(ChatTemplate(
    "llama-3-instruct",
    {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ROLES},
    stop_str=("<|eot_id|>",),
    image_token="<|image|>",
), r"llama[-_ ]?3", r"meta-llama-3")
register_chat_template(ChatTemplate(
    "mistral",
    {"system": ("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"), "user": ("[INST] ", " [/INST]"),
     "assistant": ("", " </s><s>")},
    stop_str=("</s>",),
    image_token="[IMG]",
), r"mistral", r"mixtral")
register_chat_template(ChatTemplate(
    "llama-2-chat",
    {"system": ("<<SYS>>\n", "\n<</SYS>>\n\n"), "user": ("[INST] ", " [/INST]"), "assistant": ("", " </s><s>")},
    stop_str=("</s>",),
), r"llama[-_ ]?2.*chat")
