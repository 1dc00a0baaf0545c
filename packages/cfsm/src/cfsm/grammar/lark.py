"""A Lark grammar subset to a `Grammar` (the start rule is `start`).

    start: value
    ?value: object | array | ESCAPED_STRING | SIGNED_NUMBER -> number | "true" | "false" | "null"
    array: "[" [value ("," value)*] "]"
    object: "{" [pair ("," pair)*] "}"
    pair: ESCAPED_STRING ":" value
    %import common.ESCAPED_STRING
    %import common.SIGNED_NUMBER
    %import common.WS
    %ignore WS

Supported: rules (lowercase, `?` / `!` prefixes and `.priority` ignored) and terminals
(uppercase; regular: they may use other terminals, not rules), alternatives over lines starting
with `|`, `"literal"` (and `"literal"i`), `"a".."z"`, `/regex/flags` (cfsm's regular subset,
flags i s x), groups, `[optional]`, `* + ?`, `~ n` and `~ n..m`, aliases `-> name` (ignored),
`%import common.NAME` / `%import common (A, B)` for the usual terminals, `%ignore` (terminals,
literals, regexes), `//` comments. `%ignore` lets the ignored text appear before every terminal
and at the end (Lark's lexer decides token boundaries itself, so this accepts a superset where
two adjacent terminals could also be lexed as one). Errors are `GrammarError`s with line and
column.
"""

from __future__ import annotations

import regex as re

from cfsm.errors import GrammarError, UnsupportedRegexError
from cfsm.grammar.rules import Grammar, RuleRef
from cfsm.regex.charset import case_close, normalize
from cfsm.regex.parser import parse_regex
from cfsm.regex.syntax import EMPTY, Alt, Cat, Chars, Node, Repeat, Scope, Sep, Shared, alt, cat, lit

__all__ = ["parse_lark", "COMMON_TERMINALS"]

# Lark's common.lark, as regexes (cfsm's subset)
COMMON_TERMINALS = {
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[0-9a-fA-F]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+", "FLOAT": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
    "SIGNED_FLOAT": r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)",
    "NUMBER": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+",
    "SIGNED_NUMBER": r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+)",
    "ESCAPED_STRING": r'"([^"\\\n]|\\.)*"', "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]",
    "LETTER": r"[a-zA-Z]", "WORD": r"[a-zA-Z]+", "CNAME": r"[_a-zA-Z][_a-zA-Z0-9]*", "WS_INLINE": r"[ \t]+",
    "WS": r"[ \t\f\r\n]+", "CR": r"\r", "LF": r"\n", "NEWLINE": r"(\r?\n)+", "SH_COMMENT": r"#[^\n]*",
    "CPP_COMMENT": r"//[^\n]*", "C_COMMENT": r"/\*([^*]|\*+[^*/])*\*+/",
}
_IGNORED = "__ignored"
_TOKEN = re.compile(r"""
    (?P<nl>\n) | (?P<space>[ \t\r\f]+) | (?P<comment>//[^\n]*)
  | (?P<arrow>->) | (?P<range>\.\.) | (?P<directive>%[a-z]+)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?) | (?P<regexp>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<name>[?!]?[_a-zA-Z][_a-zA-Z0-9]*(?:\.-?[0-9]+)?) | (?P<number>[0-9]+)
  | (?P<punct>[:|()\[\]*+?~,.])
""", re.X)


class _Tok:
    __slots__ = ("kind", "text", "line", "column", "first")

    def __init__(self, kind: str, text: str, line: int, column: int, first: bool) -> None:
        self.kind, self.text, self.line, self.column, self.first = kind, text, line, column, first


def _tokens(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos, line, line_start, first = 0, 1, 0, True
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise GrammarError(f"unexpected character {text[pos]!r}", line, pos - line_start + 1)
        kind = m.lastgroup or ""
        if kind == "nl":
            line, line_start, first = line + 1, m.end(), True
        elif kind not in ("space", "comment"):
            out.append(_Tok(kind, m.group(), line, pos - line_start + 1, first))
            first = False
        pos = m.end()
    return out


def _unescape(body: str, tok: _Tok) -> str:
    try:
        return body.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as exc:
        raise GrammarError(f"bad escape in {tok.text}: {exc.reason}", tok.line, tok.column) from None


def _ci_lit(text: str) -> Node:
    return cat(*(Chars(case_close(((ord(c), ord(c)),))) for c in text))


class _Parser:
    def __init__(self, toks: list[_Tok], *, in_terminal: bool = False, ignore: bool = False) -> None:
        self.toks = toks
        self.i = 0
        self.depth = 0  # open parentheses / brackets (a line break inside them continues the statement)
        self.in_terminal = in_terminal  # a terminal's definition: no ignored text inside it
        self.ignore = ignore  # the grammar has %ignore

    def peek(self) -> _Tok | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def at_end_of_statement(self) -> bool:
        t = self.peek()
        return t is None or (t.first and t.text != "|" and self.depth == 0)

    def expect(self, text: str) -> _Tok:
        t = self.peek()
        if t is None or t.text != text:
            where = (t.line, t.column) if t else (self.toks[-1].line, self.toks[-1].column + len(self.toks[-1].text))
            raise GrammarError(f"expected {text!r}, found {t.text if t else 'the end'!r}", *where)
        self.i += 1
        return t

    def expansions(self) -> Node:
        options = [self.alias_expansion()]
        while (t := self.peek()) is not None and t.text == "|" and (self.depth > 0 or not self.at_end_of_statement()):
            self.i += 1
            options.append(self.alias_expansion())
        return options[0] if len(options) == 1 else alt(*options)

    def alias_expansion(self) -> Node:
        items: list[Node] = []
        while not self.at_end_of_statement():
            t = self.peek()
            assert t is not None
            if t.text in ("|", ")", "]"):
                break
            if t.kind == "arrow":
                self.i += 1
                self.i += 1  # the alias name
                break
            items.append(self.quantified(self.atom()))
        return cat(*items) if items else EMPTY

    def quantified(self, node: Node) -> Node:
        t = self.peek()
        if t is None or self.at_end_of_statement():
            return node
        if t.text in ("*", "+", "?"):
            self.i += 1
            return Repeat(node, 1 if t.text == "+" else 0, 1 if t.text == "?" else None)
        if t.text == "~":
            self.i += 1
            lo = int(self.expect_kind("number").text)
            hi = lo
            if (r := self.peek()) is not None and r.kind == "range":
                self.i += 1
                hi = int(self.expect_kind("number").text)
            if hi < lo:
                raise GrammarError(f"bad repetition ~ {lo}..{hi}", t.line, t.column)
            return Repeat(node, lo, hi)
        return node

    def expect_kind(self, kind: str) -> _Tok:
        t = self.peek()
        if t is None or t.kind != kind:
            where = (t.line, t.column) if t else (0, 0)
            raise GrammarError(f"expected a {kind}, found {t.text if t else 'the end'!r}", *where)
        self.i += 1
        return t

    def atom(self) -> Node:
        t = self.peek()
        assert t is not None
        self.i += 1
        if t.text in ("(", "["):
            self.depth += 1
            body = self.expansions()
            self.depth -= 1
            self.expect(")" if t.text == "(" else "]")
            return body if t.text == "(" else Repeat(body, 0, 1)
        if t.kind == "string":
            text = _unescape(t.text[1:-2] if t.text.endswith("i") else t.text[1:-1], t)
            if (r := self.peek()) is not None and r.kind == "range":
                self.i += 1
                end = self.expect_kind("string")
                hi = _unescape(end.text[1:-1], end)
                if len(text) != 1 or len(hi) != 1 or ord(hi) < ord(text):
                    raise GrammarError(f"bad range {t.text}..{end.text}", t.line, t.column)
                return self.terminal(Chars(normalize([(ord(text), ord(hi))])))
            return self.terminal(_ci_lit(text) if t.text.endswith("i") else lit(text))
        if t.kind == "regexp":
            source, flags = t.text[1:].rsplit("/", 1)
            inline = "".join(f for f in flags if f in "isx")
            pattern = (f"(?{inline})" if inline else "") + source
            try:
                return self.terminal(parse_regex(pattern))
            except UnsupportedRegexError as exc:
                raise GrammarError(f"regex {t.text}: {exc}", t.line, t.column) from None
        if t.kind == "name":
            name = t.text.lstrip("?!").split(".")[0]
            ref = RuleRef(name, t.line, t.column)
            return self.terminal(ref) if name.isupper() or name.lstrip("_").isupper() else ref
        raise GrammarError(f"unexpected {t.text!r}", t.line, t.column)

    def terminal(self, node: Node) -> Node:
        """Inside a rule, a terminal may follow ignored text (`%ignore`)."""
        if self.in_terminal or not self.ignore:
            return node
        return cat(Repeat(RuleRef(_IGNORED), 0, 1), node)


def _is_terminal(name: str) -> bool:
    return name.lstrip("_").isupper()


def parse_lark(text: str, start: str = "start") -> Grammar:
    """Parse a Lark grammar (the subset above) into a `Grammar` whose start rule is `start`.
    Raises `GrammarError` with line and column."""
    toks = _tokens(text)
    p = _Parser(toks, ignore=any(t.text == "%ignore" for t in toks))
    rules: dict[str, Node] = {}
    terms: dict[str, Node] = {}
    positions: dict[str, tuple[int, int]] = {}
    ignore: list[Node] = []
    while (t := p.peek()) is not None:
        if t.kind == "directive":
            p.i += 1
            args: list[_Tok] = []
            while not p.at_end_of_statement():
                tok = p.peek()
                assert tok is not None
                args.append(tok)
                p.i += 1
            if t.text == "%import":
                joined = "".join(a.text for a in args)
                mod, _, names = joined.partition("(")
                wanted = [n for n in names.rstrip(")").split(",") if n] if names else [mod.rsplit(".", 1)[-1]]
                if not mod.startswith("common"):
                    raise GrammarError(f"only %import common... is supported, not {joined!r}", t.line, t.column)
                for n in wanted:
                    if n not in COMMON_TERMINALS:
                        raise GrammarError(f"unknown common terminal {n!r}", t.line, t.column)
                    terms[n] = parse_regex(COMMON_TERMINALS[n])
            elif t.text == "%ignore":
                if not args:
                    raise GrammarError("%ignore needs a terminal", t.line, t.column)
                ignore.append(_Parser(args, in_terminal=True).expansions())
            else:
                raise GrammarError(f"unsupported directive {t.text}", t.line, t.column)
            continue
        if t.kind != "name" or not t.first:
            raise GrammarError(f"expected a rule or terminal definition, found {t.text!r}", t.line, t.column)
        p.i += 1
        name = t.text.lstrip("?!").split(".")[0]
        p.expect(":")
        p.in_terminal = _is_terminal(name)
        body = p.expansions()
        p.in_terminal = False
        target = terms if _is_terminal(name) else rules
        if name in target:
            raise GrammarError(f"{name!r} is defined twice", t.line, t.column)
        target[name] = body
        positions[name] = (t.line, t.column)
    if start not in rules:
        raise GrammarError(f"the grammar has no {start!r} rule", 1, 1)
    out = _resolve_terminals(rules, terms, positions)
    root = "__start"
    out[root] = RuleRef(start)
    if ignore:
        out[_IGNORED] = Repeat(alt(*(_inline(n, terms, positions, ()) for n in ignore)), 1, None)
        out[root] = cat(RuleRef(start), Repeat(RuleRef(_IGNORED), 0, 1))
    return Grammar(rules={root: out.pop(root), **out}, root=root, positions=positions)


def _inline(node: Node, terms: dict[str, Node], positions: dict[str, tuple[int, int]], stack: tuple[str, ...]) -> Node:
    """`node` with terminal references replaced by their (regular) definitions."""
    if isinstance(node, RuleRef):
        if not _is_terminal(node.name):
            return node
        if node.name in stack:
            raise GrammarError(f"terminal {node.name!r} is recursive (terminals must be regular)",
                               *positions.get(node.name, (node.line, node.column)))
        body = terms.get(node.name)
        if body is None:
            raise GrammarError(f"undefined terminal {node.name!r}", node.line, node.column)
        return _inline(body, terms, positions, (*stack, node.name))
    if isinstance(node, Cat):
        return Cat([_inline(x, terms, positions, stack) for x in node.items])
    if isinstance(node, Alt):
        return Alt([_inline(x, terms, positions, stack) for x in node.items])
    if isinstance(node, Repeat):
        return Repeat(_inline(node.item, terms, positions, stack), node.lo, node.hi)
    if isinstance(node, Sep):
        return Sep(_inline(node.item, terms, positions, stack), _inline(node.sep, terms, positions, stack))
    if isinstance(node, Scope | Shared):
        return type(node)(_inline(node.item, terms, positions, stack))
    return node


def _resolve_terminals(rules: dict[str, Node], terms: dict[str, Node],
                       positions: dict[str, tuple[int, int]]) -> dict[str, Node]:
    out: dict[str, Node] = {}
    for name, body in rules.items():
        out[name] = _inline(body, terms, positions, ())
        _check_refs(out[name], rules, positions)
    return out


def _check_refs(node: Node, rules: dict[str, Node], positions: dict[str, tuple[int, int]]) -> None:
    if isinstance(node, RuleRef) and node.name != _IGNORED and node.name not in rules:
        raise GrammarError(f"undefined rule {node.name!r}", node.line, node.column)
    for child in getattr(node, "items", ()) or ():
        _check_refs(child, rules, positions)
    for attr in ("item", "sep"):
        child = getattr(node, attr, None)
        if isinstance(child, Node):
            _check_refs(child, rules, positions)

