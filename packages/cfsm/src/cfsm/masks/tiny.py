"""The masks of a small DFA in one walk: all states at once down the vocabulary's trie.

A small regex's DFA (an address, a date: tens of states whose tokens die within a byte or two)
spends most of `build_index`'s general path in fixed per-call work (walk classes, batched and
chained walks, loop, string and format recognition) around a walk of a few hundred (state,
token) pairs. Here every (state, trie node) pair goes down `TrieLevels` level by level, a dead
prefix dropping its subtree, and each distinct token set is packed once: the same masks, for as
long as the pairs stay within a budget (`IndexTuning.tiny_pairs`; past it the general path).
"""

from __future__ import annotations

import numpy as np

from cfsm.automata.automaton import Dfa, concat_ranges
from cfsm.masks.rows import or_row_bits
from cfsm.masks.trie import TrieTables
from cfsm.masks.vocab import Vocabulary

__all__ = ["tiny_rows"]

# a state that steps to itself on a byte whose run (the byte repeated) is a token of more than
# this many bytes walks that deep (whitespace runs: 80 levels, each a few numpy calls): such a
# DFA takes the general path (its loop walks); nor does any walk go past `_MAX_LEVELS` levels
_MAX_RUN = 8
_MAX_LEVELS = 24
# nor one level of more than this share of the pairs (a broad class such as letters: refused
# after a level or two instead of walking most of the budget first)
_LEVEL_SHARE = 4


def _long_runs(tables: TrieTables) -> np.ndarray:
    """The bytes b such that b repeated more than `_MAX_RUN` times is a token (cached by the tables)."""
    per = tables.derived_cache("tiny_long_runs")
    hit = per.get(_MAX_RUN)
    if hit is None:
        bs = tables.byte_sets  # (4, n): one bit set in all = one distinct byte
        one_byte = ((bs != 0).sum(axis=0) == 1) & ((bs & (bs - np.uint64(1))) == 0).all(axis=0)
        hit = per[_MAX_RUN] = np.unique(tables.columns[0, one_byte & (tables.lengths > _MAX_RUN)]).astype(np.int64)
        hit.flags.writeable = False
    return hit  # type: ignore[no-any-return]


def _walk(dfa: Dfa, vocab: Vocabulary, max_pairs: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(owner state, token id) of every token allowed in every state (EOS aside), or None once
    more than `max_pairs` (state, trie node) pairs are visited (or more than `max_pairs // _LEVEL_SHARE`
    on one level) or the walk passes `_MAX_LEVELS`."""
    levels = vocab.trie_levels
    n, dead = dfa.num_states, dfa.dead
    empty = np.zeros(0, np.int64)
    if not levels.byte:
        return empty, empty
    _, of_byte = dfa.byte_classes
    step = np.take(dfa.class_table[:n], of_byte[levels.byte[0]], axis=1)  # (n, nodes of level 0)
    q, k = np.nonzero(step != dead)
    cur = step[q, k].astype(np.int64)
    tflat = dfa.transitions.reshape(-1)
    owners: list[np.ndarray] = []
    los: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    visited = len(q)
    d = 0
    while len(q):
        if visited > max_pairs or d >= _MAX_LEVELS:
            return None
        # the tokens that end at the node (its whole prefix) are allowed: the walk is not dead there
        ends = levels.end_count[d][k]
        has = np.flatnonzero(ends)
        owners.append(q[has])
        los.append(levels.tok_lo[d][k[has]])
        counts.append(ends[has])
        if d + 1 == len(levels.byte):
            break
        lo = levels.child_lo[d][k]
        sizes = levels.child_hi[d][k] - lo
        expand = int(sizes.sum())
        visited += expand
        if visited > max_pairs or expand > max_pairs // _LEVEL_SHARE:
            return None
        kids = concat_ranges(lo, sizes)
        d += 1
        cur = tflat[np.repeat(cur, sizes) * 256 + levels.byte[d][kids]].astype(np.int64)
        alive = cur != dead
        q, k, cur = np.repeat(q, sizes)[alive], kids[alive], cur[alive]
    if not owners:
        return empty, empty
    cnt = np.concatenate(counts)
    tids = vocab.trie_tables.order[concat_ranges(np.concatenate(los), cnt)].astype(np.int64)
    return np.repeat(np.concatenate(owners), cnt), tids


def tiny_rows(dfa: Dfa, vocab: Vocabulary, max_pairs: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(masks, mask_row) of `dfa` over `vocab` as `build_index` defines them (equal masks share a
    row; rows in the order of their first state), or None where the walk would visit more than
    `max_pairs` (state, trie node) pairs or go deep (`_MAX_RUN`, `_MAX_LEVELS`). Mutates nothing
    (builds the vocabulary's trie levels on first use)."""
    n = dfa.num_states
    runs = _long_runs(vocab.trie_tables)
    if len(runs) and (np.take(dfa.transitions[:n], runs, axis=1) == np.arange(n)[:, None]).any():
        return None
    walked = _walk(dfa, vocab, max_pairs)
    if walked is None:
        return None
    owner, tids = walked
    order = np.lexsort((tids, owner))
    owner, tids = owner[order], tids[order]
    bounds = np.searchsorted(owner, np.arange(n + 1)).tolist()
    # NOTE: a state's set, exactly: its sorted ids as bytes (and acceptance, for EOS)
    blob = tids.tobytes()
    size = tids.itemsize
    accepting = dfa.accepting[:n].tolist()
    keys: dict[tuple[bool, bytes], int] = {}
    row_of = [keys.setdefault((accepting[s], blob[size * bounds[s] : size * bounds[s + 1]]), len(keys))
              for s in range(n)]
    firsts = [0] * len(keys)
    for s in range(n - 1, -1, -1):
        firsts[row_of[s]] = s
    lo = np.asarray(bounds, dtype=np.int64)[firsts]
    sizes = np.asarray(bounds[1:], dtype=np.int64)[firsts] - lo
    g = np.repeat(np.arange(len(firsts), dtype=np.int64), sizes)
    t = tids[concat_ranges(lo, sizes)]
    block = np.zeros((len(firsts), vocab.mask_words), dtype=np.uint32)
    or_row_bits(block, g, t)
    acc_rows = np.flatnonzero([accepting[s] for s in firsts])
    for e in vocab.eos_token_ids:
        block[acc_rows, e >> 5] |= np.uint32(1 << (e & 31))
    mask_row = np.full(n + 1, -1, dtype=np.int32)
    mask_row[:n] = row_of
    return block.view(np.int32), mask_row
