"""Token walks of states that loop on a byte set most tokens start with (flexible whitespace).

With flexible whitespace, every state before or after a structural character loops on
``[ \\t\\n\\r]``, and most tokens of a BPE vocabulary start with a space: each such state has
most of the vocabulary as candidates, although after the run of whitespace only a few bytes
(`"`, `,`, `}`, a digit) are allowed. From a state q whose bytes S lead into a state W that loops
on them (W is q itself, or the whitespace state after a number), a token made only of bytes of S
ends in W, and any other token that starts with a byte of S reads its first byte c outside S in
W: it survives as its bytes from c on survive from W. So per vocabulary and S, the tokens are
grouped once by that byte c (with its offset) (`loop_table`), and per compile a loop state walks
only the tokens whose first byte outside S W allows (`loop_pairs`), from the state after c: a
few hundred tokens where the plain walk takes them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cfsm.automata.automaton import Dfa, concat_ranges
from cfsm.config import IndexTuning
from cfsm.masks.trie import TrieTables

__all__ = ["LoopTable", "Loops", "loop_table", "find_loops"]

# a state is walked as a loop state where its loop bytes start more than
# `IndexTuning.loop_min_tokens` tokens
# loop sets of at most this many bytes (whitespace); larger ones are string text (`templates`,
# chains) and keep their walks
_MAX_LOOP_BYTES = 8
# tables kept per vocabulary (one per distinct loop byte set; whitespace is one)
_MAX_TABLES = 8


@dataclass(frozen=True, eq=False)
class LoopTable:
    """The tokens of one vocabulary that start with a byte of S, split by their first byte outside S.

    `only`: sorted positions of the tokens made only of S bytes. `lead_pos[bounds[c]:bounds[c+1]]`:
    the positions of the tokens that start with an S byte and whose first byte outside S is c,
    and `lead_at` the offset just past that byte (where their walk goes on). Per sorted position,
    `out_byte` is that byte c (-1 for a token made only of S bytes, -2 for one not starting with
    an S byte) and `out_at` the offset past it.
    """

    only: np.ndarray  # (num_only,) int64
    lead_pos: np.ndarray  # (num_lead,) int64, grouped by c
    lead_at: np.ndarray  # (num_lead,) int64
    bounds: np.ndarray  # (257,) int64
    out_byte: np.ndarray  # (n,) int16
    out_at: np.ndarray  # (n,) int16
    lengths: np.ndarray  # (n,) int32: the tables' token lengths (`longer_than`)
    # (256 * 257 + 1,): the lead tokens of c whose next byte is d are [bounds2[k], bounds2[k + 1])
    # for k = c * 257 + d + 1 (d = -1: the token ends at c); None in a `longer_than` view
    bounds2: np.ndarray | None = None
    _long: dict[int, LoopTable] = field(default_factory=dict)

    def longer_than(self, min_len: int) -> LoopTable:
        """This table restricted to the tokens longer than `min_len` bytes (cached)."""
        hit = self._long.get(min_len)
        if hit is None:
            lead = self.lengths[self.lead_pos] > min_len
            c = np.repeat(np.arange(256), np.diff(self.bounds))[lead]
            hit = self._long[min_len] = LoopTable(
                only=self.only[self.lengths[self.only] > min_len], lead_pos=self.lead_pos[lead],
                lead_at=self.lead_at[lead], bounds=np.searchsorted(c, np.arange(257)).astype(np.int64),
                out_byte=self.out_byte, out_at=self.out_at, lengths=self.lengths)
        return hit


def loop_table(tables: TrieTables, member: np.ndarray) -> LoopTable:
    """The `LoopTable` of the byte set `member` ((256,) bool) over `tables` (cached by the tables, at
    most `_MAX_TABLES` loop sets)."""
    key = np.packbits(member).tobytes()
    per = tables.derived_cache("loop_tables")
    hit = per.get(key)
    if hit is not None:
        return hit
    starts = tables.first_byte_starts
    s = np.flatnonzero(member)
    pos = concat_ranges(starts[s], starts[s + 1] - starts[s])
    outside = np.ones(257, dtype=bool)  # index -1 (past the end: column value -1) counts as outside
    outside[:256] = ~member
    columns = tables.columns
    at = np.zeros(len(pos), dtype=np.int64)
    todo = np.arange(len(pos))
    d = 1
    while len(todo):  # most tokens leave S at their second byte
        found = outside[columns[d].take(pos[todo])]
        at[todo[found]] = d
        todo = todo[~found]
        d += 1
    c = columns[at, pos].astype(np.int64)
    lead = np.flatnonzero(c >= 0)
    # by c, then by the byte after it (-1: the token ends at c), as `TrieTables.two_byte_starts`
    two = c[lead] * 257 + columns[at[lead] + 1, pos[lead]].astype(np.int64) + 1
    order = lead[np.argsort(two, kind="stable")]
    out_byte = np.full(len(tables.order), -2, dtype=np.int16)
    out_at = np.zeros(len(tables.order), dtype=np.int16)
    out_byte[pos] = c
    out_at[pos] = at + 1
    hit = LoopTable(only=pos[c < 0], lead_pos=pos[order], lead_at=at[order] + 1,
                    bounds=np.searchsorted(c[order], np.arange(257)).astype(np.int64), out_byte=out_byte,
                    out_at=out_at, lengths=tables.lengths,
                    bounds2=np.searchsorted(np.sort(two), np.arange(256 * 257 + 1)).astype(np.int64))
    for a in (hit.only, hit.lead_pos, hit.lead_at, hit.bounds, hit.out_byte, hit.out_at, hit.bounds2):
        if a is not None:
            a.flags.writeable = False  # shared by every compile over these tables
    if len(per) >= _MAX_TABLES:
        per.pop(next(iter(per)))
    per[key] = hit
    return hit


class Loops:
    """The loop states of one compile (`find_loops`): per loop state its loop bytes S and W."""

    def __init__(self, dfa: Dfa, tables: TrieTables, states: np.ndarray, member: np.ndarray, into: np.ndarray) -> None:
        self.trans = dfa.transitions
        self.dead = dfa.dead
        self.tables = tables
        self.states = states  # (m,) sorted state ids
        self.member = member  # (m, 256) bool: loop bytes
        self.into = into  # (m,) W
        self.row = np.full(dfa.transitions.shape[0], -1, dtype=np.int64)  # state -> index, -1: not a loop state
        self.row[states] = np.arange(len(states))
        # loop states with one loop byte set share a table: the sets numbered in the order of
        # their packed bytes (as `np.unique(..., axis=0)` would, whose per-call cost dominated here)
        keys = [r.tobytes() for r in np.packbits(member, axis=1)]
        first_of: dict[bytes, int] = {}
        for i, k in enumerate(keys):
            first_of.setdefault(k, i)
        rank = {k: g for g, k in enumerate(sorted(first_of))}
        self.group = np.fromiter((rank[k] for k in keys), dtype=np.int64, count=len(keys))
        self.table = [loop_table(tables, member[first_of[k]]) for k in sorted(first_of)]

    def candidates(self, rows: np.ndarray) -> np.ndarray:
        """Per loop state (index `rows`): how many (state, token) pairs `pairs` and the walk of
        the tokens starting outside its loop bytes take together."""
        out = np.zeros(len(rows), dtype=np.int64)
        counts = self.tables.first_byte_counts
        for g, table in enumerate(self.table):
            at = self.group[rows] == g
            r = rows[at]
            # the tokens starting outside the loop bytes (from the state), and after a run (from W)
            own = (self.trans[self.states[r], :256] != self.dead) & ~self.member[r]
            after = (self.trans[self.into[r], :256] != self.dead) & ~self.member[r]
            out[at] = own.astype(np.int64) @ counts + after.astype(np.int64) @ np.diff(table.bounds) + len(table.only)
        return out

    def only_ids(self, is_long: np.ndarray | None, order: np.ndarray) -> list[np.ndarray]:
        """Per loop set (`group`): the ids of the tokens made only of its bytes (at most the shared
        depth long where `is_long` is given: those it marks false): allowed in each of its loop states."""
        return [order[t.only if is_long is None else t.only[~is_long[t.only]]].astype(np.int64) for t in self.table]

    def pairs(self, rows: np.ndarray, min_len: int | None = None, with_only: bool = True
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The (state, token) pairs of the loop states `rows` whose token starts with a loop byte
        (and is longer than `min_len` bytes, if given): (owner, position, state, offset) of the
        pairs still to walk (their first byte outside the loop read: `state` is the state after
        it, `offset` the index of their next byte), then (owner, position) of the tokens made
        only of loop bytes (they survive, in W).

        The tokens starting outside the loop bytes are the caller's to walk (as from any state).
        """
        parts: list[list[np.ndarray]] = [[] for _ in range(6)]
        for g, whole in enumerate(self.table):
            table = whole if min_len is None else whole.longer_than(min_len)
            r = rows[self.group[rows] == g]
            mine, into = self.states[r], self.into[r]
            if with_only:
                parts[4].append(np.repeat(mine, len(table.only)))
                parts[5].append(np.tile(table.only, len(mine)))
            sizes = np.diff(table.bounds)
            live = (self.trans[into, :256] != self.dead) & ~self.member[r] & (sizes > 0)[None, :]
            i, c = np.nonzero(live)
            after = self.trans[into[i], c].astype(np.int64)  # the state after c
            if table.bounds2 is None:  # every token of c
                n = sizes[c]
                idx = concat_ranges(table.bounds[c], n)
                owner, cur = np.repeat(mine[i], n), np.repeat(after, n)
            else:  # NOTE: only the tokens whose byte after c that state allows (or ending at c)
                nxt = np.ones((len(i), 257), dtype=bool)
                nxt[:, 1:] = self.trans[after, :256] != self.dead
                # NOTE: the allowed (pair, next byte) entries first (a few per row), in row-major
                # order, then those that start tokens
                j, d = np.nonzero(nxt)
                k = c[j] * 257 + d
                lo2 = table.bounds2[k]
                n = table.bounds2[k + 1] - lo2
                some = n > 0
                j, n = j[some], n[some]
                idx = concat_ranges(lo2[some], n)
                owner, cur = np.repeat(mine[i[j]], n), np.repeat(after[j], n)
            parts[0].append(owner)
            parts[1].append(table.lead_pos[idx])
            parts[2].append(cur)
            parts[3].append(table.lead_at[idx])
        a, b, c_, d, e, f = (np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts)
        return a, b, c_, d, e, f


def find_loops(dfa: Dfa, tables: TrieTables, states: np.ndarray,
               min_tokens: int = IndexTuning.loop_min_tokens) -> Loops | None:
    """The loop states among `states` (None if there is none).

    A state q is a loop state where the bytes S that lead it into a state W looping on them (every
    byte of S leads from W back to W; W the target of the looping byte that starts most tokens:
    q itself, or the whitespace state after a number) are at most `_MAX_LOOP_BYTES` and start
    more than `min_tokens` tokens (`IndexTuning.loop_min_tokens`). Computed per byte class (bytes of one class step alike).
    """
    rep, byte_class = dfa.byte_classes
    cols = dfa.class_table  # (num_states + 1, num_classes)
    counts = np.bincount(byte_class, weights=tables.first_byte_counts, minlength=len(rep))
    sizes = np.bincount(byte_class, minlength=len(rep))
    small = np.flatnonzero((sizes <= _MAX_LOOP_BYTES) & (counts > 0))  # the classes S can hold
    n = cols.shape[0] - 1
    if not len(small):
        return None
    # NOTE: W looked for among `states` only (a W elsewhere leaves its states walked as usual)
    self_s = cols[states][:, small] == states[:, None]  # W loops on the class
    w_rows = np.flatnonzero(self_s.astype(np.float64) @ counts[small] > min_tokens)  # float: a BLAS product
    ws = states[w_rows]  # NOTE: and not string text (it loops on most bytes: `templates`, chains)
    ok_w = (cols[ws] == ws[:, None]).astype(np.float64) @ sizes <= _MAX_LOOP_BYTES
    if not ok_w.any():
        return None  # no state loops on bytes that start that many tokens (compact JSON)
    is_w = np.zeros(n + 1, dtype=bool)
    is_w[ws[ok_w]] = True
    small = small[self_s[w_rows[ok_w]].any(axis=0)]  # the classes some W loops on (whitespace)
    sub = cols[:, small]
    tgt = sub[states]
    states = states[is_w[tgt].any(axis=1)]  # a class into such a W
    tgt = sub[states].astype(np.int64)
    # class j leads into W = tgt[:, j], which loops on it
    loops = (cols[tgt, small[None, :]] == tgt) & is_w[tgt]
    # NOTE: W is where the looping class that starts most tokens leads (the space's); other looping
    # classes (digits into a number) are not in S
    top = np.where(loops, counts[small][None, :] + 1, 0).argmax(axis=1)
    w = tgt[np.arange(len(states)), top]
    loops &= tgt == w[:, None]
    num = loops.astype(np.float64) @ sizes[small]
    ok = (num > 0) & (num <= _MAX_LOOP_BYTES) & (loops.astype(np.float64) @ counts[small] > min_tokens)
    if not ok.any():
        return None
    col_of = np.full(len(rep) + 1, len(small), dtype=np.int64)  # classes outside `small`: a False column
    col_of[small] = np.arange(len(small))
    member = np.zeros((int(ok.sum()), len(small) + 1), dtype=bool)
    member[:, : len(small)] = loops[ok]
    return Loops(dfa, tables, states[ok].astype(np.int64), member[:, col_of[byte_class]], w[ok])
