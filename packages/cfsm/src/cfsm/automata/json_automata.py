"""The small automata of JSON string text that the per-vocabulary tables (`cfsm.masks.templates`,
`cfsm.masks.fragments`) walk every token through and the direct construction maps its blocks
onto (`cfsm.automata.block_facts`, `cfsm.automata.blocks`): T, a JSON string's text up to its
closing quote, and F, a broad `format` string (`TABLE_FORMATS`) up to its closing quote; as
read-only code tables (`exit_coded`)."""

from __future__ import annotations

import functools

import numpy as np

from cfsm.automata.automaton import Dfa, build_dfa, unique_rows, unit_of
from cfsm.regex.json_lexical import JSON_CHAR
from cfsm.regex.json_values import format_node
from cfsm.regex.syntax import Repeat, cat, lit

__all__ = ["INF", "TABLE_FORMATS", "build_t_automaton", "exit_coded", "f_automaton", "joint_reps", "t_automaton",
           "t_automaton_classes"]

# "no upper bound" for a string's remaining characters (an unbounded string); decrementing keeps it
INF = 1 << 40

# formats with per-vocabulary tables (their states allow most ASCII bytes)
TABLE_FORMATS = ("email", "uri")


# NOTE: pure memoization of a constant (no inputs): one read-only table per process
@functools.lru_cache(maxsize=1)
def t_automaton() -> tuple[np.ndarray, int]:
    """`build_t_automaton()`, built once (read-only)."""
    code, text = build_t_automaton()
    code.flags.writeable = False
    return code, text


# NOTE: pure memoization of a constant (no inputs): one read-only table per process
@functools.lru_cache(maxsize=1)
def t_automaton_classes() -> np.ndarray:
    """T's byte classes (bytes with equal columns in its code table), int64 per byte."""
    out = unique_rows(t_automaton()[0].T)[1].astype(np.int64)
    out.flags.writeable = False
    return out


def build_t_automaton() -> tuple[np.ndarray, int]:
    """T as a code table (states, 256): a T state, `EXIT` (= states) or `DEAD` (= states + 1);
    and the text state (characters complete)."""
    unit_of(JSON_CHAR)  # also build its unit DFA (counted strings are built from it)
    dfa = build_dfa(cat(Repeat(JSON_CHAR, 0, None), lit('"')))
    final = np.flatnonzero(dfa.accepting[:-1])
    if len(final) != 1 or (dfa.transitions[final[0]] != dfa.dead).any():
        raise AssertionError("the JSON string automaton has one final state without transitions")
    return exit_coded(dfa, int(final[0]))


def exit_coded(dfa: Dfa, final: int) -> tuple[np.ndarray, int]:
    """`dfa`'s transitions as a code table for a walk that stops at `final`, its one final state
    (which has no transitions): the other states renumbered 0..n-1 in order, `EXIT` = n (entering
    `final`), `DEAD` = n + 1; and the start's code."""
    live = [q for q in range(dfa.num_states) if q != final]
    code = np.full(dfa.num_states + 1, len(live) + 1, dtype=np.int64)  # DEAD by default
    code[live] = np.arange(len(live))
    code[final] = len(live)  # EXIT
    return code[dfa.transitions[live]], int(code[dfa.start])


def joint_reps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted bytes, the first of each class of the joint partition of two byte partitions
    (class ids per byte): bytes that step alike in both automata, one representative each."""
    _, first = np.unique(a.astype(np.int64) * (int(b.max()) + 1) + b, return_index=True)
    return np.sort(first)


# NOTE: pure memoization of immutable inputs, bounded by the formats (`TABLE_FORMATS` are the
# ones asked for): one read-only table per format per process
@functools.cache
def f_automaton(fmt: str) -> tuple[np.ndarray, int] | None:
    """F as a code table (states, 256): an F state, `EXIT` (= states) or `DEAD` (= states + 1);
    and its start. None if F's end is not one final state without transitions. One read-only
    table per format per process (the vocabularies' tables and `direct`'s block maps share it)."""
    dfa = build_dfa(cat(format_node(fmt), lit('"')))
    final = np.flatnonzero(dfa.accepting[:-1])
    if len(final) != 1 or (dfa.transitions[final[0]] != dfa.dead).any() or int(final[0]) == dfa.start:
        return None
    code, start = exit_coded(dfa, int(final[0]))
    code.flags.writeable = False
    return code, start
