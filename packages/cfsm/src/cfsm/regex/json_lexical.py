"""The JSON lexical trees: a JSON string's characters and strings (`JSON_CHAR`, `JSON_STRING`) and
`json_escape` (a tree over decoded characters to the tree of their JSON string spellings). Shared by
the JSON Schema frontend, the direct DFA construction and the vocabulary's string tables; one
immutable tree each per process."""

from __future__ import annotations

from cfsm.regex.charset import negate
from cfsm.regex.syntax import NOTHING, Alt, Cat, Chars, Intersect, Node, Repeat, alt, cat, lit

__all__ = ["JSON_CHAR", "JSON_STRING", "SHORT_ESCAPES", "escape_code_point", "json_escape"]

_SPECIAL = ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_HEX = Chars(((48, 57), (65, 70), (97, 102)))
_PLAIN = Chars(negate(_SPECIAL))
# NOTE: `\\uXXXX` escapes are limited to control characters (`\\u0000`-`\\u001F`): other characters
# are written as themselves (UTF-8). General `\\u` escapes would add four hex states per character
# position, which multiplies the index size of every length-bounded string.
JSON_CHAR = alt(_PLAIN, cat(lit("\\"), Chars(((0x22, 0x22), (0x2F, 0x2F), (0x5C, 0x5C), (0x62, 0x62), (0x66, 0x66),
                                              (0x6E, 0x6E), (0x72, 0x72), (0x74, 0x74)))),
                cat(lit("\\u00"), Chars(((0x30, 0x31),)), _HEX))
JSON_STRING = cat(lit('"'), Repeat(JSON_CHAR, 0, None), lit('"'))

SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}


def escape_code_point(cp: int) -> Node:
    if cp in SHORT_ESCAPES:
        return lit(SHORT_ESCAPES[cp])
    hi, lo = f"{cp:04x}"[2], f"{cp:04x}"[3]
    return cat(lit("\\u00" + hi), Chars(tuple(sorted({(ord(lo), ord(lo)), (ord(lo.upper()), ord(lo.upper()))}))))


def json_escape(node: Node) -> Node:
    """Map a tree over decoded characters to the tree of their JSON string encodings."""
    if isinstance(node, Chars):
        plain: list[tuple[int, int]] = []
        specials: list[int] = []
        for lo, hi in node.ranges:
            cur = lo
            for slo, shi in _SPECIAL:
                if shi < cur or slo > hi:
                    continue
                if slo > cur:
                    plain.append((cur, slo - 1))
                specials.extend(range(max(cur, slo), min(hi, shi) + 1))
                cur = shi + 1
            if cur <= hi:
                plain.append((cur, hi))
        parts: list[Node] = [Chars(tuple(plain))] if plain else []
        parts += [escape_code_point(c) for c in specials]
        return alt(*parts) if parts else NOTHING
    if isinstance(node, Cat):
        return Cat([json_escape(x) for x in node.items])
    if isinstance(node, Alt):
        return Alt([json_escape(x) for x in node.items])
    if isinstance(node, Repeat):
        return Repeat(json_escape(node.item), node.lo, node.hi)
    if isinstance(node, Intersect):
        return Intersect([json_escape(x) for x in node.items])
    raise TypeError(f"cannot JSON-escape {type(node).__name__}")
