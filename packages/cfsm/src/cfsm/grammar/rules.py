"""A context-free grammar as named rules over cfsm's syntax trees, plus the `RuleRef` leaf.

Rule bodies are `cfsm.regex.syntax` trees (characters, concatenation, alternation, repetition)
whose `RuleRef` leaves call other rules; every frontend (GBNF, JSON Schema) produces this form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cfsm.regex.syntax import Alt, Cat, Node, Repeat, Scope, Sep, Shared

__all__ = ["Grammar", "RuleRef", "has_refs"]


class RuleRef(Node):
    """A call of rule `name`; `line` / `column` locate it in the source (0: generated)."""

    __slots__ = ("name", "line", "column")

    def __init__(self, name: str, line: int = 0, column: int = 0) -> None:
        self.name = name
        self.line = line
        self.column = column

    def __repr__(self) -> str:
        return f"RuleRef({self.name!r})"


@dataclass(frozen=True)
class Grammar:
    """Rules by name (bodies may call each other, recursion included) and the start rule.

    `positions[name]` is the (line, column) where the rule is defined (for error messages).
    """

    rules: dict[str, Node]
    root: str = "root"
    positions: dict[str, tuple[int, int]] = field(default_factory=dict)


def has_refs(node: Node, memo: dict[int, bool]) -> bool:
    """Whether `node` contains a `RuleRef` (memoized by node identity in `memo`). Pure."""
    key = id(node)
    hit = memo.get(key)
    if hit is not None:
        return hit
    if isinstance(node, RuleRef):
        out = True
    elif isinstance(node, Cat | Alt):
        out = any(has_refs(x, memo) for x in node.items)
    elif isinstance(node, Repeat | Scope | Shared):
        out = has_refs(node.item, memo)
    elif isinstance(node, Sep):
        out = has_refs(node.item, memo) or has_refs(node.sep, memo)
    else:
        # Chars, Intersect / Complement (refs inside them are refused by the builder), DfaNode
        items: tuple[Node, ...] = getattr(node, "items", None) or ()
        out = any(has_refs(x, memo) for x in items)
    memo[key] = out
    return out
