"""Regex syntax tree over Unicode code points: the common form of regexes and JSON Schemas."""

from __future__ import annotations

from collections.abc import Sequence

from cfsm.regex.charset import Ranges

__all__ = ["Node", "Chars", "Cat", "Alt", "Repeat", "Shared", "Intersect", "Complement", "Scope", "Piece", "Sep", "NOTHING", "EMPTY",
           "cat", "alt", "lit"]


class Node:
    """Base class of syntax-tree nodes (immutable by convention)."""

    __slots__ = ()


class Chars(Node):
    """One code point out of `ranges` (sorted, disjoint, inclusive)."""

    __slots__ = ("ranges",)

    def __init__(self, ranges: Ranges) -> None:
        self.ranges = ranges

    def __repr__(self) -> str:
        return f"Chars({self.ranges!r})"


class Cat(Node):
    """Concatenation; `Cat(())` is the empty string."""

    __slots__ = ("items",)

    def __init__(self, items: Sequence[Node]) -> None:
        self.items = tuple(items)

    def __repr__(self) -> str:
        return f"Cat({list(self.items)!r})"


class Alt(Node):
    """Alternation; `Alt(())` matches nothing."""

    __slots__ = ("items",)

    def __init__(self, items: Sequence[Node]) -> None:
        self.items = tuple(items)

    def __repr__(self) -> str:
        return f"Alt({list(self.items)!r})"


class Repeat(Node):
    """`item` repeated between `lo` and `hi` times (`hi=None`: unbounded)."""

    __slots__ = ("item", "lo", "hi")

    def __init__(self, item: Node, lo: int, hi: int | None) -> None:
        self.item = item
        self.lo = lo
        self.hi = hi

    def __repr__(self) -> str:
        return f"Repeat({self.item!r}, {self.lo}, {self.hi})"


class Shared(Node):
    """A sub-automaton built once and entered from several places.

    # NOTE: only valid where every reference is in tail position of the same enclosing node
    # (whatever follows one reference follows all of them). The JSON Schema compiler uses it for
    # "remaining properties" suffixes, which all end at the closing brace.
    """

    __slots__ = ("item",)

    def __init__(self, item: Node) -> None:
        self.item = item


class Intersect(Node):
    """Strings matched by every item (built as a product of DFAs)."""

    __slots__ = ("items",)

    def __init__(self, items: Sequence[Node]) -> None:
        self.items = tuple(items)


class Complement(Node):
    """Byte strings (any bytes, not only UTF-8) that `item` does not match; intersect it."""

    __slots__ = ("item",)

    def __init__(self, item: Node) -> None:
        self.item = item


class Scope(Node):
    """Fresh copies of the `Shared` nodes inside `item` each time `item` is built."""

    __slots__ = ("item",)

    def __init__(self, item: Node) -> None:
        self.item = item


class Piece(Scope):
    """A standard value tree (number, boolean, a format) kept whole inside a larger tree: `cat`
    does not flatten it, so the direct construction copies its block, prepared once per process.
    Same language as `item`."""

    __slots__ = ()


class Sep(Node):
    """`item (sep item)*` built with a single copy of `item` (a loop through `sep`)."""

    __slots__ = ("item", "sep")

    def __init__(self, item: Node, sep: Node) -> None:
        self.item = item
        self.sep = sep


EMPTY = Cat(())
NOTHING = Alt(())


def cat(*items: Node) -> Node:
    flat: list[Node] = []
    for it in items:
        if isinstance(it, Cat):
            flat.extend(it.items)
        else:
            flat.append(it)
    return flat[0] if len(flat) == 1 else Cat(flat)


def alt(*items: Node) -> Node:
    flat: list[Node] = []
    for it in items:
        if isinstance(it, Alt):
            flat.extend(it.items)
        else:
            flat.append(it)
    return flat[0] if len(flat) == 1 else Alt(flat)


# one immutable node per literal character (keys and literals repeat the same few)
# NOTE: pure memoization of immutable inputs, bounded (4096 characters)
_LIT_CHARS: dict[str, Chars] = {}


def _lit_char(c: str) -> Chars:
    node = _LIT_CHARS.get(c)
    if node is None:
        node = Chars(((ord(c), ord(c)),))
        if len(_LIT_CHARS) < 4096:
            _LIT_CHARS[c] = node
    return node


def lit(text: str) -> Node:
    """The literal string `text`."""
    if not text:
        return EMPTY
    if len(text) == 1:
        return _lit_char(text)
    get = _LIT_CHARS.get
    return Cat([get(c) or _lit_char(c) for c in text])
