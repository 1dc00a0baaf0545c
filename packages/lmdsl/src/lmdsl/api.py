"""The primitives of the language (same names and meanings as SGLang's frontend).

Each call builds a frozen IR node; nothing runs until the node is added to a state (`s += ...`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmdsl import choices as _choices
from lmdsl.config import SELECT_METHODS
from lmdsl.ir import Expr, Gen, Image, Node, RoleBegin, RoleEnd, SamplingParams, Select, Video, to_node


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: Any = None,
    choices: list[str] | None = None,
    choices_method: Any = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    ebnf: str | None = None,
) -> Node:
    """A generation; its text is appended to the prompt and stored as variable `name`.

    Unset parameters fall back to the `run(...)` sampling arguments, then to the defaults
    (max_tokens=128, temperature=1.0). `choices=` makes it a `select`. At most one of `regex`,
    `json_schema`, `ebnf` (a GBNF grammar, start rule `root`), `dtype` constrains the output.
    """
    if choices is not None:
        return select(name, choices, temperature=0.0 if temperature is None else temperature,
                      choices_method=choices_method)
    if sum(x is not None for x in (regex, json_schema, ebnf, dtype)) > 1:
        raise ValueError(f"gen({name!r}): give at most one of regex, json_schema, ebnf, dtype")
    params = SamplingParams.build(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex, json_schema=json_schema,
        ebnf=ebnf,
    )
    params.constraint_regex()  # validates dtype now, at the call site
    return Gen(name, params)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kw: Any) -> Node:
    """`gen(..., dtype=int)`: an integer, constrained by a regex."""
    return gen(name, max_tokens, dtype=int, **kw)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kw: Any) -> Node:
    """`gen(..., dtype=str)`: a double-quoted string, constrained by a regex."""
    return gen(name, max_tokens, dtype=str, **kw)


def _method_name(method: Any) -> str | None:
    if method is None or isinstance(method, str):
        if method is not None and method not in SELECT_METHODS:
            raise ValueError(f"unknown choices_method {method!r}; use one of {SELECT_METHODS}")
        return method
    name = getattr(method, "__name__", None)
    if name in SELECT_METHODS:
        return name
    raise ValueError(f"choices_method must be one of {SELECT_METHODS} (or lmdsl.{SELECT_METHODS[0]} ...)")


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: str | Callable[..., Any] | None = None,
) -> Node:
    """Picks one of `choices` by the backend's logprobs; the choice is appended and stored as `name`.

    choices_method: "token_length_normalized" (default), "greedy_token_selection" or
    "unconditional_likelihood_normalized" (or the functions of the same names).
    """
    if not choices:
        raise ValueError(f"select({name!r}): choices must be a non-empty list of strings")
    if not all(isinstance(c, str) for c in choices):
        raise TypeError(f"select({name!r}): every choice must be a str")
    return Select(name, tuple(choices), temperature, _method_name(choices_method))


def image(path: str) -> Node:
    """An image (file path, URL or base64) at this point of the prompt."""
    return Image(path if isinstance(path, Node) else str(path))


def video(path: str, num_frames: int) -> Node:
    """A video sampled to `num_frames` frames at this point of the prompt."""
    if num_frames < 1:
        raise ValueError("video(num_frames=...) must be >= 1")
    return Video(path if isinstance(path, Node) else str(path), num_frames)


def _role(role: str, expr: Any) -> Node:
    if expr is None:
        return Expr((RoleBegin(role), RoleEnd(role)))
    return RoleBegin(role) + to_node(expr) + RoleEnd(role)


def system(expr: Any = None) -> Node:
    return _role("system", expr)


def user(expr: Any = None) -> Node:
    return _role("user", expr)


def assistant(expr: Any = None) -> Node:
    return _role("assistant", expr)


def system_begin() -> Node:
    return RoleBegin("system")


def system_end() -> Node:
    return RoleEnd("system")


def user_begin() -> Node:
    return RoleBegin("user")


def user_end() -> Node:
    return RoleEnd("user")


def assistant_begin() -> Node:
    return RoleBegin("assistant")


def assistant_end() -> Node:
    return RoleEnd("assistant")


token_length_normalized = _choices.token_length_normalized
greedy_token_selection = _choices.greedy_token_selection
unconditional_likelihood_normalized = _choices.unconditional_likelihood_normalized
