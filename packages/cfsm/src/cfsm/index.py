"""Token-level `Index`: per DFA state, the allowed tokens as an int32 bitmask row.

Built by walking the vocabulary through the DFA, never token by state one at a time:
- the vocabulary is sorted by bytes, so every trie node is a contiguous range; narrow states
  descend by binary search, states with few candidates are walked together in one batch;
- broad states resolve the tokens made only of their main byte group by a chain lookup (string
  text, counted repeats), and walk the rest with numpy;
- states that agree on every string of up to `_SHARE_DEPTH` bytes share one walk for tokens of
  that length (the few longer tokens are walked for every state in one batch);
- equal rows are stored once. The next state of a token is its bytes walked through the DFA.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from cfsm.automaton import Dfa, _byte_classes
from cfsm.compressed import CompressedFsm
from cfsm.gcpause import without_gc
from cfsm.vocab import TrieTables, Vocabulary

__all__ = ["Index", "build_index"]

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
# narrow branches (at most this many allowed bytes) descend by binary search
_FEW_BYTES = 6
# ranges at most this long are walked directly
_SMALL_RANGE = 24
# states whose main byte group has at least this many bytes resolve its tokens by a chain lookup
_MIN_GROUP_BYTES = 32
# states agreeing on all strings of at most this many bytes share the walk of tokens that short
_SHARE_DEPTH = 16
# token sets up to this size are packed by scattering bits (larger ones through a bool array)
_SPARSE_ROW = 2048
# states with at most this many candidate tokens (allowed first byte) are walked together, in
# batches of at most _BATCH_PAIRS (state, token) pairs
_TINY = 2048
_BATCH_PAIRS = 1 << 20
# a state not walked in a batch, with at most this many candidates, is walked in plain Python
_TINY_PYTHON = 96
# states whose allowed first bytes start more than this share of the vocabulary walk it whole
_BROAD = 0.15


@dataclass(frozen=True, eq=False)
class Index:
    """Compiled grammar over one vocabulary; shared read-only by every `Guide` made from it.

    `masks[mask_row[s]]` is the allowed-token bitmask of DFA state `s` (`ceil(V/32)` int32 words;
    bit `i % 32` of word `i // 32` is token `i`); states with equal masks share a row; EOS is set
    in the masks of accepting states. `mask_row[s]` is -1 for states never reached at a token
    boundary. The next state of an allowed token is its bytes walked through `dfa`.
    """

    vocab: Vocabulary
    dfa: Dfa
    masks: np.ndarray  # (num_rows, ceil(V / 32)) int32
    mask_row: np.ndarray  # (num_states + 1,) int32
    grammar: str = ""

    @property
    def start(self) -> int:
        return self.dfa.start

    @property
    def dead(self) -> int:
        return self.dfa.dead

    @property
    def num_states(self) -> int:
        """States reached at token boundaries (the ones with a mask)."""
        return int((self.mask_row >= 0).sum())

    def is_accepting(self, state: int) -> bool:
        return bool(self.dfa.accepting[state])

    def is_allowed(self, state: int, token_id: int) -> bool:
        """Whether the mask of `state` has `token_id` (EOS included). Pure."""
        row = int(self.mask_row[state])
        if row < 0 or not 0 <= token_id < self.vocab.size:
            return False
        return bool((int(self.masks[row, token_id >> 5]) >> (token_id & 31)) & 1)

    def next_state(self, state: int, token_id: int) -> int:
        """State after non-EOS `token_id` from `state`, or `dead` if not allowed. Pure."""
        if not self.is_allowed(state, token_id) or token_id in self.vocab.special_token_ids:
            return self.dead
        return self.dfa.walk(state, self.vocab.tokens[token_id])

    def allowed_token_ids(self, state: int) -> np.ndarray:
        """Sorted non-EOS token ids allowed in `state`. Pure."""
        bits = np.unpackbits(self.mask(state).view(np.uint8), bitorder="little")[: self.vocab.size]
        ids = np.flatnonzero(bits).astype(np.int32)
        return ids[~np.isin(ids, self.vocab.eos_token_ids)]

    def has_tokens(self, state: int) -> bool:
        """Whether any non-EOS token is allowed in `state`. Pure."""
        return bool(self._row_has_tokens[int(self.mask_row[state])])

    @functools.cached_property
    def _row_has_tokens(self) -> np.ndarray:
        words = self.masks.view(np.uint32).copy()
        for e in self.vocab.eos_token_ids:
            words[:, e >> 5] &= np.uint32(~(1 << (e & 31)) & 0xFFFFFFFF)
        return (words != 0).any(axis=1)

    def mask(self, state: int) -> np.ndarray:
        """The bitmask row of `state` (a view; do not mutate)."""
        row = int(self.mask_row[state])
        if row < 0:
            raise ValueError(f"state {state} is never reached at a token boundary")
        return self.masks[row]

    @functools.cached_property
    def compressed(self) -> CompressedFsm:
        """Forced strings (jump-forward edges) of the DFA, built on first use."""
        return CompressedFsm(self.dfa)

    @functools.cached_property
    def eos_mask(self) -> np.ndarray:
        """Bitmask allowing EOS only (the mask of a finished guide)."""
        bits = np.zeros(self.vocab.mask_words * 32, dtype=bool)
        bits[list(self.vocab.eos_token_ids)] = True
        return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the mask rows, the state map and the DFA."""
        return int(self.masks.nbytes + self.mask_row.nbytes + self.dfa.transitions.nbytes)


class _Cands(NamedTuple):
    """`_Walker._candidates`: the candidate tokens of a first-byte-then-chain state."""

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


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _walk_vectorized(idx: np.ndarray, cur: np.ndarray, j: int, columns: np.ndarray, tflat: np.ndarray,
                     dead: int, out_pos: list[np.ndarray], out_next: list[np.ndarray]) -> None:
    """Walk the tokens at sorted positions `idx` (in states `cur`, `j` bytes read) to their ends."""
    while idx.size:
        b = columns[j].take(idx)
        end = b < 0
        if end.any():
            out_pos.append(idx[end])
            out_next.append(cur[end])
            keep = ~end
            idx, cur, b = idx[keep], cur[keep], b[keep]
        key = cur * 256
        key += b
        cur = tflat.take(key)
        keep = cur != dead
        if not keep.all():
            idx, cur = idx[keep], cur[keep]
        j += 1


def _walk_from(idx: np.ndarray, cur: np.ndarray, at: np.ndarray, columns: np.ndarray, tflat: np.ndarray,
               dead: int, out_pos: list[np.ndarray], out_next: list[np.ndarray]) -> None:
    """Walk the tokens at sorted positions `idx`, each in state `cur` with `at` bytes read."""
    keep = cur != dead
    idx, cur, at = idx[keep], cur[keep], at[keep].copy()
    while idx.size:
        b = columns[at, idx]
        end = b < 0
        if end.any():
            out_pos.append(idx[end])
            out_next.append(cur[end])
            keep = ~end
            idx, cur, at, b = idx[keep], cur[keep], at[keep], b[keep]
        key = cur.astype(np.int64) * 256
        key += b
        cur = tflat.take(key)
        keep = cur != dead
        if not keep.all():
            idx, cur, at = idx[keep], cur[keep], at[keep]
        at += 1


def _walk_pairs(idx: np.ndarray, cur: np.ndarray, owner: np.ndarray, j: int, columns: np.ndarray,
                tflat: np.ndarray, dead: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Walk (owner state, token) pairs together: (owners, positions, next states) of the
    surviving pairs, sorted by owner."""
    keep = cur != dead
    idx, cur, owner = idx[keep], cur[keep], owner[keep]
    out_owner: list[np.ndarray] = []
    out_pos: list[np.ndarray] = []
    out_next: list[np.ndarray] = []
    while idx.size:
        b = columns[j].take(idx)
        end = b < 0
        if end.any():
            out_owner.append(owner[end])
            out_pos.append(idx[end])
            out_next.append(cur[end])
            keep = ~end
            idx, cur, owner, b = idx[keep], cur[keep], owner[keep], b[keep]
        key = cur * 256
        key += b
        cur = tflat.take(key)
        keep = cur != dead
        idx, cur, owner = idx[keep], cur[keep], owner[keep]
        j += 1
    if not out_owner:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty.astype(np.int32)
    all_owner = np.concatenate(out_owner)
    order = np.argsort(all_owner, kind="stable")
    return all_owner[order], np.concatenate(out_pos)[order], np.concatenate(out_next)[order]


def _walk_owned(idx: np.ndarray, cur: np.ndarray, owner: np.ndarray, j: int, columns: np.ndarray,
                tflat: np.ndarray, dead: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """`_walk_pairs` split per owner: (owner, sorted positions, next states)."""
    all_owner, all_pos, all_next = _walk_pairs(idx, cur, owner, j, columns, tflat, dead)
    if not len(all_owner):
        return []
    cuts = np.flatnonzero(np.diff(all_owner)) + 1
    return [(int(o[0]), p, x) for o, p, x in zip(np.split(all_owner, cuts), np.split(all_pos, cuts),
                                                 np.split(all_next, cuts), strict=True)]


def _depth_classes(dfa: Dfa, depth: int, rep: np.ndarray | None = None) -> list[np.ndarray]:
    """Per d in 0..depth: classes of states that agree on every byte string of at most d bytes.

    Two states agree when, after any such string, both are dead or both are live with the same
    acceptance; so every token of at most d bytes is allowed in both or in neither. Moore rounds
    on two 64-bit signatures `h[p] = sum_j w_j * cls[succ_j(p)]`, updated only for the
    predecessors of states whose class changed; only classes holding such a state are re-sorted.
    # NOTE: only a collision of both signatures (about rounds * states^2 / 2^128) would merge
    # two classes.
    """
    trans = dfa.transitions
    if rep is None:  # a representative byte of each byte class
        rep = _byte_classes(trans)[0]
    cols = trans[:, rep]
    n, k = cols.shape
    cls = dfa.accepting.astype(np.int64)
    cls[dfa.dead] = 2
    rng = np.random.default_rng(0xC1A55)
    w = rng.integers(1, 2**63, size=(2, k), dtype=np.uint64)
    succ = cls[cols].astype(np.uint64)
    h = np.stack([(succ * w[0]).sum(axis=1, dtype=np.uint64), (succ * w[1]).sum(axis=1, dtype=np.uint64)])
    # reverse edges grouped by target, but for those into the dead state (alone in its class
    # from the start, it never changes class)
    flat_dst = cols.reshape(-1).astype(np.int64)
    edge = np.flatnonzero(flat_dst != dfa.dead)
    edge = edge[np.argsort(flat_dst[edge], kind="stable")]
    edge_src, edge_w = edge // k, w[:, edge % k]
    bounds = np.searchsorted(flat_dst[edge], np.arange(n + 1))
    num = 3
    out = [cls.copy()]
    sub = np.arange(n)
    while len(out) <= depth:
        o = sub[np.lexsort((h[1, sub], h[0, sub], cls[sub]))]
        m = len(o)
        c_s, h0_s, h1_s = cls[o], h[0, o], h[1, o]
        new_group = np.ones(m, dtype=bool)
        new_group[1:] = (c_s[1:] != c_s[:-1]) | (h0_s[1:] != h0_s[:-1]) | (h1_s[1:] != h1_s[:-1])
        split = new_group.copy()
        split[1:] &= c_s[1:] == c_s[:-1]  # a group start that is not its class's first group
        split[0] = False
        num_new = int(split.sum())
        if num_new == 0:
            break
        group_start = np.maximum.accumulate(np.where(new_group, np.arange(m), 0))
        fresh = split[group_start]
        changed = o[fresh]
        new_ids = num + np.cumsum(split)[group_start[fresh]] - 1
        delta = (new_ids - cls[changed]).astype(np.uint64)  # positive: fresh ids are the largest
        cls[changed] = new_ids
        num += num_new
        out.append(cls.copy())
        lo, hi = bounds[changed], bounds[changed + 1]
        sizes = hi - lo
        total = int(sizes.sum())
        if not total:
            break
        offsets = np.cumsum(sizes) - sizes
        idx = np.repeat(lo - offsets, sizes) + np.arange(total, dtype=np.int64)
        touched = edge_src[idx]
        step = np.repeat(delta, sizes)
        np.add.at(h[0], touched, edge_w[0, idx] * step)
        np.add.at(h[1], touched, edge_w[1, idx] * step)
        hit = np.zeros(num, dtype=bool)
        hit[cls[touched]] = True
        sub = np.flatnonzero(hit[cls])
    out.extend([cls] * (depth + 1 - len(out)))
    return out


def _walk_classes(dfa: Dfa, tables: TrieTables, depth: int) -> np.ndarray:
    """Classes of states whose tokens of at most `depth` bytes are allowed alike (one walk each).

    A state's tokens of at most `depth` bytes all have at most D bytes, D the longest such token
    starting with a byte it allows; two states with the same D that agree on every string of at
    most D bytes (same allowed first bytes included) allow the same of those tokens. So states
    whose candidates are short (UTF-8 continuations, escapes) share walks across counter values
    that a `depth`-byte agreement would keep apart.
    """
    n = dfa.num_states
    short = np.where(tables.lengths <= depth, tables.lengths, 0)
    starts = tables.first_byte_starts
    longest = np.zeros(256, dtype=np.int64)
    nonempty = np.flatnonzero(starts[1:] > starts[:-1])
    if len(nonempty):
        longest[nonempty] = np.maximum.reduceat(short, starts[nonempty])
    rep, byte_class = _byte_classes(dfa.transitions)
    by_depth = _depth_classes(dfa, depth, rep)
    longest_of_class = np.zeros(len(rep), dtype=np.int64)
    np.maximum.at(longest_of_class, byte_class, longest)
    d = np.where(dfa.transitions[:n, rep] != dfa.dead, longest_of_class[None, :], 0).max(axis=1)
    cls = np.zeros(n, dtype=np.int64)
    for v in np.unique(d).tolist():
        at = d == v
        cls[at] = by_depth[v][:n][at]
    _, cls = np.unique(d * (int(cls.max()) + 1) + cls, return_inverse=True)
    return cls.reshape(-1)


def _walk_all(q: int, stay_flat: np.ndarray, dead: int, tables: TrieTables) -> tuple[np.ndarray, np.ndarray]:
    """Walk every token at once (no compaction): contiguous slices of the length-sorted table."""
    n = len(tables.order)
    cur = np.full(n, q, dtype=np.int32)
    cols = tables.length_columns
    for d, m in enumerate(tables.length_counts.tolist()):
        head = cur[:m]
        head *= 257
        head += cols[d, :m]
        cur[:m] = stay_flat[head]
    alive = np.flatnonzero(cur != dead)
    return tables.by_length[alive].astype(np.int64), cur[alive]


class _Walker:
    """Per-compile caches shared by the walks of all states."""

    def __init__(self, dfa: Dfa, tables: TrieTables) -> None:
        self.dfa = dfa
        self.dead = dfa.dead
        self.trans = dfa.transitions
        self.tflat = self.trans.reshape(-1)
        self.tables = tables
        self.n = len(tables.order)
        self._allowed: dict[int, np.ndarray] = {}
        self._max_len = int(tables.lengths.max()) if self.n else 0
        self._chain_memo: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}
        self._steps: dict[bytes, tuple[list[int], list[bool]]] = {}
        # a 257th column: "past the end of the token" keeps the state
        self.stay_flat = np.hstack([self.trans, np.arange(self.trans.shape[0], dtype=np.int32)[:, None]]).reshape(-1)
        self._rows: dict[int, list[int]] = {}
        self._inside: dict[bytes, tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray],
                                        tuple[np.ndarray, np.ndarray]]] = {}
        self._uniform: dict[tuple[int, int, int], bool] = {}
        self._cand: dict[bytes, _Cands] = {}

    def walk_few(self, states: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Walk the tokens of those `states` with few candidates together, in batches.

        Returns (which of `states` were walked here, as a bool mask; the owner state and the
        sorted position of every surviving (state, token) pair, grouped by owner). A batch holds
        at most `_BATCH_PAIRS` pairs, bounding its memory.
        """
        tables = self.tables
        counts = tables.first_byte_counts
        live = (self.trans[states] != self.dead) & (counts > 0)[None, :]
        num_candidates = (live * counts[None, :]).sum(axis=1)
        small = num_candidates <= _TINY
        few = states[small]
        out_owner: list[np.ndarray] = []
        out_pos: list[np.ndarray] = []
        if len(few):
            live, num_candidates = live[small], num_candidates[small]
            batch = np.cumsum(num_candidates) // _BATCH_PAIRS
            cuts = np.flatnonzero(np.diff(batch)) + 1
            for part in np.split(np.arange(len(few)), cuts):
                rows, bytes_ = np.nonzero(live[part])
                owners = few[part][rows]
                lo = tables.first_byte_starts[bytes_]
                sizes = counts[bytes_]
                total = int(sizes.sum())
                offsets = np.cumsum(sizes) - sizes
                idx = np.repeat(lo - offsets, sizes) + np.arange(total, dtype=np.int64)
                owner = np.repeat(owners, sizes)
                cur = self.trans[owner, np.repeat(bytes_, sizes)]
                own, pos, _ = _walk_pairs(idx, cur, owner, 1, tables.columns, self.tflat, self.dead)
                out_owner.append(own)
                out_pos.append(pos)
        if not out_owner:
            return small, np.zeros(0, np.int64), np.zeros(0, np.int64)
        return small, np.concatenate(out_owner), np.concatenate(out_pos)

    def walk_long(self, min_len: int) -> dict[int, np.ndarray]:
        """Token ids longer than `min_len` bytes allowed in each state (states with none left out)."""
        tables = self.tables
        long_pos = np.flatnonzero(tables.lengths > min_len)
        if len(long_pos) == 0:
            return {}
        first = tables.columns[0, long_pos].astype(np.int64)
        ok = self.trans[:-1][:, first] != self.dead  # (num_states, num_long)
        owner, k = np.nonzero(ok)
        cur = self.trans[owner, first[k]]
        out: dict[int, np.ndarray] = {}
        for own, pos, _ in _walk_owned(long_pos[k], cur, owner, 1, tables.columns, self.tflat, self.dead):
            out[own] = tables.order[pos]
        return out

    def allowed(self, q: int) -> np.ndarray:
        """Bytes that do not lead from `q` to the dead state, memoized."""
        hit = self._allowed.get(q)
        if hit is None:
            hit = self._allowed[q] = np.flatnonzero(self.trans[q] != self.dead).astype(np.int16)
        return hit

    def _group_steps(self, group: np.ndarray) -> tuple[list[int], list[bool]]:
        """`_group_steps` for every state, memoized per byte group (shared by its chains)."""
        key = group.tobytes()
        hit = self._steps.get(key)
        if hit is None:
            hit = self._steps[key] = _group_steps(self.trans, group)
        return hit

    def chain(self, q: int) -> tuple[np.ndarray, np.ndarray] | None:
        """`_chain_of` for state `q`, memoized."""
        if q not in self._chain_memo:
            self._chain_memo[q] = _chain_of(self.dfa, q, self._max_len, self._group_steps)
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
            by_len = np.argsort(lens, kind="stable")
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
        rep, byte_class = _byte_classes(trans)
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
        if num_candidates <= _TINY_PYTHON:
            return None, self._walk_tiny(q, allowed)[0]
        broad = num_candidates > _BROAD * self.n
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
            offsets = np.cumsum(sizes) - sizes
            idx0 = zero[np.repeat(lo - offsets, sizes) + np.arange(total, dtype=np.int64)]
            known = first_out < limit
            idx = np.concatenate([idx0, others[known]])
            at = np.concatenate([np.zeros(total, np.int64), first_out[known]])
            _walk_from(idx, chain[at], at, tables.columns, self.tflat, dead, out_pos, out_next)
            if limit == len(chain):
                rest = np.concatenate([others[~known], pos_in[cut:]])
                _walk_vectorized(rest, np.full(len(rest), q, dtype=np.int32), 0, tables.columns, self.tflat,
                                 dead, out_pos, out_next)
            return prefix, _concat(out_pos)
        if broad:
            return None, _walk_all(q, self.stay_flat, dead, tables)[0]
        if len(allowed) > _FEW_BYTES:
            done, head = self._walk_first_then_chain(q, allowed, out_pos, out_next)
            if done:
                return head, _concat(out_pos)
        self._walk_ranges(q, out_pos, out_next)
        return None, _concat(out_pos)

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
        total = int(sizes.sum())
        offsets = np.cumsum(sizes) - sizes
        idx = np.repeat(lo - offsets, sizes) + np.arange(total, dtype=np.int64)
        first = np.repeat(np.arange(len(a), dtype=np.int64), sizes)  # which allowed byte starts it
        ts = tables.tail_byte_sets[:, idx]
        if utf8:
            chars = tables.num_chars[idx]
            inside = (((ts[0] & outside[0]) | (ts[1] & outside[1])) == 0) & (chars >= 0)
            steps = chars - 1  # characters after the first (ASCII) byte
        else:
            inside = ((ts[0] & outside[0]) | (ts[1] & outside[1]) | (ts[2] & outside[2]) | (ts[3] & outside[3])) == 0
            steps = tables.lengths[idx] - 1  # bytes after the first one
        inside &= chained[first]  # tokens of an unchained first byte are walked
        idx_in, steps_in, first_in = idx[inside], steps[inside], first[inside]
        order = np.argsort(steps_in, kind="stable")
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
        _walk_from(cands.rest[known], table[t[known], before[known]], cands.rest_at[known], self.tables.columns,
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
        _walk_vectorized(rest, np.full(len(rest), q, dtype=np.int32), 0, self.tables.columns, self.tflat, self.dead,
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
                starts, lens = lefts[nz] + lo, sizes[nz]
                offsets = np.cumsum(lens) - lens
                idx = np.repeat(starts - offsets, lens) + np.arange(total, dtype=np.int64)
            _walk_vectorized(idx, np.full(total, q, dtype=np.int32), d, columns, self.tflat, self.dead,
                             out_pos, out_next)


def _group_steps(trans: np.ndarray, group: np.ndarray) -> tuple[list[int], list[bool]]:
    """Per state: where the first byte of `group` leads, and whether every byte of it leads there."""
    nxt = trans[:, group[0]]
    return nxt.tolist(), (trans[:, group] == nxt[:, None]).all(axis=1).tolist()


def _chain_of(dfa: Dfa, q: int, max_len: int,
              steps_of: Callable[[np.ndarray], tuple[list[int], list[bool]]] | None = None
              ) -> tuple[np.ndarray, np.ndarray] | None:
    """For a broad state q: (complement of its main byte group P as 4 uint64 words, chain).

    P is the largest set of bytes leading from q to one state; `chain[k]` is the state after any
    k bytes of P, for every k < len(chain) (the chain stops where P's bytes stop agreeing).
    None when P has fewer than `_MIN_GROUP_BYTES` bytes.
    """
    trans = dfa.transitions
    dead = dfa.dead
    if q == dead:
        return None
    row = trans[q]
    counts = np.bincount(row, minlength=dead + 1)
    counts[dead] = 0
    main = int(counts.argmax())
    if counts[main] < _MIN_GROUP_BYTES:
        return None
    group = np.flatnonzero(row == main)
    nxt, uniform = steps_of(group) if steps_of is not None else _group_steps(trans, group)
    chain = [q, main]
    while len(chain) <= max_len:
        cur = chain[-1]
        if cur == dead:
            chain.extend([dead] * (max_len + 1 - len(chain)))
            break
        if not uniform[cur]:
            break
        if nxt[cur] == cur:  # a self-loop: the chain stays here
            chain.extend([cur] * (max_len + 1 - len(chain)))
            break
        chain.append(nxt[cur])
    member = np.zeros(256, dtype=bool)
    member[group] = True
    words = np.packbits(~member, bitorder="little").view("<u8").astype(np.uint64)
    return words, np.asarray(chain, dtype=np.int32)


def _few_rows(few: np.ndarray, owner: np.ndarray, pos: np.ndarray, reps: np.ndarray, accepting: np.ndarray,
              order: np.ndarray, is_long: np.ndarray, eos: np.ndarray, class_row: np.ndarray,
              intern: Callable[[np.ndarray], int]) -> None:
    """Rows of the classes walked in batch (`few`): `class_row[k]` for each of them.

    Token sets are grouped by two 64-bit sums of random per-token weights (with their size), so
    each distinct set is packed once from one representative.
    # NOTE: only a collision of both sums and the size (about classes^2 / 2^128) would give two
    # classes one row.
    """
    keep = ~is_long[pos]
    owner, tids = owner[keep], order[pos[keep]].astype(np.int64)
    ks = np.flatnonzero(few)
    k_of = np.full(accepting.shape[0], -1, dtype=np.int64)
    k_of[reps[ks]] = np.arange(len(ks))
    kk = k_of[owner]  # grouped: every owner's pairs are contiguous
    w1, w2 = _token_weights(int(max(order.max(initial=0), eos.max(initial=0))) + 1)
    starts = np.flatnonzero(np.diff(kk, prepend=-1)) if len(kk) else np.zeros(0, np.int64)
    h = np.zeros((3, len(ks)), dtype=np.uint64)
    if len(kk):
        seg = kk[starts]
        h[0, seg] = np.add.reduceat(w1[tids], starts)
        h[1, seg] = np.add.reduceat(w2[tids], starts)
        h[2, seg] = np.diff(np.append(starts, len(kk))).astype(np.uint64)
    acc = accepting[reps[ks]]
    h[0, acc] += w1[eos].sum(dtype=np.uint64)
    h[1, acc] += w2[eos].sum(dtype=np.uint64)
    h[2, acc] += np.uint64(len(eos))
    _, first, inverse = np.unique(h.T, axis=0, return_index=True, return_inverse=True)
    seg_of = np.full(len(ks), -1, dtype=np.int64)
    if len(kk):
        seg_of[kk[starts]] = np.arange(len(starts))
    bounds = np.append(starts, len(kk))
    group_row = np.empty(len(first), dtype=np.int32)
    for g, k in enumerate(first.tolist()):
        i = int(seg_of[k])
        t = tids[bounds[i] : bounds[i + 1]] if i >= 0 else np.zeros(0, np.int64)
        if acc[k]:
            t = np.concatenate([t, eos.astype(np.int64)])
        group_row[g] = intern(t)
    class_row[ks] = group_row[inverse.reshape(-1)]


class _PrefixRows:
    """Mask rows (tokens of at most `_SHARE_DEPTH` bytes) of prefixes of shared position lists.

    Per list, the rows of the cuts asked for so far are kept; a new cut starts from the row of
    the largest smaller one and adds the tokens in between.
    """

    def __init__(self, order: np.ndarray, is_long: np.ndarray, words: int) -> None:
        self.order = order
        self.is_long = is_long
        self.words = words
        self._lists: dict[bytes, tuple[np.ndarray, np.ndarray, list[int], dict[int, np.ndarray]]] = {}

    def row(self, prefix: Prefix) -> np.ndarray:
        hit = self._lists.get(prefix.key)
        if hit is None:
            keep = ~self.is_long[prefix.positions]
            tids = self.order[prefix.positions[keep]].astype(np.int64)
            short_before = np.concatenate([[0], np.cumsum(keep)])  # cut -> cut among short tokens
            hit = self._lists[prefix.key] = (tids, short_before, [0], {0: np.zeros(self.words, dtype=np.uint32)})
        tids, short_before, cuts, rows = hit
        cut = int(short_before[prefix.cut])
        row = rows.get(cut)
        if row is None:
            at = bisect.bisect_right(cuts, cut) - 1
            row = rows[cuts[at]].copy()
            add = tids[cuts[at] : cut]
            np.bitwise_or.at(row, add >> 5, np.left_shift(np.uint32(1), (add & 31).astype(np.uint32)))
            rows[cut] = row
            cuts.insert(at + 1, cut)
        return row


@functools.lru_cache(maxsize=4)
def _token_weights(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0x70CE5)
    return (rng.integers(1, 2**63, size=n, dtype=np.uint64), rng.integers(1, 2**63, size=n, dtype=np.uint64))


@without_gc
def build_index(dfa: Dfa, vocab: Vocabulary, grammar: str = "") -> Index:
    """Compile `dfa` against `vocab` into an `Index`. Mutates nothing (caches vocab tables).

    States that agree on every string of at most `_SHARE_DEPTH` bytes share one walk for the
    tokens of that length; the few longer tokens are walked for every state in one batch.
    Every live state gets a mask row.
    """
    tables = vocab.trie_tables
    num_states = dfa.num_states
    walker = _Walker(dfa, tables)
    words = vocab.mask_words
    eos = np.asarray(vocab.eos_token_ids, dtype=np.int64)
    classes = _walk_classes(dfa, tables, _SHARE_DEPTH)
    _, reps, class_of = np.unique(classes, return_index=True, return_inverse=True)
    is_long = tables.lengths > _SHARE_DEPTH
    eos32 = eos.astype(np.int32)
    rows: dict[bytes, int] = {}
    small_rows: dict[bytes, int] = {}
    row_list: list[np.ndarray] = []
    bits = np.zeros(words * 32, dtype=bool)

    def intern(row: np.ndarray) -> int:
        key = row.tobytes()
        r = rows.get(key)
        if r is None:
            r = rows[key] = len(row_list)
            row_list.append(row.view(np.int32))
        return r

    def sparse_row(tids: np.ndarray) -> np.ndarray:
        row = np.zeros(words, dtype=np.uint32)
        np.bitwise_or.at(row, tids >> 5, np.left_shift(np.uint32(1), (tids & 31).astype(np.uint32)))
        return row

    # one row per class (acceptance, hence EOS, is the same in the whole class)
    class_row = np.empty(len(reps), dtype=np.int32)
    few, owner, pos = walker.walk_few(reps.astype(np.int64))
    if few.any():
        _few_rows(few, owner, pos, reps, dfa.accepting, tables.order, is_long, eos32, class_row,
                  lambda tids: intern(sparse_row(tids)))
    prefix_rows = _PrefixRows(tables.order, is_long, words)
    for k in np.flatnonzero(~few).tolist():
        rep = int(reps[k])
        prefix, pos = walker.walk(rep)
        tids = tables.order[pos[~is_long[pos]]]
        if dfa.accepting[rep]:
            tids = np.concatenate([tids, eos32])
        if prefix is not None:
            row = prefix_rows.row(prefix).copy()
            np.bitwise_or.at(row, tids >> 5, np.left_shift(np.uint32(1), (tids & 31).astype(np.uint32)))
            r = intern(row)
        elif len(tids) <= _SPARSE_ROW:  # keyed by the sorted ids: equal sets are packed once
            key = np.sort(tids).tobytes()
            hit = small_rows.get(key)
            r = small_rows[key] = intern(sparse_row(tids)) if hit is None else hit
        else:
            bits[:] = False
            bits[tids] = True
            r = intern(np.packbits(bits, bitorder="little").view("<u4").copy())
        class_row[k] = r
    mask_row = np.full(num_states + 1, -1, dtype=np.int32)
    mask_row[:num_states] = class_row[class_of.reshape(-1)]
    # the few tokens longer than _SHARE_DEPTH bytes, walked for every state in one batch
    for s_, extra in walker.walk_long(_SHARE_DEPTH).items():
        row = row_list[int(mask_row[s_])].view(np.uint32).copy()
        np.bitwise_or.at(row, extra >> 5, np.left_shift(np.uint32(1), (extra & 31).astype(np.uint32)))
        mask_row[s_] = intern(row)
    masks = np.stack(row_list) if row_list else np.zeros((0, words), dtype=np.int32)
    return Index(vocab=vocab, dfa=dfa, masks=masks, mask_row=mask_row, grammar=grammar)
