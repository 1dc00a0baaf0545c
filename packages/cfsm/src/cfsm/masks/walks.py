"""Vectorized token walks over the sorted vocabulary, and the chains of counted repeats.

A walk follows many (state, token) pairs through the DFA one byte column at a time, dropping
pairs that die; a chain is the sequence of states a run of one byte group steps through.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cfsm.automata.automaton import Dfa, stable_argsort
from cfsm.config import IndexTuning
from cfsm.masks.trie import TrieTables

# states whose main byte group has at least `IndexTuning.min_group_bytes` bytes resolve its
# tokens by a chain lookup

def concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def walk_vectorized(idx: np.ndarray, cur: np.ndarray, j: int, columns: np.ndarray, tflat: np.ndarray,
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


def walk_from(idx: np.ndarray, cur: np.ndarray, at: np.ndarray, columns: np.ndarray, tflat: np.ndarray,
               dead: int, out_pos: list[np.ndarray], out_next: list[np.ndarray]) -> None:
    """Walk the tokens at sorted positions `idx`, each in state `cur` with `at` bytes read."""
    keep = cur != dead
    n = columns.shape[1]
    flat = columns.reshape(-1)
    idx, cur = idx[keep], cur[keep].astype(np.int64)
    lin = at[keep] * n + idx  # flat index of the next byte of each token
    while idx.size:
        b = flat.take(lin)
        end = b < 0
        if end.any():
            out_pos.append(idx[end])
            out_next.append(cur[end])
            keep = ~end
            idx, cur, lin, b = idx[keep], cur[keep], lin[keep], b[keep]
        cur *= 256
        cur += b
        cur = tflat.take(cur).astype(np.int64)
        keep = cur != dead
        if not keep.all():
            idx, cur, lin = idx[keep], cur[keep], lin[keep]
        lin += n


def walk_pairs(idx: np.ndarray, cur: np.ndarray, owner: np.ndarray, j: int, columns: np.ndarray,
                tflat: np.ndarray, dead: int, by_owner: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Walk (owner state, token) pairs together: (owners, positions, next states) of the
    surviving pairs, sorted by owner (stable: by the byte where they end, then as given); without
    `by_owner`, by that byte only (a caller that sorts by owner stably afterwards gets the same)."""
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
    if not by_owner:
        return all_owner, np.concatenate(out_pos), np.concatenate(out_next)
    order = stable_argsort(all_owner, int(all_owner.max()) + 1)
    return all_owner[order], np.concatenate(out_pos)[order], np.concatenate(out_next)[order]


def _walk_owned(idx: np.ndarray, cur: np.ndarray, owner: np.ndarray, j: int, columns: np.ndarray,
                tflat: np.ndarray, dead: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """`walk_pairs` split per owner: (owner, sorted positions, next states)."""
    all_owner, all_pos, all_next = walk_pairs(idx, cur, owner, j, columns, tflat, dead)
    if not len(all_owner):
        return []
    cuts = np.flatnonzero(np.diff(all_owner)) + 1
    return [(int(o[0]), p, x) for o, p, x in zip(np.split(all_owner, cuts), np.split(all_pos, cuts),
                                                 np.split(all_next, cuts), strict=True)]


def walk_all(q: int, stay_flat: np.ndarray, dead: int, tables: TrieTables) -> tuple[np.ndarray, np.ndarray]:
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


def group_steps(trans: np.ndarray, group: np.ndarray) -> tuple[list[int], list[bool]]:
    """Per state: where the first byte of `group` leads, and whether every byte of it leads there."""
    nxt = trans[:, group[0]]
    return nxt.tolist(), (np.take(trans, group, axis=1) == nxt[:, None]).all(axis=1).tolist()


def chain_of(dfa: Dfa, q: int, max_len: int,
              steps_of: Callable[[np.ndarray], tuple[list[int], list[bool]]] | None = None,
              min_group: int = IndexTuning.min_group_bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """For a broad state q: (complement of its main byte group P as 4 uint64 words, chain).

    P is the largest set of bytes leading from q to one state; `chain[k]` is the state after any
    k bytes of P, for every k < len(chain) (the chain stops where P's bytes stop agreeing).
    None when P has fewer than `min_group` bytes (`IndexTuning.min_group_bytes`).
    """
    trans = dfa.transitions
    dead = dfa.dead
    if q == dead:
        return None
    row = trans[q]
    counts = np.bincount(row, minlength=dead + 1)
    counts[dead] = 0
    main = int(counts.argmax())
    if counts[main] < min_group:
        return None
    group = np.flatnonzero(row == main)
    nxt, uniform = steps_of(group) if steps_of is not None else group_steps(trans, group)
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


def walk_pairs_from(idx: np.ndarray, cur: np.ndarray, at: np.ndarray, owner: np.ndarray, columns: np.ndarray,
                     tflat: np.ndarray, dead: int) -> tuple[np.ndarray, np.ndarray]:
    """Walk (owner state, token) pairs, each token at sorted position `idx` in state `cur` with
    `at` bytes read: (owners, positions) of the surviving pairs, in no particular order."""
    keep = cur != dead
    n = columns.shape[1]
    flat = columns.reshape(-1)
    idx, cur, owner = idx[keep], cur[keep].astype(np.int64), owner[keep]
    lin = at[keep] * n + idx  # flat index of the next byte of each token
    out_owner: list[np.ndarray] = []
    out_pos: list[np.ndarray] = []
    while idx.size:
        b = flat.take(lin)
        end = b < 0
        if end.any():
            out_owner.append(owner[end])
            out_pos.append(idx[end])
            keep = ~end
            idx, cur, lin, owner, b = idx[keep], cur[keep], lin[keep], owner[keep], b[keep]
        cur *= 256
        cur += b
        cur = tflat.take(cur).astype(np.int64)
        keep = cur != dead
        if not keep.all():
            idx, cur, lin, owner = idx[keep], cur[keep], lin[keep], owner[keep]
        lin += n
    return concat(out_owner), concat(out_pos)
