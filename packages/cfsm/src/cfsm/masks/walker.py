"""`Walker`: the per-compile token walks of single states (chains, escapes, batches)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from cfsm.automata.automaton import Dfa, concat_ranges, stable_argsort
from cfsm.config import IndexTuning
from cfsm.masks.loops import Loops
from cfsm.masks.trie import TrieTables
from cfsm.masks.walks import (
    chain_of,
    concat,
    group_steps,
    walk_all,
    walk_from,
    walk_pairs,
    walk_pairs_from,
    walk_vectorized,
)

# valid multi-byte UTF-8 sequences as byte ranges: (lead), (continuation)... (RFC 3629)
_UTF8_SEQUENCES = (
    ((0xC2, 0xDF), (0x80, 0xBF)),
    ((0xE0, 0xE0), (0xA0, 0xBF), (0x80, 0xBF)),
    ((0xE1, 0xEC), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xED, 0xED), (0x80, 0x9F), (0x80, 0xBF)),
    ((0xEE, 0xEF), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xF0, 0xF0), (0x90, 0xBF), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xF1, 0xF3), (0x80, 0xBF), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xF4, 0xF4), (0x80, 0x8F), (0x80, 0xBF), (0x80, 0xBF)),
)
_ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)
## narrow branches (at most this many allowed bytes) descend by binary search
_FEW_BYTES = 6
# ranges at most this long are walked directly
_SMALL_RANGE = 24
# the thresholds between the walks (batched, plain Python, whole vocabulary, chains): `IndexTuning`


def _expand(lo: np.ndarray, sizes: np.ndarray, owner: np.ndarray, cur: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Position ranges [lo, lo + size) as (positions, owner of each, state of each)."""
    return concat_ranges(lo, sizes), np.repeat(owner, sizes), np.repeat(cur, sizes)


class _Cands(NamedTuple):
    """`Walker._candidates`: the candidate tokens of a first-byte-then-chain state."""

    inside: np.ndarray  # tails inside the group, sorted by tail length
    steps: np.ndarray  # their tail lengths (characters with utf8)
    first: np.ndarray  # index in `allowed` of their first byte
    rest: np.ndarray  # other tokens of a chained first byte
    rest_first: np.ndarray  # index in `allowed` of their first byte
    rest_at: np.ndarray  # index of their first byte outside the group (>= 1)
    loose: np.ndarray  # tokens of an unchained first byte
    key: bytes


@dataclass(frozen=True)
class Prefix:
    """The first `cut` entries of `positions`, a sorted-position list shared by many states and
    cached under `key` (its mask rows are built incrementally, one per cut)."""

    key: bytes
    positions: np.ndarray
    cut: int


def _long_leads(tables: TrieTables, min_len: int) -> tuple[np.ndarray, ...]:
    """The tokens longer than `min_len` bytes (sorted positions, first bytes) and their distinct
    first bytes with the [start, end) range of each among them (cached by the tables)."""
    per = tables.derived_cache("long_leads")
    hit = per.get(min_len)
    if hit is None:
        long_pos = np.flatnonzero(tables.lengths > min_len)
        first = tables.columns[0, long_pos].astype(np.int64)
        # the long tokens of one first byte are contiguous (sorted): pairs expand from ranges
        lead, lead_at = np.unique(first, return_index=True)
        hit = (long_pos, first, lead, lead_at, np.append(lead_at[1:], len(first)))
        for a in hit:
            a.flags.writeable = False  # shared by every compile over these tables
        per[min_len] = hit
    return hit


class Walker:
    """Per-compile caches shared by the walks of all states."""

    def __init__(self, dfa: Dfa, tables: TrieTables, tuning: IndexTuning | None = None) -> None:
        self.tuning = tuning or IndexTuning()
        self.dfa = dfa
        self.dead = dfa.dead
        self.trans = dfa.transitions
        self.tflat = self.trans.reshape(-1)
        self.tables = tables
        self.n = len(tables.order)
        self._allowed: dict[int, np.ndarray] = {}
        self._max_len = tables.max_length
        self._chain_memo: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}
        self._steps: dict[bytes, tuple[list[int], list[bool]]] = {}
        self._long: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self._rows: dict[int, list[int]] = {}
        self._inside: dict[bytes, tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray],
                                        tuple[np.ndarray, np.ndarray]]] = {}
        self._uniform: dict[tuple[int, int, int], bool] = {}
        self._cand: dict[bytes, _Cands] = {}

    def num_broad(self, states: np.ndarray, num_candidates: np.ndarray | None = None) -> int:
        """How many of `states` have more candidate tokens than `walk_few` takes."""
        if num_candidates is None:
            num_candidates = self.num_candidates(states)
        return int((num_candidates > self.tuning.walk_tiny).sum())

    @functools.cached_property
    def _class_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(a byte of each byte class, how many tokens start with a byte of that class)."""
        rep, byte_class = self.dfa.byte_classes
        counts = np.bincount(byte_class, weights=self.tables.first_byte_counts, minlength=len(rep))
        return rep, counts.astype(np.int64)

    @functools.cached_property
    def _class_table(self) -> np.ndarray:
        """The transition table with one column per byte class (a byte of each)."""
        return self.dfa.class_table

    @functools.cached_property
    def _class_bytes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per byte class, its bytes in increasing order as a CSR list (bytes, starts, sizes), and
        per byte whether it starts a token."""
        _, byte_class = self.dfa.byte_classes
        k = len(self._class_counts[0])
        by_class = np.argsort(byte_class, kind="stable")  # bytes grouped by class, increasing within
        sizes = np.bincount(byte_class, minlength=k)
        starting = self.tables.first_byte_counts > 0
        return by_class, np.cumsum(sizes) - sizes, sizes, starting

    def _live_bytes(self, states: np.ndarray, starting_only: bool) -> tuple[np.ndarray, np.ndarray]:
        """The (index in `states`, byte) pairs with a live transition, in row-major order (as
        `np.nonzero` of the 256-wide live matrix would give them): found per byte class, then
        expanded to the class's bytes (only those that start a token if `starting_only`)."""
        by_class, lo, sizes, starting = self._class_bytes
        r, c = np.nonzero(self._class_table[states] != self.dead)
        n = sizes[c]
        rows, byte = np.repeat(r, n), by_class[concat_ranges(lo[c], n)]
        if starting_only:
            keep = starting[byte]
            rows, byte = rows[keep], byte[keep]
        order = np.argsort(rows * 256 + byte, kind="stable")
        return rows[order], byte[order]

    def num_candidates(self, states: np.ndarray) -> np.ndarray:
        """Per state: how many tokens start with a byte it allows (per byte class, as a matmul)."""
        _, counts = self._class_counts
        live = self._class_table[states] != self.dead
        return live.astype(np.int64) @ counts

    @functools.cached_property
    def stay_flat(self) -> np.ndarray:
        """The table with a 257th column, "past the end of the token", that keeps the state."""
        return np.hstack([self.trans, np.arange(self.trans.shape[0], dtype=np.int32)[:, None]]).reshape(-1)

    def walk_few(self, states: np.ndarray, num_candidates: np.ndarray | None = None, loops: Loops | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Walk the tokens of those `states` with few candidates together, in batches.

        Returns (which of `states` were walked here, as a bool mask; the owner state and the
        sorted position of every surviving (state, token) pair, grouped by owner). A batch holds
        at most `IndexTuning.walk_batch_pairs` pairs, bounding its memory. The tokens of `loops`' states that
        start with a loop byte are walked from their first byte outside the loop (then
        `num_candidates` counts them so: `Loops.candidates`); those made only of loop bytes are
        left out (the same for every loop state of one loop set: `Loops.only_ids`).
        """
        tables = self.tables
        if num_candidates is None:  # else the caller's `num_candidates(states)`
            num_candidates = self.num_candidates(states)
        small = num_candidates <= self.tuning.walk_tiny
        few = states[small]
        out_owner: list[np.ndarray] = []
        out_pos: list[np.ndarray] = []
        if len(few):
            counts = tables.first_byte_counts
            live_rows, live_first = self._live_bytes(few, starting_only=True)
            loop_row = None
            if loops is not None:
                loop_row = loops.row[few]
                at = loop_row[live_rows]
                drop = at >= 0
                drop[drop] = loops.member[at[drop], live_first[drop]]
                live_rows, live_first = live_rows[~drop], live_first[~drop]
            num_candidates = num_candidates[small]
            starts2 = tables.two_byte_starts
            columns = tables.columns
            # one batch: every state's live bytes
            spans: list[tuple[int, int, int, int]] = [(0, len(live_rows), 0, len(few))]
            if int(num_candidates.sum()) >= self.tuning.walk_batch_pairs:
                batch = np.cumsum(num_candidates) // self.tuning.walk_batch_pairs
                spans = []
                for part in np.split(np.arange(len(few)), np.flatnonzero(np.diff(batch)) + 1):
                    a, b = np.searchsorted(live_rows, [part[0], part[-1] + 1]).tolist() if len(part) else (0, 0)
                    spans.append((a, b, int(part[0]), int(part[-1]) + 1) if len(part) else (a, b, 0, 0))
            for a, b, s0, s1 in spans:
                first = live_first[a:b]
                owners = few[live_rows[a:b]]
                # NOTE: a first byte that starts many tokens has its second byte checked per
                # (state, first byte) before tokens are expanded (a forced key letter: only the
                # tokens of the surviving two-byte prefixes are walked on); the others expand at once
                wide = counts[first] > self.tuning.walk_wide_first
                narrow = ~wide
                idx_n, owner_n, cur_n = _expand(starts2[first[narrow], 0], counts[first[narrow]], owners[narrow],
                                                self.trans[owners[narrow], first[narrow]])
                own_n, pos_n, _ = walk_pairs(idx_n, cur_n, owner_n, 1, columns, self.tflat, self.dead, False)
                first_w, owners_w = first[wide], owners[wide]
                after = self.trans[owners_w, first_w]
                # the one-byte tokens (several if the vocabulary repeats one) survive as they are
                one_pos, one_owner, _ = _expand(starts2[first_w, 0], starts2[first_w, 1] - starts2[first_w, 0],
                                                owners_w, after)
                k, second = self._live_bytes(after, starting_only=False)
                lo = starts2[first_w[k], second + 1]
                idx_w, owner_w, cur_w = _expand(lo, starts2[first_w[k], second + 2] - lo, owners_w[k],
                                                self.trans[after[k], second])
                own_w, pos_w, _ = walk_pairs(idx_w, cur_w, owner_w, 2, columns, self.tflat, self.dead, False)
                own = np.concatenate([one_owner, own_w, own_n])
                pos = np.concatenate([one_pos, pos_w, pos_n])
                rows = loop_row[s0:s1] if loops is not None and loop_row is not None else np.zeros(0, np.int64)
                if loops is not None and (rows >= 0).any():
                    # NOTE: the tokens made only of loop bytes are the caller's (`Loops.only_ids`)
                    l_own, l_pos, l_cur, l_at, _, _ = loops.pairs(rows[rows >= 0], with_only=False)
                    w_own, w_pos = walk_pairs_from(l_pos, l_cur, l_at, l_own, columns, self.tflat, self.dead)
                    own = np.concatenate([own, w_own])
                    pos = np.concatenate([pos, w_pos])
                # NOTE: each owner's pairs contiguous; the walks left them by ending byte (stable)
                order = stable_argsort(own, self.trans.shape[0])
                out_owner.append(own[order])
                out_pos.append(pos[order])
        if not out_owner:
            return small, np.zeros(0, np.int64), np.zeros(0, np.int64)
        return small, np.concatenate(out_owner), np.concatenate(out_pos)

    def walk_long(self, min_len: int, states: np.ndarray | None = None, loops: Loops | None = None,
                  only_done: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The tokens longer than `min_len` bytes allowed in each state, as (state, token id)
        pairs sorted by state (only the states where the bool mask `states` is set, if given).

        States with many such candidates that have a chain (string text) take the ones made
        only of their group's bytes by length, as `walk` does; the tokens of `loops`' states that
        start with a loop byte are walked from their first byte outside the loop (those made only
        of loop bytes taken, but for the loop states `only_done` marks); the other pairs are walked.
        """
        tables = self.tables
        long_pos, first, lead, lead_at, lead_end = _long_leads(tables, min_len)
        empty = np.zeros(0, np.int64)
        if len(long_pos) == 0:
            return empty, empty
        pairs = np.take(self.dfa.class_table[:-1], self.dfa.byte_classes[1][lead], axis=1) != self.dead
        if states is not None:
            pairs &= states[:, None]
        rows, j = np.nonzero(pairs)  # sorted by state
        if loops is not None:  # a loop state's tokens led by a loop byte: below
            r = loops.row[rows]
            drop = r >= 0
            drop[drop] = loops.member[r[drop], lead[j[drop]]]
            rows, j = rows[~drop], j[~drop]
        sizes = lead_end[j] - lead_at[j]
        k = concat_ranges(lead_at[j], sizes)
        owner = np.repeat(rows, sizes)
        num_states = self.trans.shape[0] - 1
        resolved = np.zeros(len(owner), dtype=bool)
        taken = np.zeros(len(owner), dtype=bool)
        bounds = np.searchsorted(owner, np.arange(num_states + 1))
        for q in np.flatnonzero(np.diff(bounds) > self.tuning.walk_long_chain_min).tolist():
            info = self.chain(q)
            if info is None:
                continue
            outside, chain = info
            limit = self._chain_limit(chain)
            inside, length = self._long_inside(long_pos, outside, self._utf8_uniform(outside, chain, limit))
            span = slice(int(bounds[q]), int(bounds[q + 1]))
            ins, short = inside[k[span]], length[k[span]] < limit
            # NOTE: as in `walk`: dead from the chain's first dead entry on; unknown past its end
            resolved[span] = ins if limit < len(chain) else ins & short
            taken[span] = ins & short
        walk = ~resolved
        w_owner, w_pos = owner[walk], long_pos[k[walk]]
        cur = self.trans[w_owner, first[k[walk]]].astype(np.int64)
        at = np.ones(len(w_owner), dtype=np.int64)
        t_owner, t_pos = owner[taken], long_pos[k[taken]]
        if loops is not None:  # from their first byte outside the loop; made only of loop bytes: taken
            l_own, l_pos, l_cur, l_at, o_own, o_pos = loops.pairs(np.arange(len(loops.states)), min_len)
            if only_done is not None:  # those loop states' rows have them already (`Loops.only_ids`)
                keep = ~only_done[loops.row[o_own]]
                o_own, o_pos = o_own[keep], o_pos[keep]
            w_owner, w_pos = np.concatenate([w_owner, l_own]), np.concatenate([w_pos, l_pos])
            cur, at = np.concatenate([cur, l_cur]), np.concatenate([at, l_at])
            t_owner, t_pos = np.concatenate([t_owner, o_own]), np.concatenate([t_pos, o_pos])
        w_own, w_pos = walk_pairs_from(w_pos, cur, at, w_owner, tables.columns, self.tflat, self.dead)
        own = np.concatenate([w_own, t_owner])
        ids = tables.order[np.concatenate([w_pos, t_pos])].astype(np.int64)
        order = np.argsort(own, kind="stable")
        return own[order], ids[order]

    def _long_inside(self, long_pos: np.ndarray, outside: np.ndarray, utf8: bool) -> tuple[np.ndarray, np.ndarray]:
        """For the tokens at `long_pos`: whether made only of the group's bytes (with `utf8`, also
        of complete multi-byte characters), and their length (characters with `utf8`); cached."""
        key = outside.tobytes() + (b"u" if utf8 else b"")
        hit = self._long.get(key)
        if hit is None:
            bs = np.take(self.tables.byte_sets, long_pos, axis=1)
            if utf8:
                chars = self.tables.num_chars[long_pos]
                inside = (((bs[0] & outside[0]) | (bs[1] & outside[1])) == 0) & (chars >= 0)
                length = chars.astype(np.int64)
            else:
                inside = ((bs[0] & outside[0]) | (bs[1] & outside[1]) | (bs[2] & outside[2]) | (bs[3] & outside[3])) == 0
                length = self.tables.lengths[long_pos].astype(np.int64)
            hit = self._long[key] = (inside, length)
        return hit

    def allowed(self, q: int) -> np.ndarray:
        """Bytes that do not lead from `q` to the dead state, memoized."""
        hit = self._allowed.get(q)
        if hit is None:
            hit = self._allowed[q] = np.flatnonzero(self.trans[q] != self.dead).astype(np.int16)
        return hit

    def group_steps(self, group: np.ndarray) -> tuple[list[int], list[bool]]:
        """`group_steps` for every state, memoized per byte group (shared by its chains)."""
        key = group.tobytes()
        hit = self._steps.get(key)
        if hit is None:
            hit = self._steps[key] = group_steps(self.trans, group)
        return hit

    def chain(self, q: int) -> tuple[np.ndarray, np.ndarray] | None:
        """`chain_of` for state `q`, memoized."""
        if q not in self._chain_memo:
            self._chain_memo[q] = chain_of(self.dfa, q, self._max_len, self.group_steps,
                                           self.tuning.min_group_bytes)
        return self._chain_memo[q]

    def _row(self, q: int) -> list[int]:
        row = self._rows.get(q)
        if row is None:
            row = self._rows[q] = self.trans[q].tolist()
        return row

    def _inside_group(self, outside: np.ndarray, utf8: bool) -> tuple[
            np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """(positions made only of the group's bytes sorted by length, their lengths, (the other
        positions with a first byte in the group, the index of their first byte outside it),
        (the positions starting outside the group, their bounds per first byte)), cached: every
        state with this group (each counter value) reuses it.

        With `utf8`, a token may also hold complete multi-byte UTF-8 characters, and "length" is
        its number of characters.
        """
        key = outside.tobytes() + (b"u" if utf8 else b"")
        hit = self._inside.get(key)
        if hit is None:
            bs = self.tables.byte_sets
            if utf8:
                chars = self.tables.num_chars
                inside = (((bs[0] & outside[0]) | (bs[1] & outside[1])) == 0) & (chars >= 0)
                lengths = chars
            else:
                inside = ((bs[0] & outside[0]) | (bs[1] & outside[1]) | (bs[2] & outside[2]) | (bs[3] & outside[3])) == 0
                lengths = self.tables.lengths
            pos_in = np.flatnonzero(inside)
            lens = lengths[pos_in]
            by_len = stable_argsort(lens, int(lens.max(initial=0)) + 1)
            others = np.flatnonzero(~inside)
            first_out = self._first_outside(others, outside)
            at0 = first_out == 0
            later = (others[~at0], first_out[~at0])
            # those leaving the group at their first byte, by first byte (contiguous: sorted)
            zero = others[at0]
            bounds = np.searchsorted(self.tables.columns[0].take(zero), np.arange(257))
            hit = self._inside[key] = (pos_in[by_len], lens[by_len], later, (zero, bounds))
        return hit

    def _first_outside(self, positions: np.ndarray, outside: np.ndarray, start: int = 0) -> np.ndarray:
        """Index (from `start`) of the first byte in the byte set `outside` of each token (its
        length if none)."""
        member = np.ones(257, dtype=bool)  # index 256 (-1: past the end) counts as outside
        member[:256] = np.unpackbits(outside.view(np.uint8), bitorder="little").astype(bool)
        out = np.zeros(len(positions), dtype=np.int64)
        todo = np.arange(len(positions))
        columns = self.tables.columns
        d = start
        while len(todo):  # most tokens leave the group within a few bytes
            found = member[columns[d].take(positions[todo])]
            out[todo[found]] = d
            todo = todo[~found]
            d += 1
        return out

    @functools.cached_property
    def _utf8_next_all(self) -> np.ndarray:
        """Per state: the one state that every valid multi-byte UTF-8 character leads to, or -1.

        Computed for all states at once where each byte range of a sequence steps uniformly
        (one state for the whole range); the other states are checked exactly one by one.
        """
        trans = self.trans
        n = trans.shape[0]
        rep, byte_class = self.dfa.byte_classes
        out = np.full(n, -2, dtype=np.int64)  # -2: no sequence seen yet
        ok = np.ones(n, dtype=bool)
        for lead, *conts in _UTF8_SEQUENCES:
            cur = np.arange(n)
            for lo, hi in (lead, *conts):
                # bytes of one byte class step alike: compare one byte per class in the range
                block = trans[cur[:, None], rep[np.unique(byte_class[lo : hi + 1])][None, :]]
                nxt = trans[cur, lo].astype(np.int64)
                ok &= (block == nxt[:, None]).all(axis=1)
                cur = nxt
            ok &= (out == -2) | (out == cur)
            out = cur
        for q in np.flatnonzero(~ok).tolist():
            out[q] = self._utf8_next_exact(q)
        return out

    def _utf8_next_exact(self, s: int) -> int:
        """`_utf8_next_all[s]` by following every byte range as a set of states."""
        trans = self.trans
        found: set[int] = set()
        for lead, *conts in _UTF8_SEQUENCES:
            cur = np.unique(trans[s, lead[0] : lead[1] + 1])
            for lo, hi in conts:
                cur = np.unique(trans[cur][:, lo : hi + 1])
            found.update(cur.tolist())
            if len(found) > 1:
                break
        return found.pop() if len(found) == 1 else -1

    def _utf8_uniform(self, outside: np.ndarray, chain: np.ndarray, limit: int) -> bool:
        """Whether a multi-byte character steps along `chain` like one byte of its (ASCII) group."""
        if not (outside[2] == _ALL_ONES and outside[3] == _ALL_ONES):  # the group has non-ASCII bytes
            return False
        key = (int(chain[0]), len(chain), limit)
        hit = self._uniform.get(key)
        if hit is None:
            steps = limit if limit < len(chain) else len(chain) - 1
            hit = self._uniform[key] = bool((self._utf8_next_all[chain[:steps]] == chain[1 : steps + 1]).all())
        return hit

    def walk(self, q: int) -> tuple[Prefix | None, np.ndarray]:
        """Sorted positions of every token whose bytes survive from state `q`: a `Prefix` of a
        shared position list (or None), and the other positions."""
        tables = self.tables
        dead = self.dead
        allowed = self.allowed(q)
        num_candidates = int(tables.first_byte_counts[allowed].sum())
        if num_candidates <= self.tuning.walk_tiny_python:
            return None, self._walk_tiny(q, allowed)[0]
        broad = num_candidates > self.tuning.walk_broad * self.n
        chain_info = self.chain(q)
        out_pos: list[np.ndarray] = []
        out_next: list[np.ndarray] = []
        if chain_info is not None and broad:
            # NOTE: tokens made only of bytes of the state's main byte group P follow a known chain
            # of states (one state per length): a cached byte-set test and a lookup, no walk.
            outside, chain = chain_info
            # NOTE: the chain is dead from its first dead entry on, so the group's tokens that
            # survive are those shorter than that entry: a prefix of the length-sorted positions.
            # Where every multi-byte character also steps along the chain (string text), tokens
            # with such characters follow it too, by their number of characters.
            limit = self._chain_limit(chain)
            utf8 = self._utf8_uniform(outside, chain, limit)
            pos_in, lens, (others, first_out), (zero, bounds) = self._inside_group(outside, utf8)
            cut = int(np.searchsorted(lens, limit))
            prefix = Prefix(b"g" + outside.tobytes() + (b"u" if utf8 else b""), pos_in, cut)
            # NOTE: the other tokens follow the chain up to their first byte outside P (all bytes
            # before it are in P), so their walks start there; past the chain's known part they
            # are dead (a dead entry) or walked from the start (no dead entry). Those starting
            # outside P are taken only for the first bytes q allows.
            a = allowed.astype(np.int64)
            lo, hi = bounds[a], bounds[a + 1]
            sizes = hi - lo
            total = int(sizes.sum())
            idx0 = zero[concat_ranges(lo, sizes)]
            known = first_out < limit
            idx = np.concatenate([idx0, others[known]])
            at = np.concatenate([np.zeros(total, np.int64), first_out[known]])
            walk_from(idx, chain[at], at, tables.columns, self.tflat, dead, out_pos, out_next)
            if limit == len(chain):
                rest = np.concatenate([others[~known], pos_in[cut:]])
                walk_vectorized(rest, np.full(len(rest), q, dtype=np.int32), 0, tables.columns, self.tflat,
                                 dead, out_pos, out_next)
            return prefix, concat(out_pos)
        if broad:
            return None, walk_all(q, self.stay_flat, dead, tables)[0]
        if len(allowed) > _FEW_BYTES:
            done, head = self._walk_first_then_chain(q, allowed, out_pos, out_next)
            if done:
                return head, concat(out_pos)
        self._walk_ranges(q, out_pos, out_next)
        return None, concat(out_pos)

    def _candidates(self, allowed: np.ndarray, chained: np.ndarray, outside: np.ndarray, utf8: bool) -> _Cands:
        """Tokens starting with an `allowed` byte, split by whether their tail stays in a byte group.

        Returns the positions whose bytes after the first all lie in the group (outside the byte
        set `outside`) sorted by tail length, with their tail lengths and the index in `allowed`
        of their first byte; the others of a `chained` first byte, with that index and the
        index of their first byte outside the group; the others; the cache key. Cached per (allowed, outside):
        the escape states of every counter value share it. With `utf8` (the allowed bytes are
        ASCII), tails may also hold complete multi-byte characters and lengths count characters.
        """
        key = allowed.tobytes() + chained.tobytes() + outside.tobytes() + (b"u" if utf8 else b"")
        hit = self._cand.get(key)
        if hit is not None:
            return hit
        tables = self.tables
        starts = tables.first_byte_starts
        a = allowed.astype(np.int64)
        lo, hi = starts[a], starts[a + 1]
        sizes = hi - lo
        idx = concat_ranges(lo, sizes)
        first = np.repeat(np.arange(len(a), dtype=np.int64), sizes)  # which allowed byte starts it
        ts = np.take(tables.tail_byte_sets, idx, axis=1)
        if utf8:
            chars = tables.num_chars[idx]
            inside = (((ts[0] & outside[0]) | (ts[1] & outside[1])) == 0) & (chars >= 0)
            steps = chars - 1  # characters after the first (ASCII) byte
        else:
            inside = ((ts[0] & outside[0]) | (ts[1] & outside[1]) | (ts[2] & outside[2]) | (ts[3] & outside[3])) == 0
            steps = tables.lengths[idx] - 1  # bytes after the first one
        inside &= chained[first]  # tokens of an unchained first byte are walked
        idx_in, steps_in, first_in = idx[inside], steps[inside], first[inside]
        order = stable_argsort(steps_in, int(steps_in.max(initial=0)) + 1)
        rest, rest_first = idx[~inside], first[~inside]
        ch = chained[rest_first]
        hit = self._cand[key] = _Cands(idx_in[order], steps_in[order], first_in[order], rest[ch], rest_first[ch],
                                       self._first_outside(rest[ch], outside, 1), rest[~ch], key)
        return hit

    def _walk_first_then_chain(self, q: int, allowed: np.ndarray, out_pos: list[np.ndarray],
                               out_next: list[np.ndarray]) -> tuple[bool, Prefix | None]:
        """One byte, then the chain of the state it leads to (an escape letter, then string text).

        Applies to the allowed first bytes that lead to a state with a chain over one common byte
        group (the others' tokens are walked); returns (False, None) (nothing written) if there is
        none. Where all of them lead to one chain, its tokens are a `Prefix` of the candidates
        sorted by tail length (returned, not written).
        """
        tq = self.trans[q, allowed.astype(np.int64)].tolist()
        targets = sorted(set(tq))
        slot = {t: i for i, t in enumerate(targets)}
        target_of = np.array([slot[t] for t in tq], dtype=np.int64)
        infos = [self.chain(r) for r in targets]
        first = next((i for i in infos if i is not None), None)
        if first is None:
            return False, None
        # per distinct target: chained (a chain over the common group), its chain and limit
        chains = [i[1] if i is not None and np.array_equal(i[0], first[0]) else None for i in infos]
        limits = np.array([-1 if c is None else self._chain_limit(c) for c in chains], dtype=np.int64)
        sizes = np.array([0 if c is None else len(c) for c in chains], dtype=np.int64)
        utf8 = bool(allowed.max() < 0x80) and all(
            c is None or self._utf8_uniform(first[0], c, int(lim)) for c, lim in zip(chains, limits.tolist(), strict=True))
        table = np.full((len(chains), int(sizes.max())), self.dead, dtype=np.int32)
        for k, c in enumerate(chains):
            if c is not None:
                table[k, : len(c)] = c
        target_of = target_of.reshape(-1)
        chained = (limits >= 0)[target_of]
        cands = self._candidates(allowed, chained, first[0], utf8)
        idx_in, steps_in, first_in = cands.inside, cands.steps, cands.first
        # NOTE: as in `walk`: a chain is dead from its first dead entry on; where it has none
        # (limit == its length), longer tails are not known and are walked. The other tokens of
        # a chained first byte follow the chain up to their first byte outside the group.
        t = target_of[cands.rest_first]
        before = cands.rest_at - 1  # group bytes after the first byte
        lim = limits[t]
        known = before < lim
        walk_from(cands.rest[known], table[t[known], before[known]], cands.rest_at[known], self.tables.columns,
                   self.tflat, self.dead, out_pos, out_next)
        todo = [cands.loose, cands.rest[~known & (lim == sizes[t])]]
        prefix = None
        if int((limits >= 0).sum()) == 1:  # one chain: a prefix of the candidates by tail length
            k = int(np.flatnonzero(limits >= 0)[0])
            cut = int(np.searchsorted(steps_in, limits[k]))
            if limits[k] == sizes[k]:
                todo.append(idx_in[cut:])
            prefix = Prefix(b"c" + cands.key, idx_in, cut)
        else:
            tgt = target_of[first_in]
            lim = limits[tgt]
            sel = steps_in < lim
            out_pos.append(idx_in[sel])
            out_next.append(table[tgt[sel], steps_in[sel]])
            todo.append(idx_in[~sel & (lim == sizes[tgt])])
        rest = np.concatenate(todo)
        walk_vectorized(rest, np.full(len(rest), q, dtype=np.int32), 0, self.tables.columns, self.tflat, self.dead,
                         out_pos, out_next)
        return True, prefix

    def _chain_limit(self, chain: np.ndarray) -> int:
        """Index of the first dead entry of `chain` (its length if none)."""
        at = int(np.argmax(chain == self.dead))
        return at if chain[at] == self.dead else len(chain)

    def _walk_tiny(self, q: int, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Plain Python walk of the few tokens whose first byte is allowed."""
        starts = self.tables.first_byte_starts
        toks = self.tables.sorted_tokens
        dead = self.dead
        row_q = self._row(q)
        pos: list[int] = []
        nxt: list[int] = []
        for b in allowed.tolist():
            first = row_q[b]
            for i in range(int(starts[b]), int(starts[b + 1])):
                s = first
                for byte in toks[i][1:]:
                    s = self._row(s)[byte]
                    if s == dead:
                        break
                else:
                    pos.append(i)
                    nxt.append(s)
        return np.asarray(pos, dtype=np.int64), np.asarray(nxt, dtype=np.int32)

    def _walk_ranges(self, q: int, out_pos: list[np.ndarray], out_next: list[np.ndarray]) -> None:
        """Descend the sorted-vocabulary trie by binary search; walk wide ranges with numpy."""
        columns = self.tables.columns
        trans = self.trans
        stack = [(q, 0, self.n, 0)]
        while stack:
            q, lo, hi, d = stack.pop()
            col = columns[d, lo:hi]
            if d > 0:
                e = int(np.searchsorted(col, 0))
                if e:
                    out_pos.append(np.arange(lo, lo + e, dtype=np.int64))
                    out_next.append(np.full(e, q, dtype=np.int32))
                    lo += e
                    col = col[e:]
                    if lo >= hi:
                        continue
            ab = self.allowed(q)
            if len(ab) == 0:
                continue
            lefts = np.searchsorted(col, ab, "left")
            rights = np.searchsorted(col, ab, "right")
            if len(ab) <= _FEW_BYTES and hi - lo > _SMALL_RANGE:
                for b, left, right in zip(ab.tolist(), lefts.tolist(), rights.tolist(), strict=True):
                    if right > left:
                        stack.append((int(trans[q, b]), lo + left, lo + right, d + 1))
                continue
            sizes = rights - lefts
            nz = sizes > 0
            total = int(sizes.sum())
            if total == 0:
                continue
            if total == hi - lo:
                idx = np.arange(lo, hi, dtype=np.int64)
            else:
                # concatenated sub-ranges of the allowed next bytes
                idx = concat_ranges(lefts[nz] + lo, sizes[nz])
            walk_vectorized(idx, np.full(total, q, dtype=np.int32), d, columns, self.tflat, self.dead,
                             out_pos, out_next)
