"""Classes of DFA states that share one token walk."""

from __future__ import annotations

import numpy as np

from cfsm.automata.automaton import Dfa, in_edges, split_round, stable_argsort
from cfsm.masks.trie import TrieTables


def _depth_classes(dfa: Dfa, depth: int, rep: np.ndarray | None = None) -> list[np.ndarray]:
    """Per d in 0..depth: classes of states that agree on every byte string of at most d bytes.

    Two states agree when, after any such string, both are dead or both are live with the same
    acceptance; so every token of at most d bytes is allowed in both or in neither.
    """
    if rep is None:  # a representative byte of each byte class
        cols = dfa.class_table
    else:
        cols = np.take(dfa.transitions, rep, axis=1)
    cls = dfa.accepting.astype(np.int64)
    cls[dfa.dead] = 2
    return refine_classes(cols, cls, dfa.dead, depth)


def refine_classes(cols: np.ndarray, init: np.ndarray, dead: int, depth: int, *, history: bool = True
                   ) -> list[np.ndarray]:
    """Moore rounds: per d in 0..depth, classes of the rows of `cols` (n, k) (`cols[p, j]`: the
    successor of p on edge label j) that `init` (n,) puts alike and whose successors on every
    label sequence of at most d edges are alike. `dead` is a row alone in its `init` class whose
    edges all lead to itself. Stops early at the fixpoint (the coarsest such partition: the
    remaining entries repeat it). `history=False`: only the last entry, `[classes]`. Pure.

    Moore rounds on two 64-bit signatures `h[p] = sum_j w_j * cls[succ_j(p)]`, updated only for
    the predecessors of states whose class changed; only classes holding such a state are re-sorted.
    # NOTE: only a collision of both signatures (about rounds * states^2 / 2^128) would merge
    # two classes.
    """
    n, k = cols.shape
    cls = np.asarray(init, dtype=np.int64).copy()
    rng = np.random.default_rng(0xC1A55)
    w = rng.integers(1, 2**63, size=(2, k), dtype=np.uint64)
    succ = cls[cols].astype(np.uint64)
    h = np.ascontiguousarray((succ @ w.T).T)  # NOTE: integer matmul wraps modulo 2^64 like the sums it replaces
    # reverse edges grouped by target, but for those into the dead state (alone in its class
    # from the start, it never changes class)
    flat_dst = cols.reshape(-1).astype(np.int64)
    edge = np.flatnonzero(flat_dst != dead)
    edge = edge[stable_argsort(flat_dst[edge], n)]
    edge_src, edge_w = edge // k, w[:, edge % k]
    bounds = np.searchsorted(flat_dst[edge], np.arange(n + 1))
    num = int(cls.max()) + 1 if n else 0
    out = [cls.copy()]
    sub = np.arange(n)
    rounds = 0
    while rounds < depth:
        o = sub[np.lexsort((h[1, sub], h[0, sub], cls[sub]))]
        changed, new_ids, num_new = split_round(o, cls, (h[0], h[1]), num)
        if num_new == 0:
            break
        delta = (new_ids - cls[changed]).astype(np.uint64)  # positive: fresh ids are the largest
        cls[changed] = new_ids
        num += num_new
        rounds += 1
        if history:
            out.append(cls.copy())
        idx, sizes = in_edges(bounds, changed)
        if not len(idx):
            break
        touched = edge_src[idx]
        step = np.repeat(delta, sizes)
        np.add.at(h[0], touched, edge_w[0, idx] * step)
        np.add.at(h[1], touched, edge_w[1, idx] * step)
        hit = np.zeros(num, dtype=bool)
        hit[cls[touched]] = True
        sub = np.flatnonzero(hit[cls])
    if not history:
        return [cls]
    out.extend([cls] * (depth + 1 - len(out)))
    return out


def walk_classes(dfa: Dfa, tables: TrieTables, depth: int) -> np.ndarray:
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
    rep, byte_class = dfa.byte_classes
    by_depth = _depth_classes(dfa, depth)
    longest_of_class = np.zeros(len(rep), dtype=np.int64)
    np.maximum.at(longest_of_class, byte_class, longest)
    d = np.where(dfa.class_table[:n] != dfa.dead, longest_of_class[None, :], 0).max(axis=1)
    cls = np.zeros(n, dtype=np.int64)
    for v in np.unique(d).tolist():
        at = d == v
        cls[at] = by_depth[v][:n][at]
    _, cls = np.unique(d * (int(cls.max()) + 1) + cls, return_inverse=True)
    return cls.reshape(-1)
