"""`format` strings (email, uri) resolved from per-vocabulary tables (built once per `Vocabulary`).

The body of a formatted JSON string followed by its closing quote is the same small automaton F
in every schema (`cfsm.automata.json_automata.f_automaton`, from `FORMAT_REGEXES`); only what follows the quote
differs. Per vocabulary, every token is walked through F once from each F state: it dies, stays
inside F, or leaves it at the closing quote with a suffix. Per compile, DFA states that step
exactly like F state s followed by continuation state c are recognized (`match_fragment`: every
transition of every mapped state checked, one byte per class), and their masks are a
precomputed row (the tokens that stay) plus the leaving tokens whose suffix lives from c.

Only the formats whose states are broad (many candidate tokens, costly to walk per compile) get
tables; the narrow ones (dates, uuids, addresses) are cheap batched walks anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cfsm.automata.automaton import Dfa, small_unique, unique_rows
from cfsm.automata.json_automata import TABLE_FORMATS, f_automaton, joint_reps
from cfsm.masks.rows import or_bits
from cfsm.masks.templates import (
    SuffixOrder,
    live_suffixes,
    suffix_order,
    suffix_table,
    walk_t,
)
from cfsm.masks.trie import TrieTables

__all__ = ["FragmentTable", "FragmentMatch", "build_fragment_tables", "match_fragment", "fragment_rows"]

@dataclass(frozen=True, eq=False)
class FragmentTable:
    """Per-vocabulary walks of every token through one format's F (see the module docstring).

    `stay_rows[s]`: mask row (uint32 words) of the tokens that stay inside F from state s;
    `exit_ids[s]`, `exit_suffix[s]`: token id and suffix id of those that leave at the quote;
    `suffix_columns[d, j]` is byte d of suffix j (-1 past its end).
    """

    name: str
    code: np.ndarray  # (num_f, 256) int64: F state, EXIT or DEAD
    start: int
    stay_rows: np.ndarray  # (num_f, words) uint32
    exit_ids: tuple[np.ndarray, ...]
    exit_suffix: tuple[np.ndarray, ...]
    suffix_columns: np.ndarray
    probe: np.ndarray  # bytes that start runs of F's start row, dead and live ones interleaved
    byte_class: np.ndarray  # F's own byte classes (bytes with equal columns in `code`)

    @property
    def num_f(self) -> int:
        return int(self.code.shape[0])

    @functools.cached_property
    def suffixes_by_length(self) -> SuffixOrder:
        """`suffix_order(suffix_columns)`, kept with this table (`live_suffixes`)."""
        return suffix_order(self.suffix_columns)

    @property
    def nbytes(self) -> int:
        return int(self.stay_rows.nbytes + self.suffix_columns.nbytes
                   + sum(a.nbytes + b.nbytes for a, b in zip(self.exit_ids, self.exit_suffix, strict=True)))


def build_fragment_tables(tables: TrieTables, words: int,
                          formats: tuple[str, ...] = TABLE_FORMATS) -> tuple[FragmentTable, ...]:
    """Walk the vocabulary through each format's F from every F state (once per vocabulary)."""
    out = []
    for fmt in formats:
        auto = f_automaton(fmt)
        if auto is None:
            continue
        code, start = auto
        suffix_id: dict[bytes, int] = {}
        rows = np.zeros((code.shape[0], words), dtype=np.uint32)
        exit_ids, exit_suffix = [], []
        for s in range(code.shape[0]):
            pos, _, epos, _, eat = walk_t(code, -1, s, tables)  # no text state: no character count
            tids = tables.order[pos]
            or_bits(rows[s], tids)
            sufs = [tables.sorted_tokens[p][a + 1 :] for p, a in zip(epos.tolist(), eat.tolist(), strict=True)]
            exit_ids.append(tables.order[epos].astype(np.int64))
            exit_suffix.append(np.array([suffix_id.setdefault(x, len(suffix_id)) for x in sufs], dtype=np.int64))
        row = code[start]
        runs = np.flatnonzero(np.diff(row, prepend=-1) != 0)
        dead_at, live_at = runs[row[runs] == code.shape[0] + 1], runs[row[runs] != code.shape[0] + 1]
        probe = np.full(len(runs), -1, dtype=np.int64)
        m = min(len(dead_at), len(live_at))
        probe[: 2 * m : 2], probe[1 : 2 * m : 2] = dead_at[:m], live_at[:m]
        probe[2 * m :] = np.concatenate([dead_at[m:], live_at[m:]])
        out.append(FragmentTable(name=fmt, code=code, start=start, stay_rows=rows, exit_ids=tuple(exit_ids),
                                 exit_suffix=tuple(exit_suffix), suffix_columns=suffix_table(list(suffix_id)),
                                 probe=probe, byte_class=unique_rows(code.T)[1].astype(np.int64)))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class FragmentMatch:
    """DFA states recognized as F states: per DFA state (num_states + 1 entries) the F state
    (-1: not one) and `cont` (the state after the closing quote)."""

    f: np.ndarray
    cont: np.ndarray


def match_fragment(dfa: Dfa, ft: FragmentTable) -> FragmentMatch:
    """Recognize the DFA states that behave exactly like an F state followed by a continuation.

    Candidates for F's start are the states whose dead bytes are exactly F's; from each, F's
    states are followed in parallel (one byte per class of both automata) and a candidate is
    kept only if every mapped state is non-accepting, dead exactly where F is, steps to the
    mapped state of F's target elsewhere, and all its quote exits lead to one state `cont`. Then
    the mapped state of F state s has language L_F(s) followed by cont's. Pure.
    """
    n, dead = dfa.num_states, dfa.dead
    f = np.full(n + 1, -1, dtype=np.int64)
    cont = np.full(n + 1, dead, dtype=np.int64)
    if n == 0:
        return FragmentMatch(f, cont)
    code, num_f = ft.code, ft.num_f
    exit_code, dead_code = num_f, num_f + 1
    # NOTE: a quick necessary test first (most grammars have no such state): the candidates must
    # be dead exactly where F's start is on the bytes that start its runs
    trans, acc = dfa.transitions, dfa.accepting
    # NOTE: first by the number of live bytes (one product over the byte classes: regexes and most
    # schemas have no state with as many as F's start)
    _, byte_class = dfa.byte_classes
    live_count = (dfa.class_table[:n] != dead).astype(np.int64) @ np.bincount(byte_class, minlength=dfa.class_table.shape[1])
    cand = np.flatnonzero(~acc[:n] & (live_count == int((code[ft.start] != dead_code).sum())))
    if not len(cand):
        return FragmentMatch(f, cont)
    for b, dead_b in zip(ft.probe.tolist(), (code[ft.start, ft.probe] == dead_code).tolist(), strict=True):
        cand = cand[(trans[cand, b] == dead) == dead_b]
        if not len(cand):
            return FragmentMatch(f, cont)
    cand = cand[((trans[cand] == dead) == (code[ft.start] == dead_code)[None, :]).all(axis=1)]
    if not len(cand):
        return FragmentMatch(f, cont)
    _, byte_class = dfa.byte_classes
    reps = joint_reps(byte_class, ft.byte_class)
    tcode = code[:, reps]  # (num_f, r)
    fdead = tcode == dead_code
    table = np.take(dfa.class_table, byte_class[reps], axis=1)  # (n + 1, r): one byte per class
    is_dead = table == dead
    qs = cand[(is_dead[cand] == fdead[ft.start]).all(axis=1)]
    if not len(qs):
        return FragmentMatch(f, cont)
    ok = np.ones(len(qs), dtype=bool)
    c = np.full(len(qs), -1, dtype=np.int64)
    mapped: dict[int, np.ndarray] = {ft.start: qs}
    order = [ft.start]
    for s in order:  # F's states in discovery order (F is small)
        cur = mapped[s]
        ok &= ~acc[cur] & (is_dead[cur] == fdead[s]).all(axis=1)
        row = tcode[s]
        rows = table[cur]
        for s2 in np.unique(row[row != dead_code]).tolist():  # the columns of one F target at once
            sub = rows[:, row == s2]
            tgt = sub[:, 0].astype(np.int64)
            if sub.shape[1] > 1:
                ok &= (sub == sub[:, :1]).all(axis=1)
            if s2 == exit_code:
                ok &= (c < 0) | (c == tgt)
                c = np.where(c < 0, tgt, c)
            elif s2 in mapped:
                ok &= mapped[s2] == tgt
            else:
                mapped[s2] = tgt
                order.append(s2)
    ok &= c >= 0
    keep = np.flatnonzero(ok)
    # NOTE: a state claimed by several candidates gets any of the claims: each one describes its
    # language exactly, so each gives the same token set
    for s, cur in mapped.items():
        f[cur[keep]] = s
        cont[cur[keep]] = c[keep]
    return FragmentMatch(f, cont)


def fragment_rows(dfa: Dfa, ft: FragmentTable, m: FragmentMatch, states: np.ndarray,
                  intern: Callable[[np.ndarray], int], mask_row: np.ndarray) -> None:
    """Mask rows of the matched `states` (written into `mask_row`); equal rows interned once."""
    if not len(states):
        return
    conts, c_idx = small_unique(m.cont[states])
    live = live_suffixes(dfa, conts, ft.suffix_columns, ft.suffixes_by_length)
    key = m.f[states] * len(conts) + c_idx
    uniq, inverse = small_unique(key)
    rows = np.empty(len(uniq), dtype=np.int32)
    for g, k in enumerate(uniq.tolist()):
        s, ci = divmod(k, len(conts))
        row = ft.stay_rows[s].copy()
        tids = ft.exit_ids[s][live[ci, ft.exit_suffix[s]]]
        or_bits(row, tids)
        rows[g] = intern(row)
    mask_row[states] = rows[inverse]
