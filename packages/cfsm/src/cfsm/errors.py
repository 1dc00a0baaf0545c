"""Typed exceptions raised at cfsm's public boundary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CfsmError",
    "PushdownTooLargeError",
    "UnsupportedRegexError",
    "UnsupportedSchemaError",
    "SchemaTooLargeError",
    "RejectedTokenError",
    "VocabularyError",
    "GrammarTooLargeError",
    "GrammarError",
    "Approximation",
]


class CfsmError(Exception):
    """Base class of every error cfsm raises on purpose."""


class UnsupportedRegexError(CfsmError, ValueError):
    """A regex uses a construct outside the supported (regular) subset, or is malformed.

    Attributes: `construct` (what was found), `position` (0-based offset in `pattern`), `pattern`.
    """

    def __init__(self, construct: str, position: int, pattern: str, hint: str = "") -> None:
        self.construct = construct
        self.position = position
        self.pattern = pattern
        msg = f"unsupported regex construct {construct} at position {position} in {pattern!r}"
        if hint:
            msg += f": {hint}"
        super().__init__(msg)


class UnsupportedSchemaError(CfsmError, ValueError):
    """A JSON Schema is malformed, refers outside itself, or (with `CfsmConfig(strict=True)`)
    uses a keyword cfsm can only over-approximate.

    Attributes: `keyword`, `path` (JSON pointer of the schema node, e.g. `#/properties/a`).
    """

    def __init__(self, keyword: str, path: str, hint: str = "") -> None:
        self.keyword = keyword
        self.path = path
        msg = f"unsupported JSON Schema keyword {keyword!r} at {path}"
        if hint:
            msg += f": {hint}"
        super().__init__(msg)


@dataclass(frozen=True)
class Approximation:
    """A schema keyword the grammar cannot compile exactly. `kind` "superset": the grammar
    over-approximates it (every valid document is accepted, some invalid ones are too:
    `uniqueItems` over unbounded arrays, `not` over complex schemas, ...); "subset" (with
    `CfsmConfig.narrow`, the default): it narrows it (every accepted document is valid, some
    valid ones are not accepted).

    `keyword`, `path` (JSON pointer of the keyword), `detail` (what the grammar does instead).
    With `CfsmConfig(strict=True)` it raises `UnsupportedSchemaError` instead.
    """

    keyword: str
    path: str
    detail: str
    kind: Literal["superset", "subset"] = "superset"

    def __str__(self) -> str:
        narrowed = "narrowed: " if self.kind == "subset" else ""
        return f"{self.keyword} at {self.path}: {narrowed}{self.detail}"


class SchemaTooLargeError(UnsupportedSchemaError):
    """A JSON Schema has more nodes to compile than `CfsmLimits.max_schema_visits` (its
    references, copied where they are used, multiply)."""


class RejectedTokenError(CfsmError, ValueError):
    """`Guide.advance` got a token the grammar does not allow in the current state."""

    def __init__(self, token_id: int, state: int, detail: str = "") -> None:
        self.token_id = token_id
        self.state = state
        msg = f"token {token_id} is not allowed in state {state}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class VocabularyError(CfsmError, ValueError):
    """A vocabulary is malformed (bad ids, no EOS, size mismatch)."""


class GrammarTooLargeError(CfsmError, ValueError):
    """The grammar's automaton exceeds the state limit (`CfsmLimits.max_dfa_states`)."""


class PushdownTooLargeError(CfsmError, ValueError):
    """A pushdown matcher would walk the vocabulary from more rule positions than the caller's
    limit (`CfsmConfig.max_pushdown_positions` for JSON Schemas): each costs a vocabulary walk."""

    def __init__(self, positions: int, limit: int) -> None:
        super().__init__(f"the pushdown matcher has {positions} rule positions (limit {limit})")
        self.positions = positions
        self.limit = limit


class GrammarError(CfsmError, ValueError):
    """An EBNF grammar is malformed or cannot be compiled (undefined rule, left recursion, empty
    language). `line` and `column` (1-based, 0 when unknown) locate the problem in the text."""

    def __init__(self, message: str, line: int = 0, column: int = 0) -> None:
        self.detail = message
        self.line = line
        self.column = column
        where = f"line {line}, column {column}: " if line else ""
        super().__init__(f"{where}{message}")
