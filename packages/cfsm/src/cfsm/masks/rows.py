"""Packing token-id sets into mask rows: grouped batches and incremental prefix rows."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable

import numpy as np

from cfsm.automata.automaton import concat_ranges, unique_rows
from cfsm.masks.walker import Prefix

# token sets larger than this are set through a bool array and packbits (one pass over V/8
# bytes), smaller ones bit by bit (ufunc.at costs per element)
_PACK_MIN = 256
# `pack_rows` packs at most this many uint32 words (rows x row width) at a time (its default)
PACK_CHUNK_WORDS = 1 << 20


def or_row_bits(block: np.ndarray, rows: np.ndarray, tids: np.ndarray) -> None:
    """Set bit `tids[i]` in row `rows[i]` of the uint32 mask rows `block` (in place)."""
    np.bitwise_or.at(block, (rows, tids >> 5), np.left_shift(np.uint32(1), (tids & 31).astype(np.uint32)))


def or_bits(row: np.ndarray, tids: np.ndarray) -> None:
    """Set the bits of token ids `tids` in the uint32 mask row `row` (in place)."""
    if len(tids) > _PACK_MIN:
        bits = np.zeros(row.shape[0] * 32, dtype=bool)
        bits[tids] = True
        row |= np.packbits(bits, bitorder="little").view("<u4")
    elif len(tids):
        np.bitwise_or.at(row, tids >> 5, np.left_shift(np.uint32(1), (tids & 31).astype(np.uint32)))


def few_rows(few: np.ndarray, owner: np.ndarray, pos: np.ndarray, reps: np.ndarray, accepting: np.ndarray,
              order: np.ndarray, is_long: np.ndarray, eos: np.ndarray, class_row: np.ndarray,
              intern: Callable[[np.ndarray], int], words: int, max_id: int | None = None,
              base: tuple[np.ndarray, list[np.ndarray]] | None = None) -> None:
    """Rows of the classes walked in batch (`few`): `class_row[k]` for each of them.

    Token sets are grouped by two 64-bit sums of random per-token weights (with their size), so
    each distinct set is packed once from one representative. `base` (per rep: the index of a
    token-id set, or -1; those sets) adds a set to a rep's tokens (disjoint from its pairs: the
    tokens made only of whitespace of a loop state, `loops.Loops.only_ids`).
    # NOTE: only a collision of both sums and the size (about classes^2 / 2^128) would give two
    # classes one row.
    """
    keep = ~is_long[pos]
    owner, tids = owner[keep], order[pos[keep]].astype(np.int64)
    ks = np.flatnonzero(few)
    k_of = np.full(accepting.shape[0], -1, dtype=np.int64)
    k_of[reps[ks]] = np.arange(len(ks))
    kk = k_of[owner]  # grouped: every owner's pairs are contiguous
    top = int(order.max(initial=0)) if max_id is None else max_id  # `TrieTables.max_id`: order's max
    w1, w2 = token_weights(max(top, int(eos.max(initial=0))) + 1)
    if len(kk):  # where kk changes (np.diff with prepend=-1, without its concatenation)
        change = np.empty(len(kk), dtype=bool)
        change[0] = kk[0] != -1
        np.not_equal(kk[1:], kk[:-1], out=change[1:])
        starts = np.flatnonzero(change)
    else:
        starts = np.zeros(0, np.int64)
    h = np.zeros((3, len(ks)), dtype=np.uint64)
    if len(kk):
        seg = kk[starts]
        h[0, seg] = np.add.reduceat(w1[tids], starts)
        h[1, seg] = np.add.reduceat(w2[tids], starts)
        h[2, seg] = np.diff(np.append(starts, len(kk))).astype(np.uint64)
    base_of = None
    if base is not None:
        base_of = base[0][ks]
        for g, ids in enumerate(base[1]):
            at = base_of == g
            h[0, at] += w1[ids].sum(dtype=np.uint64)
            h[1, at] += w2[ids].sum(dtype=np.uint64)
            h[2, at] += np.uint64(len(ids))
    acc = accepting[reps[ks]]
    h[0, acc] += w1[eos].sum(dtype=np.uint64)
    h[1, acc] += w2[eos].sum(dtype=np.uint64)
    h[2, acc] += np.uint64(len(eos))
    first, inverse = unique_rows(h.T)
    seg_of = np.full(len(ks), -1, dtype=np.int64)
    if len(kk):
        seg_of[kk[starts]] = np.arange(len(starts))
    bounds = np.append(starts, len(kk))
    # every group's (group, token) pairs: its representative's segment, then EOS if accepting
    seg = seg_of[first]
    has = seg >= 0
    ends = np.append(bounds, len(kk))  # one more entry: index seg + 1 exists even without segments
    lo = np.where(has, ends[np.maximum(seg, 0)], 0)
    sizes = np.where(has, ends[np.maximum(seg, 0) + 1] - lo, 0)
    at = concat_ranges(lo, sizes)
    pair_g = np.repeat(np.arange(len(first), dtype=np.int64), sizes)
    pair_t = tids[at]
    acc_g = np.flatnonzero(acc[first])
    if len(acc_g) and len(eos):
        pair_g = np.concatenate([pair_g, np.repeat(acc_g, len(eos))])
        pair_t = np.concatenate([pair_t, np.tile(eos.astype(np.int64), len(acc_g))])
    rows = None
    if base is not None and base_of is not None:
        rows = np.zeros((len(base[1]), words), dtype=np.uint32)
        for g, ids in enumerate(base[1]):
            or_bits(rows[g], ids)
    class_row[ks] = pack_rows(len(first), pair_g, pair_t, words, intern, rows,
                              None if base_of is None else base_of[first])[inverse.reshape(-1)]


def pack_rows(num: int, pair_g: np.ndarray, pair_t: np.ndarray, words: int,
              intern: Callable[[np.ndarray], int], base: np.ndarray | None = None,
              base_idx: np.ndarray | None = None, chunk_words: int = PACK_CHUNK_WORDS) -> np.ndarray:
    """Rows 0..num-1 (uint32, `words` wide; row g starts as `base[base_idx[g]]` where that index
    is >= 0, else zero) with
    token `pair_t[i]` set in row `pair_g[i]`, packed in chunks and interned in order: the
    interned id of each row. `chunk_words`: at most this many words packed at a time."""
    out = np.empty(num, dtype=np.int32)
    if num == 0:
        return out
    chunk = max(1, chunk_words // max(words, 1))
    if num <= chunk:  # one chunk: every pair in it (bits are OR-ed, in any order)
        cuts = np.array([0, len(pair_g)])
    else:
        order = np.argsort(pair_g, kind="stable")
        pair_g, pair_t = pair_g[order], pair_t[order]
        cuts = np.searchsorted(pair_g, np.arange(0, num + chunk, chunk))
    for c, g0 in enumerate(range(0, num, chunk)):
        g1 = min(g0 + chunk, num)
        block = np.zeros((g1 - g0, words), dtype=np.uint32)
        if base is not None and base_idx is not None:
            bi = base_idx[g0:g1]
            block[bi >= 0] = base[bi[bi >= 0]]
        g, t = pair_g[cuts[c] : cuts[c + 1]] - g0, pair_t[cuts[c] : cuts[c + 1]]
        if len(t):
            or_row_bits(block, g, t)
        for j in range(g1 - g0):
            out[g0 + j] = intern(block[j])
    return out


class PrefixRows:
    """Mask rows (tokens of at most `IndexTuning.share_depth` bytes) of prefixes of shared position lists.

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
            or_bits(row, add)
            rows[cut] = row
            cuts.insert(at + 1, cut)
        return row


# NOTE: pure memoization of immutable inputs (a vocabulary size; fixed seed), bounded (4 entries)
@functools.lru_cache(maxsize=4)
def token_weights(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0x70CE5)
    return (rng.integers(1, 2**63, size=n, dtype=np.uint64), rng.integers(1, 2**63, size=n, dtype=np.uint64))
