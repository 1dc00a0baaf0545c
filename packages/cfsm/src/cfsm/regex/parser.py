"""Parse a regular expression (the `regex` module's syntax, regular subset) into a syntax tree.

Supported: literals, escapes, classes with ranges and negation, ``\\d \\w \\s \\D \\W \\S .``,
``\\p{..}`` / ``\\P{..}``, POSIX ``[[:name:]]``, groups (capturing, non-capturing, named, branch
reset), alternation, ``* + ? {m} {m,} {,n} {m,n}`` and their lazy forms, inline flags ``i s m x
a u`` (global or scoped), ``^``/``\\A`` and ``$``/``\\Z`` as assertions (start / end of the input, anywhere in a top-level
branch, at the ends inside groups). Everything
else raises `UnsupportedRegexError` with the construct and its position.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, replace

import regex

from cfsm.errors import UnsupportedRegexError
from cfsm.regex.charset import MAX_CP, Ranges, case_close, class_ranges, negate, normalize, union
from cfsm.regex.syntax import EMPTY, NOTHING, Alt, Cat, Chars, Node, Repeat, alt, cat

__all__ = ["ANY_TEXT", "parse_regex", "search_branches"]

_SIMPLE_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7, "e": 27}
_CLASS_ESCAPES = {"d": r"\d", "w": r"\w", "s": r"\s", "D": r"\d", "W": r"\w", "S": r"\s"}
# a counted repeat `{m}`, `{m,}`, `{,n}`, `{m,n}` (spaces allowed, as `regex` takes them)
_QUANTIFIER = regex.compile(r"\{\s*(\d*)\s*(,\s*(\d*)\s*)?\}")
_ASCII_CLASSES = {
    "d": ((48, 57),),
    "w": ((48, 57), (65, 90), (95, 95), (97, 122)),
    "s": ((9, 13), (32, 32)),
}


@dataclass(frozen=True)
class _Flags:
    ignorecase: bool = False
    dotall: bool = False
    verbose: bool = False
    ascii: bool = False
    multiline: bool = False


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0
        self.nested_anchor: int | None = None
        self.seq_anchored = False
        self.starts = 0  # `^` anchors read so far

    # ---- helpers -------------------------------------------------------------------------
    def error(self, construct: str, pos: int | None = None, hint: str = "") -> UnsupportedRegexError:
        return UnsupportedRegexError(construct, self.i if pos is None else pos, self.p, hint)

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.p[j] if j < len(self.p) else ""

    def startswith(self, s: str) -> bool:
        return self.p.startswith(s, self.i)

    def skip_verbose(self, flags: _Flags) -> None:
        if not flags.verbose:
            return
        while self.i < len(self.p):
            c = self.p[self.i]
            if c.isspace():
                self.i += 1
            elif c == "#":
                while self.i < len(self.p) and self.p[self.i] != "\n":
                    self.i += 1
            else:
                break

    # ---- grammar ---------------------------------------------------------------------------
    def parse(self) -> Node:
        flags = _Flags()
        node, _ = self.parse_alt(flags, at_start=True, depth=0)
        if self.i < len(self.p):
            raise self.error("')' without a matching '('")
        return node

    def parse_alt(self, flags: _Flags, at_start: bool, depth: int) -> tuple[Node, int]:
        """Returns (node, ended): `_ENDS_ALL` where a `$` closed every branch, `_ENDS_SOME` where it
        closed some, `_ENDS_NONE` where none."""
        branches = []
        ends = set()
        while True:
            node, ended, flags = self.parse_seq(flags, at_start, depth)
            branches.append(node)
            ends.add(ended)
            if self.peek() == "|":
                self.i += 1
                continue
            break
        ended = ends.pop() if len(ends) == 1 else _ENDS_SOME
        return (alt(*branches) if len(branches) > 1 else branches[0]), ended

    def parse_seq(self, flags: _Flags, at_start: bool, depth: int) -> tuple[Node, int, _Flags]:
        items: list[Node] = []
        ended = _ENDS_NONE
        start = at_start
        while True:
            self.skip_verbose(flags)
            c = self.peek()
            if c == "" or c == "|" or c == ")":
                return cat(*items) if items else EMPTY, ended, flags
            pos = self.i
            if flags.multiline and c in "^$":
                raise self.error(f"'{c}' under the multiline flag", pos, "line anchors are not supported")
            escaped = c == "\\"
            if c == "^" or escaped and self.startswith("\\A"):
                self.i += 1 if c == "^" else 2
                self.starts += 1
                if not start:
                    if depth:
                        raise self.error("'^' (anchor not at the start)", pos, "anchors are only supported at the ends")
                    # NOTE: an assertion (ECMA and `regex`, no multiline): what comes before it in
                    # this branch can only have matched the empty string, or the branch matches nothing
                    items = [] if all(_nullable(it) for it in items) else [NOTHING]
                self.seq_anchored = True
                if depth and self.nested_anchor is None:
                    self.nested_anchor = pos
                continue
            if c == "$" or escaped and (self.startswith("\\Z") or self.startswith("\\z")):
                self.i += 1 if c == "$" else 2
                ended = _ENDS_ALL
                if depth and self.nested_anchor is None:
                    self.nested_anchor = pos
                continue
            if c == "(" and self.startswith("(?") and self._is_flag_group():
                flags = self.parse_global_flags(flags)
                continue
            starts = self.starts
            atom, atom_ended = self.parse_atom(flags, start, depth)
            quantified = self.parse_quantifiers(atom, flags)
            if self.starts != starts and quantified is not atom and (
                    not isinstance(quantified, Repeat) or quantified.hi is None or quantified.hi > 1):
                raise self.error("'^' (anchor inside a repeated group)", pos, "anchors are only supported at the ends")
            if atom_ended and quantified is not atom:
                if not isinstance(quantified, Repeat) or quantified.hi is None or quantified.hi > 1:
                    raise self.error("'$' (anchor inside a repeated group)", pos, "anchors are only supported at the ends")
                if quantified.lo == 0:
                    atom_ended = _ENDS_SOME  # the group may be skipped
            atom = quantified
            if ended == _ENDS_SOME or ended == _ENDS_ALL and depth:
                raise self.error("'$' (anchor not at the end)", pos, "anchors are only supported at the ends")
            if ended == _ENDS_ALL:
                # NOTE: `$` is an assertion (end of input): what follows it in this branch can only
                # match the empty string, or the branch matches nothing
                atom = EMPTY if _nullable(atom) else NOTHING
            else:
                ended = atom_ended
            items.append(atom)
            start = False

    def _is_flag_group(self) -> bool:
        j = self.i + 2
        while j < len(self.p) and self.p[j] in "imsxauL-":
            j += 1
        return j > self.i + 2 and j < len(self.p) and self.p[j] == ")"

    def parse_global_flags(self, flags: _Flags) -> _Flags:
        self.i += 2
        flags, _ = self._read_flags(flags)
        self.i += 1  # ')'
        return flags

    def _read_flags(self, flags: _Flags) -> tuple[_Flags, bool]:
        on = True
        while self.peek() and self.peek() in "imsxauL-":
            c = self.peek()
            pos = self.i
            self.i += 1
            if c == "-":
                on = False
            elif c == "i":
                flags = replace(flags, ignorecase=on)
            elif c == "s":
                flags = replace(flags, dotall=on)
            elif c == "x":
                flags = replace(flags, verbose=on)
            elif c == "a":
                flags = replace(flags, ascii=on)
            elif c == "m":
                flags = replace(flags, multiline=on)
            elif c == "L":
                raise self.error("flag 'L' (locale)", pos)
        return flags, on

    def parse_atom(self, flags: _Flags, at_start: bool, depth: int) -> tuple[Node, int]:
        c = self.peek()
        pos = self.i
        if c == "(":
            return self.parse_group(flags, at_start, depth)
        if c == "[":
            return self.make_chars(self.parse_class(flags), flags), False
        if c == ".":
            self.i += 1
            if flags.dotall:
                return Chars(((0, MAX_CP),)), False
            return Chars(((0, 9), (11, MAX_CP))), False
        if c in "*+?":
            raise self.error(f"'{c}' (nothing to repeat)", pos)
        if c == "{" and self._quantifier_ahead():
            raise self.error("'{' (nothing to repeat)", pos)
        if c == "\\":
            ranges, negated_class = self.parse_escape(flags, in_class=False)
            return self.make_chars(ranges, flags, negated_class), False
        self.i += 1
        return self.make_chars(((ord(c), ord(c)),), flags), False

    def make_chars(self, ranges: Ranges, flags: _Flags, negated_class: Ranges | None = None) -> Node:
        if negated_class is not None:
            pos = case_close(negated_class) if flags.ignorecase else negated_class
            return Chars(negate(pos))
        if flags.ignorecase:
            ranges = case_close(ranges)
        return Chars(ranges)

    def parse_group(self, flags: _Flags, at_start: bool, depth: int) -> tuple[Node, int]:
        pos = self.i
        self.i += 1
        if self.peek() == "?":
            self.i += 1
            c = self.peek()
            if c == ":" or c == "|":
                self.i += 1
            elif c == "P" and self.peek(1) == "<":
                self._skip_name(">")
            elif c == "<" and self.peek(1) not in ("=", "!"):
                self.i -= 1
                self._skip_name(">", start_offset=2)
            elif c == "P" and self.peek(1) == "=":
                raise self.error("backreference (?P=name)", pos)
            elif c in ("=", "!"):
                raise self.error("lookahead (?" + c, pos)
            elif c == "<":
                raise self.error("lookbehind (?<" + self.peek(1), pos)
            elif c == ">":
                raise self.error("atomic group (?>", pos)
            elif c == "(":
                raise self.error("conditional group (?(", pos)
            elif c == "#":
                end = self.p.find(")", self.i)
                if end < 0:
                    raise self.error("unterminated comment (?#", pos)
                self.i = end + 1
                return EMPTY, False
            elif c and c in "imsxauL-":
                flags, _ = self._read_flags(flags)
                if self.peek() != ":":
                    raise self.error("malformed inline flags", pos)
                self.i += 1
            else:
                raise self.error(f"group extension (?{c}", pos)
        node, ended = self.parse_alt(flags, at_start, depth + 1)
        if self.peek() != ")":
            raise self.error("'(' without a matching ')'", pos)
        self.i += 1
        return node, ended

    def _skip_name(self, close: str, start_offset: int = 2) -> None:
        pos = self.i
        self.i += start_offset
        end = self.p.find(close, self.i)
        if end < 0:
            raise self.error("unterminated group name", pos)
        self.i = end + 1

    def _quantifier_ahead(self) -> bool:
        return _QUANTIFIER.match(self.p, self.i) is not None

    def parse_quantifiers(self, atom: Node, flags: _Flags) -> Node:
        self.skip_verbose(flags)
        c = self.peek()
        pos = self.i
        if c in ("*", "+", "?"):
            self.i += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{" and self._quantifier_ahead():
            m = _QUANTIFIER.match(self.p, self.i)
            assert m is not None
            self.i = m.end()
            if m.group(2) is None:
                if not m.group(1):
                    raise self.error("empty repeat {}", pos)
                lo = hi = int(m.group(1))
            else:
                lo = int(m.group(1)) if m.group(1) else 0
                hi = int(m.group(3)) if m.group(3) else None
            if hi is not None and lo > hi:
                raise self.error("repeat with min greater than max", pos)
        else:
            return atom
        if self.peek() == "?":
            self.i += 1  # lazy: same language
        elif self.peek() == "+":
            raise self.error("possessive quantifier", self.i)
        self.skip_verbose(flags)
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._quantifier_ahead()):
            raise self.error("multiple repeat", self.i)
        return Repeat(atom, lo, hi)

    def parse_escape(self, flags: _Flags, in_class: bool) -> tuple[Ranges, Ranges | None]:
        """Returns (ranges, None) or ((), positive ranges of a negated class escape)."""
        pos = self.i
        self.i += 1
        c = self.peek()
        if c == "":
            raise self.error("trailing backslash", pos)
        self.i += 1
        if c in _CLASS_ESCAPES:
            key = c.lower()
            rng = _ASCII_CLASSES[key] if flags.ascii else class_ranges(_CLASS_ESCAPES[c])
            return ((), rng) if c.isupper() else (rng, None)
        if c in ("p", "P"):
            if self.peek() == "{":
                end = self.p.find("}", self.i)
                if end < 0:
                    raise self.error("unterminated \\p{", pos)
                name = self.p[self.i + 1 : end]
                self.i = end + 1
            else:
                name = self.peek()
                self.i += 1
            neg = c == "P"
            if name.startswith("^"):
                name, neg = name[1:], not neg
            try:
                rng = class_ranges(f"\\p{{{name}}}")
            except regex.error as exc:
                raise self.error(f"unknown Unicode property \\{c}{{{name}}}", pos) from exc
            return ((), rng) if neg else (rng, None)
        if c in _SIMPLE_ESCAPES:
            return ((_SIMPLE_ESCAPES[c],) * 2,), None
        if c == "b" and in_class:
            return ((8, 8),), None
        if c in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i : self.i + n]
            if len(digits) != n or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"malformed \\{c} escape", pos)
            self.i += n
            cp = int(digits, 16)
            if cp > MAX_CP:
                raise self.error(f"code point out of range \\{c}{digits}", pos)
            return ((cp, cp),), None
        if c == "N" and self.peek() == "{":
            end = self.p.find("}", self.i)
            try:
                cp = ord(unicodedata.lookup(self.p[self.i + 1 : end]))
            except KeyError as exc:
                raise self.error("unknown character name \\N{...}", pos) from exc
            self.i = end + 1
            return ((cp, cp),), None
        if c == "0":
            j = self.i
            while j < len(self.p) and j < self.i + 2 and self.p[j] in "01234567":
                j += 1
            cp = int(self.p[self.i - 1 : j], 8)
            self.i = j
            return ((cp, cp),), None
        if c in "1234567" and len(self.p) >= self.i + 2 and all(d in "01234567" for d in self.p[self.i : self.i + 2]):
            cp = int(self.p[self.i - 1 : self.i + 2], 8)
            if cp > 0o377:
                raise self.error("octal escape out of range", pos)
            self.i += 2
            return ((cp, cp),), None
        if c.isdigit():
            if in_class:
                raise self.error(f"octal or backreference escape \\{c} in a class", pos)
            raise self.error(f"backreference \\{c}", pos)
        if c == "g":
            raise self.error("backreference \\g<...>", pos)
        if c in ("b", "B"):
            raise self.error(f"word boundary \\{c}", pos)
        if c in ("G", "K", "X", "R", "m", "M"):
            raise self.error(f"escape \\{c}", pos)
        if c.isascii() and c.isalnum():
            raise self.error(f"bad escape \\{c}", pos)
        return ((ord(c), ord(c)),), None

    def parse_class(self, flags: _Flags) -> Ranges:
        pos = self.i
        self.i += 1
        negated = False
        if self.peek() == "^":
            negated = True
            self.i += 1
        items: list[Ranges] = []
        neg_items: list[Ranges] = []
        first = True
        while True:
            c = self.peek()
            if c == "":
                raise self.error("unterminated character class", pos)
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            if c == "[":
                if not self.startswith("[:"):  # `[:name:]` and `[:^name:]`
                    raise self.error("nested set or set operation in a class", self.i)
                end = self.p.find(":]", self.i)
                if end < 0:
                    raise self.error("malformed POSIX class", self.i)
                name = self.p[self.i : end + 2]
                try:
                    items.append(class_ranges(f"[{name}]"))
                except regex.error as exc:
                    raise self.error(f"unknown POSIX class {name}", self.i) from exc
                self.i = end + 2
                continue
            lo_pos = self.i
            lo = self._class_atom(flags, items, neg_items)
            if lo is None:
                continue
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                hi = self._class_atom(flags, items, neg_items)
                if hi is None:
                    raise self.error("bad character range", lo_pos)
                if hi < lo:
                    raise self.error("bad character range", lo_pos)
                items.append(((lo, hi),))
            else:
                items.append(((lo, lo),))
        ranges = union(*items, *(negate(n) for n in neg_items))  # normalized
        if flags.ignorecase:
            ranges = normalize(case_close(ranges))
        return negate(ranges) if negated else ranges

    def _class_atom(self, flags: _Flags, items: list[Ranges], neg_items: list[Ranges]) -> int | None:
        c = self.peek()
        if c == "\\":
            rng, neg = self.parse_escape(flags, in_class=True)
            if neg is not None:
                neg_items.append(neg)
                return None
            if len(rng) == 1 and rng[0][0] == rng[0][1]:
                return rng[0][0]
            items.append(rng)
            return None
        self.i += 1
        return ord(c)


_ENDS_NONE, _ENDS_SOME, _ENDS_ALL = 0, 1, 2


def _nullable(node: Node) -> bool:
    """Whether the parser's tree `node` matches the empty string."""
    if isinstance(node, Chars):
        return False
    if isinstance(node, Cat):
        return all(_nullable(it) for it in node.items)
    if isinstance(node, Alt):
        return any(_nullable(it) for it in node.items)
    if isinstance(node, Repeat):
        return node.lo == 0 or _nullable(node.item)
    raise TypeError(f"unexpected node {type(node).__name__}")


def parse_regex(pattern: str, *, search: bool = False) -> Node:
    """Parse `pattern` into a syntax tree. Mutates nothing.

    With `search=True` the tree matches every string that *contains* a match (the semantics of
    `regex.search` and of JSON Schema `pattern`): unanchored ends get any text.
    Raises `UnsupportedRegexError` (construct and position) for non-regular or malformed input.
    """
    if not search:
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be str, got {type(pattern).__name__}")
        return _Parser(pattern).parse()
    return alt(*(cat(node, ANY_TEXT) if open_end else node for node, open_end in search_branches(pattern)))


# any text (what an unanchored end of a search pattern adds)
ANY_TEXT = Repeat(Chars(((0, MAX_CP),)), 0, None)


def search_branches(pattern: str) -> list[tuple[Node, bool]]:
    """The top-level branches of a search pattern as (tree, open end): the search language is the
    union of `tree` for closed branches and `tree` followed by `ANY_TEXT` for open ones (an
    unanchored start is part of `tree`). `parse_regex(pattern, search=True)` is that union; a
    caller may build the open branches' "then anything" itself (`cfsm.schema`: by first match).
    Raises `UnsupportedRegexError`."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be str, got {type(pattern).__name__}")
    parser = _Parser(pattern)
    flags = _Flags()
    branches = []
    while True:
        parser.seq_anchored = False
        node, ended, flags = parser.parse_seq(flags, True, 0)
        branches.append((cat(*([] if parser.seq_anchored else [ANY_TEXT]), node), ended != _ENDS_ALL))
        if parser.peek() == "|":
            parser.i += 1
            continue
        break
    if parser.i < len(pattern):
        raise parser.error("')' without a matching '('")
    if parser.nested_anchor is not None:
        raise parser.error("anchor inside a group of a search pattern", parser.nested_anchor)
    return branches
