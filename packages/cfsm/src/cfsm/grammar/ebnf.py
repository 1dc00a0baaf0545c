"""GBNF (the EBNF dialect of llama.cpp and xgrammar, SGLang's `ebnf` parameter) to a `Grammar`.

    root   ::= "{" ws pair ("," ws pair)* "}"     # rules: name ::= alternatives
    pair   ::= [a-z]+ ":" ws ( num | root )        # references may recurse
    num    ::= "-"? [0-9]{1,5} ("." [0-9]+)?       # * + ? {m} {m,} {m,n} {,n}
    ws     ::= [ \\t\\n]*                           # classes: ranges, negation [^...], escapes

A rule ends where the next `name ::=` starts, so alternatives may continue on later lines.
Literals take double or single quotes and the escapes \\n \\r \\t \\\\ \\" \\' \\xHH \\uHHHH
\\UHHHHHHHH; `.` is any character; `#` starts a comment. Errors are `GrammarError`s naming
line and column.
"""

from __future__ import annotations

from cfsm.errors import GrammarError
from cfsm.grammar.rules import Grammar, RuleRef
from cfsm.regex.charset import MAX_CP, Ranges, negate, normalize
from cfsm.regex.syntax import EMPTY, Chars, Node, Repeat, alt, cat, lit

__all__ = ["parse_ebnf", "MAX_REPEAT"]

MAX_REPEAT = 10_000  # bound of {m,n} counts (the automaton grows with them)
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'", "[": "[", "]": "]", "-": "-",
            "/": "/", "0": "\0", "f": "\f", "v": "\v", "b": "\b", "a": "\a", "e": "\x1b", "^": "^", ".": "."}
_HEX_LEN = {"x": 2, "u": 4, "U": 8}
_ANY = Chars(((0, MAX_CP),))


def _is_name_char(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c in "_-")


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.refs: list[RuleRef] = []

    # --- positions and errors ------------------------------------------------------------------
    def where(self, pos: int) -> tuple[int, int]:
        line = self.text.count("\n", 0, pos) + 1
        col = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return line, col

    def error(self, message: str, pos: int | None = None) -> GrammarError:
        return GrammarError(message, *self.where(self.pos if pos is None else pos))

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_space(self) -> None:
        text, n = self.text, len(self.text)
        while self.pos < n:
            c = text[self.pos]
            if c in " \t\r\n":
                self.pos += 1
            elif c == "#":
                end = text.find("\n", self.pos)
                self.pos = n if end < 0 else end + 1
            else:
                return

    def name(self) -> str:
        start = self.pos
        while self.pos < len(self.text) and _is_name_char(self.text[self.pos]):
            self.pos += 1
        return self.text[start:self.pos]

    def at_rule_start(self) -> bool:
        """Whether `name ::=` starts here (the current rule's body ends)."""
        save = self.pos
        try:
            if not self.name():
                return False
            self.skip_space()
            return self.text.startswith("::=", self.pos)
        finally:
            self.pos = save

    # --- grammar ---------------------------------------------------------------------------------
    def grammar(self, root: str) -> Grammar:
        rules: dict[str, Node] = {}
        positions: dict[str, tuple[int, int]] = {}
        self.skip_space()
        while self.pos < len(self.text):
            start = self.pos
            name = self.name()
            if not name:
                raise self.error(f"expected a rule name, found {self.peek()!r}")
            self.skip_space()
            if not self.text.startswith("::=", self.pos):
                raise self.error(f"expected '::=' after rule name {name!r}")
            self.pos += 3
            if name in rules:
                line, col = positions[name]
                raise self.error(f"rule {name!r} is defined twice (first at line {line}, column {col})", start)
            positions[name] = self.where(start)
            rules[name] = self.alternatives(nested=False)
            self.skip_space()
        if not rules:
            raise GrammarError("the grammar defines no rule", 1, 1)
        for ref in self.refs:
            if ref.name not in rules:
                raise GrammarError(f"undefined rule {ref.name!r}", ref.line, ref.column)
        if root not in rules:
            raise GrammarError(f"the grammar has no {root!r} rule (the start rule)", 1, 1)
        return Grammar(rules=rules, root=root, positions=positions)

    def alternatives(self, nested: bool) -> Node:
        options = [self.sequence(nested)]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.sequence(nested))
        return options[0] if len(options) == 1 else alt(*options)

    def sequence(self, nested: bool) -> Node:
        items: list[Node] = []
        while True:
            self.skip_space()
            c = self.peek()
            if c in ("", "|") or (c == ")" and nested):
                break
            if c == ")":
                raise self.error("unbalanced ')'")
            if _is_name_char(c) and self.at_rule_start():
                if nested:
                    raise self.error("missing ')' before the next rule")
                break
            items.append(self.quantified(self.primary()))
        return cat(*items) if items else EMPTY

    def primary(self) -> Node:
        c = self.peek()
        start = self.pos
        if c in "\"'":
            return self.literal()
        if c == "[":
            return self.char_class()
        if c == ".":
            self.pos += 1
            return _ANY
        if c == "(":
            self.pos += 1
            body = self.alternatives(nested=True)
            self.skip_space()
            if self.peek() != ")":
                raise self.error("expected ')' to close the group opened", start)
            self.pos += 1
            return body
        if _is_name_char(c):
            name = self.name()
            ref = RuleRef(name, *self.where(start))
            self.refs.append(ref)
            return ref
        raise self.error(f"unexpected character {c!r}")

    def quantified(self, node: Node) -> Node:
        while True:
            c = self.peek()
            if c == "*":
                node = Repeat(node, 0, None)
            elif c == "+":
                node = Repeat(node, 1, None)
            elif c == "?":
                node = Repeat(node, 0, 1)
            elif c == "{":
                lo, hi = self.counts()
                node = Repeat(node, lo, hi)
                continue
            else:
                return node
            self.pos += 1

    def counts(self) -> tuple[int, int | None]:
        start = self.pos
        end = self.text.find("}", self.pos)
        if end < 0:
            raise self.error("unclosed '{' of a repetition count")
        body = self.text[self.pos + 1:end].replace(" ", "")
        parts = body.split(",")
        hi: int | None
        try:
            if len(parts) == 1:
                lo = hi = int(parts[0])
            elif len(parts) == 2:
                lo = int(parts[0]) if parts[0] else 0
                hi = int(parts[1]) if parts[1] else None
            else:
                raise ValueError(body)
        except ValueError:
            raise self.error(f"bad repetition count {{{body}}}: expected {{m}}, {{m,}}, {{m,n}} or {{,n}}", start) from None
        if lo < 0 or (hi is not None and hi < lo):
            raise self.error(f"bad repetition count {{{body}}}: need 0 <= m <= n", start)
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.error(f"repetition count {{{body}}} is larger than {MAX_REPEAT}", start)
        self.pos = end + 1
        return lo, hi

    def char(self, terminators: str) -> int:
        """One (possibly escaped) character of a literal or class, as a code point."""
        start = self.pos
        c = self.peek()
        if c == "":
            raise self.error(f"unterminated {'character class' if ']' in terminators else 'string literal'}")
        if c != "\\":
            self.pos += 1
            return ord(c)
        esc = self.text[self.pos + 1:self.pos + 2]
        if esc in _HEX_LEN:
            digits = self.text[self.pos + 2:self.pos + 2 + _HEX_LEN[esc]]
            try:
                if len(digits) != _HEX_LEN[esc]:
                    raise ValueError(digits)
                cp = int(digits, 16)
            except ValueError:
                raise self.error(f"bad escape \\{esc}{digits}: expected {_HEX_LEN[esc]} hex digits", start) from None
            if cp > MAX_CP:
                raise self.error(f"escape \\{esc}{digits} is past the last code point", start)
            self.pos += 2 + _HEX_LEN[esc]
            return cp
        if esc in _ESCAPES:
            self.pos += 2
            return ord(_ESCAPES[esc])
        raise self.error(f"unknown escape \\{esc}", start)

    def literal(self) -> Node:
        quote = self.peek()
        start = self.pos
        self.pos += 1
        chars: list[str] = []
        while True:
            if self.pos >= len(self.text):
                raise self.error("unterminated string literal", start)
            if self.peek() == quote:
                self.pos += 1
                return lit("".join(chars))
            if self.peek() == "\n":
                raise self.error("newline in a string literal (write \\n)")
            chars.append(chr(self.char(quote)))

    def char_class(self) -> Node:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        while True:
            if self.pos >= len(self.text):
                raise self.error("unterminated character class", start)
            if self.peek() == "]":
                self.pos += 1
                break
            range_at = self.pos
            lo = self.char("]")
            hi = lo
            if self.peek() == "-" and self.text[self.pos + 1:self.pos + 2] not in ("]", ""):
                self.pos += 1
                hi = self.char("]")
                if hi < lo:
                    raise self.error(f"bad range {chr(lo)!r}-{chr(hi)!r} in a character class", range_at)
            ranges.append((lo, hi))
        rs: Ranges = normalize(ranges)
        if negated:
            rs = negate(rs)
        if not rs:
            raise self.error("empty character class", start)
        return Chars(rs)


def parse_ebnf(text: str, root: str = "root") -> Grammar:
    """Parse GBNF `text` into a `Grammar` whose start rule is `root`. Pure.

    Raises `GrammarError` (with line and column) for malformed text, a rule defined twice, a
    reference to an undefined rule, or a missing start rule.
    """
    if not isinstance(text, str):
        raise GrammarError(f"the grammar must be a string, got {type(text).__name__}")
    return _Parser(text).grammar(root)
