"""JSON Schema `pattern` languages (search semantics) over JSON string bodies, as ready DFAs built
once per process and pattern: for `pattern` (`json_schema`) and `patternProperties` keys
(`json_object`)."""

from __future__ import annotations

import functools

import numpy as np

from cfsm.automata.automaton import Dfa, DfaNode, build_dfa, minimize
from cfsm.errors import GrammarTooLargeError
from cfsm.regex.json_lexical import json_escape
from cfsm.regex.parser import ANY_TEXT, search_branches
from cfsm.regex.syntax import NOTHING, Node, alt, cat

__all__ = ["search_body"]

# any JSON string body (the text an open end of a search pattern adds)
_ANY_BODY = json_escape(ANY_TEXT)


# NOTE: pure memoization of immutable inputs (a pattern and a DFA limit), bounded (256 entries)
@functools.lru_cache(maxsize=256)
def search_body(pattern: str, limit: int) -> tuple[Node, Dfa | None]:
    """The JSON string bodies matching `pattern` (search semantics, `regex.search`): (its ready
    DFA as a tree leaf, or NOTHING; the DFA), built once per process and pattern (a counted
    pattern such as a word count `(?:\\S+\\s+){0,199}` is thousands of NFA copies); past the DFA
    limit (tree, None). Open ends by first match (`_then_any_body`). Raises `UnsupportedRegexError`."""
    branches = [(json_escape(node), open_end) for node, open_end in search_branches(pattern)]
    tree = alt(*(cat(node, _ANY_BODY) if open_end else node for node, open_end in branches))
    try:
        opened = [node for node, open_end in branches if open_end]
        closed = [node for node, open_end in branches if not open_end]
        first = build_dfa(alt(*opened), limit=limit) if opened else None
        parts = [DfaNode(_then_any_body(first))] if first is not None and first.num_states else []
        dfa = build_dfa(alt(*parts, *closed), limit=limit)
    except GrammarTooLargeError:
        return tree, None
    return (DfaNode(dfa) if dfa.num_states else NOTHING), dfa


# NOTE: pure memoization of an immutable tree's DFA (one entry)
@functools.cache
def _any_body_dfa() -> Dfa:
    return build_dfa(_ANY_BODY)


def _then_any_body(dfa: Dfa) -> Dfa:
    """The DFA of `dfa`'s language followed by any JSON string body, by first match: an accepting
    state steps as the start of "any body" does. Exact for a language of whole JSON string bodies
    (escaped code points: a prefix code), where u and uv in the language of bodies make v a body:
    a text has a prefix in the language followed by a body iff its first such prefix is followed
    by a body. The subset construction of `L` then "anything" directly keeps every partial match
    after the first (JSONSchemaBench o47656's time zone alternation: ~20,000 subset states for a
    minimal 70, > 20 s; this way 0.3 s)."""
    body = _any_body_dfa()
    n, m = dfa.num_states, body.num_states
    dead = n + m
    table = np.full((n + m + 1, 256), dead, dtype=np.int32)
    own = dfa.transitions[:n]
    table[:n] = np.where(own == dfa.dead, dead, own)
    rest = body.transitions[:m]
    table[n:n + m] = np.where(rest == body.dead, dead, rest + n)
    accepting = np.zeros(n + m + 1, dtype=bool)
    accepting[:n] = dfa.accepting[:n]
    accepting[n:n + m] = body.accepting[:m]
    table[:n][accepting[:n]] = table[n + body.start]
    return minimize(table, accepting, dfa.start, bfs=True)
