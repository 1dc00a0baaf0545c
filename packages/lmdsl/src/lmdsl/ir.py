"""The frozen intermediate representation: sampling parameters and the primitive nodes.

Every primitive (`gen`, `select`, `image`, roles, constant text) is a frozen dataclass. A
program is a sequence of these nodes; the interpreter walks them in order per state, and the
tracer records them into a `Graph`. `+` between nodes and strings builds an `Expr`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lmdsl.errors import TraceError

REGEX_INT = r"[-+]?[0-9]+"
REGEX_FLOAT = r"[-+]?[0-9]+\.[0-9]+"
REGEX_STR = r"\"[^\"\\\n]*\""
REGEX_BOOL = r"(True|False)"


def _as_tuple(value: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, int)):
        return (value,)
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one `gen`; `None` means "not set here" (see `merge`).

    Names and meanings follow SGLang's `SamplingParams` and the native `/generate` contract.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_regex: tuple[str, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: Any = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    @staticmethod
    def build(**kw: Any) -> SamplingParams:
        """Normalizes user values: stop strings to tuples, a dict schema to a JSON string."""
        kw["stop"] = _as_tuple(kw.get("stop"))
        kw["stop_token_ids"] = _as_tuple(kw.get("stop_token_ids"))
        kw["stop_regex"] = _as_tuple(kw.get("stop_regex"))
        schema = kw.get("json_schema")
        if schema is not None and not isinstance(schema, str):
            kw["json_schema"] = json.dumps(schema)
        return SamplingParams(**kw)

    def merge(self, override: SamplingParams) -> SamplingParams:
        """A new object: the fields `override` sets replace this object's (neither is mutated)."""
        changes = {f.name: getattr(override, f.name) for f in fields(override)}
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def constraint_regex(self) -> str | None:
        """The regex a backend must enforce: `regex`, or the one `dtype` stands for."""
        if self.regex is not None:
            return self.regex
        if self.dtype in (int, "int"):
            return REGEX_INT
        if self.dtype in (float, "float"):
            return REGEX_FLOAT
        if self.dtype in (str, "str"):
            return REGEX_STR
        if self.dtype in (bool, "bool"):
            return REGEX_BOOL
        if self.dtype is not None:
            raise ValueError(f"gen(dtype={self.dtype!r}): supported dtypes are int, float, str, bool")
        return None

    def to_native(self) -> dict[str, Any]:
        """The `sampling_params` object of the native `/generate` request (unset fields left out)."""
        out: dict[str, Any] = {}
        for name in ("max_new_tokens", "min_new_tokens", "n", "temperature", "top_p", "top_k", "min_p",
                     "frequency_penalty", "presence_penalty", "ignore_eos", "json_schema", "ebnf"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop_regex:
            out["stop_regex"] = list(self.stop_regex) if len(self.stop_regex) > 1 else self.stop_regex[0]
        regex = self.constraint_regex()
        if regex is not None:
            out["regex"] = regex
        return out


DEFAULT_SAMPLING = SamplingParams(
    max_new_tokens=128, min_new_tokens=0, n=1, stop=(), stop_token_ids=(), temperature=1.0, top_p=1.0,
    top_k=-1, min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0, ignore_eos=False,
)


class Node:
    """Base of every IR node; `a + b` concatenates into an `Expr`."""

    def __add__(self, other: Any) -> Expr:
        return Expr((*flatten(self), *flatten(to_node(other))))

    def __radd__(self, other: Any) -> Expr:
        return Expr((*flatten(to_node(other)), *flatten(self)))

    def describe(self) -> str:
        """One line for graph printing."""
        return repr(self)


@dataclass(frozen=True, repr=False)
class Constant(Node):
    text: str

    def describe(self) -> str:
        return f"const {self.text!r}"

    def __repr__(self) -> str:
        return f"Constant({self.text!r})"


@dataclass(frozen=True)
class Gen(Node):
    name: str | None
    params: SamplingParams = field(default_factory=SamplingParams)

    def describe(self) -> str:
        set_fields = {f.name: getattr(self.params, f.name) for f in fields(self.params)}
        shown = ", ".join(f"{k}={v!r}" for k, v in set_fields.items() if v is not None)
        return f"gen {self.name!r}" + (f" ({shown})" if shown else "")


@dataclass(frozen=True)
class Select(Node):
    name: str | None
    choices: tuple[str, ...]
    temperature: float = 0.0
    choices_method: str | None = None

    def describe(self) -> str:
        return f"select {self.name!r} from {list(self.choices)!r}"


@dataclass(frozen=True)
class Image(Node):
    path: Any  # str, or an ArgRef while tracing

    def describe(self) -> str:
        return f"image {self.path.describe() if isinstance(self.path, Node) else repr(self.path)}"


@dataclass(frozen=True)
class Video(Node):
    path: Any  # str, or an ArgRef while tracing
    num_frames: int

    def describe(self) -> str:
        shown = self.path.describe() if isinstance(self.path, Node) else repr(self.path)
        return f"video {shown} frames={self.num_frames}"


@dataclass(frozen=True)
class RoleBegin(Node):
    role: str

    def describe(self) -> str:
        return f"<{self.role}>"


@dataclass(frozen=True)
class RoleEnd(Node):
    role: str

    def describe(self) -> str:
        return f"</{self.role}>"


@dataclass(frozen=True)
class VarScopeBegin(Node):
    name: str

    def describe(self) -> str:
        return f"var_scope {self.name!r} begin"


@dataclass(frozen=True)
class VarScopeEnd(Node):
    name: str

    def describe(self) -> str:
        return f"var_scope {self.name!r} end"


@dataclass(frozen=True)
class CommitLazy(Node):
    """Sends the committed text to the backend as a prefix hint (before a fork)."""

    def describe(self) -> str:
        return "prefix hint"


@dataclass(frozen=True, eq=False)
class _Placeholder(Node):
    """A value only known at run time; printing or branching on it while tracing is an error."""

    def _misuse(self, what: str) -> TraceError:
        return TraceError(
            f"{self.describe()} is a traced placeholder; {what} cannot read its value while tracing. "
            "Concatenate it instead (s += 'text ' + x), or run the program without trace()/compile()."
        )

    def __str__(self) -> str:
        raise self._misuse("str() and f-strings")

    def __format__(self, spec: str) -> str:
        raise self._misuse("str() and f-strings")

    def __bool__(self) -> bool:
        raise self._misuse("if/while and boolean tests")

    def __eq__(self, other: object) -> bool:
        raise self._misuse("comparisons")

    def __hash__(self) -> int:
        return id(self)

    def __iter__(self) -> Iterator[Any]:
        raise self._misuse("iteration")

    def __len__(self) -> int:
        raise self._misuse("len()")


@dataclass(frozen=True, eq=False)
class ArgRef(_Placeholder):
    """A program argument while tracing."""

    name: str

    def describe(self) -> str:
        return f"arg {self.name!r}"

    def __repr__(self) -> str:
        return f"ArgRef({self.name!r})"


@dataclass(frozen=True, eq=False)
class VarRef(_Placeholder):
    """A variable of a traced state (`s["x"]`, `forks[i]["x"]`); `state` is its path, e.g. "s.fork0[1]"."""

    state: str
    name: str

    def describe(self) -> str:
        return f"var {self.state}[{self.name!r}]"

    def __repr__(self) -> str:
        return f"VarRef({self.state!r}, {self.name!r})"


@dataclass(frozen=True, repr=False)
class Expr(Node):
    """A concatenation of nodes, flattened."""

    parts: tuple[Node, ...]

    def describe(self) -> str:
        return " + ".join(p.describe() for p in self.parts)

    def __repr__(self) -> str:
        return f"Expr({list(self.parts)!r})"


NodeLike = Node | str | int | float


def to_node(value: Any) -> Node:
    """str and numbers become `Constant`; nodes pass through; anything else is a TypeError."""
    if isinstance(value, Node):
        return value
    if isinstance(value, str):
        return Constant(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Constant(str(value))
    raise TypeError(
        f"cannot add a {type(value).__name__} to a program: use a str, a number or an lmdsl primitive "
        "(gen, select, image, ...)"
    )


def flatten(node: Node) -> tuple[Node, ...]:
    """The atomic nodes of `node`, in order (an `Expr` is expanded; empty constants dropped)."""
    if isinstance(node, Expr):
        return tuple(p for part in node.parts for p in flatten(part))
    if isinstance(node, Constant) and node.text == "":
        return ()
    return (node,)
