"""The standard JSON value trees every schema shares: the unbounded string body, booleans,
numbers, integers and the `format` strings (`format_node`, from `cfsm.regex.formats`), each
kept whole as one `Piece` (`standard_pieces`), so the direct construction builds their blocks
once (`cfsm.automata.blocks.prepare_blocks`) and every compile copies them. One immutable tree
each per process: the schema frontend, the direct construction and the vocabulary's format
tables find them by identity."""

from __future__ import annotations

import functools

from cfsm.regex.formats import FORMAT_REGEXES
from cfsm.regex.json_lexical import JSON_CHAR, json_escape
from cfsm.regex.parser import parse_regex
from cfsm.regex.syntax import Chars, Node, Piece, Repeat, alt, cat, lit

__all__ = ["DIGIT", "NONZERO", "NAT", "INT", "FRACTION", "EXPONENT", "NUMBER", "STRING_BODY", "BOOLEAN",
           "format_node", "piece", "standard_pieces"]

DIGIT = Chars(((48, 57),))
NONZERO = Chars(((49, 57),))
NAT = alt(lit("0"), cat(NONZERO, Repeat(DIGIT, 0, None)))
INT = cat(Repeat(lit("-"), 0, 1), NAT)
FRACTION = cat(lit("."), Repeat(DIGIT, 1, None))
EXPONENT = cat(Chars(((69, 69), (101, 101))), Repeat(Chars(((43, 43), (45, 45))), 0, 1), Repeat(DIGIT, 1, None))
NUMBER = cat(INT, Repeat(FRACTION, 0, 1), Repeat(EXPONENT, 0, 1))
STRING_BODY = Repeat(JSON_CHAR, 0, None)
BOOLEAN = alt(lit("true"), lit("false"))


# NOTE: pure memoization of immutable inputs, bounded by the formats of `FORMAT_REGEXES`: the
# tree's identity is what the direct construction's prepared blocks and the format tables key on
@functools.cache
def format_node(fmt: str) -> Node:
    """The JSON-escaped syntax tree of a `format` (one immutable tree per format per process;
    `Vocabulary.prepare()` builds them all)."""
    return json_escape(parse_regex(FORMAT_REGEXES[fmt]))


# NOTE: pure memoization of immutable inputs, bounded: called only with this module's standard
# trees (boolean, number, integer, one per format), so each has one `Piece` per process
@functools.cache
def piece(node: Node) -> Piece:
    """`node` kept whole inside a schema's tree: one `Piece` per standard value tree per process,
    so the direct construction copies its block prepared once (`blocks.prepare_blocks`)."""
    return Piece(node)


def standard_pieces() -> tuple[Node, ...]:
    """The per-process value trees that schemas share (unbounded string body, boolean, number,
    integer, every format): `cfsm.automata.blocks.prepare_blocks` builds their blocks once."""
    return (STRING_BODY, piece(BOOLEAN), piece(NUMBER), piece(INT), *(piece(format_node(f)) for f in FORMAT_REGEXES))
