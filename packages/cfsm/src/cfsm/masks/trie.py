"""The vocabulary's tokens as a sorted trie: `TrieTables` (sorted columns, every trie node a
contiguous range) and `TrieLevels` (the trie level by level), the layout every token walk reads."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["TrieLevels", "TrieTables", "build_trie_levels"]


@dataclass(frozen=True, eq=False)
class TrieTables:
    """The vocabulary sorted by bytes, as columns: every trie node is a contiguous range.

    `order[i]` is the token id at sorted position i; `columns[d, i]` is byte d of that token or
    -1 past its end (so within a range sharing d bytes, column d is sorted).
    """

    order: np.ndarray  # (n,) int32
    columns: np.ndarray  # (max_len + 1, n) int16
    lengths: np.ndarray  # (n,) int32
    byte_sets: np.ndarray  # (4, n) uint64: bit b % 64 of word b // 64 set if the token has byte b
    tail_byte_sets: np.ndarray  # (4, n) uint64: the same for the token without its first byte
    first_byte_counts: np.ndarray  # (256,) int64: tokens starting with each byte
    by_length: np.ndarray  # (n,) int32: sorted positions reordered by length, longest first
    length_columns: np.ndarray  # (max_len, n) uint16: byte d in by_length order, 256 past the end
    length_counts: np.ndarray  # (max_len,) int64: tokens longer than d
    first_byte_starts: np.ndarray  # (257,) int64: tokens starting with byte b are [starts[b], starts[b+1])
    sorted_tokens: tuple[bytes, ...]  # the token bytes in sorted order
    num_chars: np.ndarray  # (n,) int32: characters of a token that is valid UTF-8, else -1
    # (256, 258) int64: tokens starting with bytes a, b are [s[a, b + 1], s[a, b + 2]); the
    # one-byte token a (repeated if the vocabulary repeats it) is [s[a, 0], s[a, 1])
    two_byte_starts: np.ndarray
    # tables derived from these, per kind ("longer_than", "long_leads": `walker`, "loop_tables": `loops`):
    # owned by these tables, so they live and go with their vocabulary
    derived: dict[str, dict[Any, Any]] = field(default_factory=dict, repr=False)

    def derived_cache(self, kind: str) -> dict[Any, Any]:
        """The cache of one kind of table derived from these (see `derived`)."""
        return self.derived.setdefault(kind, {})

    @functools.cached_property
    def max_length(self) -> int:
        """The longest token's length in bytes (0 without tokens)."""
        return int(self.lengths.max()) if len(self.order) else 0

    @functools.cached_property
    def rank_ids(self) -> np.ndarray:
        """(n,) int64: the token id at each index of `by_length` order (read-only)."""
        out = self.order.take(self.by_length).astype(np.int64)
        out.flags.writeable = False
        return out

    @functools.cached_property
    def rank_lengths(self) -> np.ndarray:
        """(n,) int64: the length of the token at each index of `by_length` order (read-only)."""
        out = self.lengths.take(self.by_length).astype(np.int64)
        out.flags.writeable = False
        return out

    @functools.cached_property
    def max_id(self) -> int:
        """The largest token id in the tables (0 without tokens)."""
        return int(self.order.max(initial=0))

    def longer_than(self, depth: int) -> np.ndarray:
        """Per sorted position: whether the token is longer than `depth` bytes (read-only, cached)."""
        per = self.derived_cache("longer_than")
        hit = per.get(depth)
        if hit is None:
            hit = per[depth] = self.lengths > depth
            hit.flags.writeable = False
        return hit


@dataclass(frozen=True, eq=False)
class TrieLevels:
    """The vocabulary's trie, level by level: node k of level d is one distinct prefix of d + 1
    bytes (levels in sorted order, so a node's children and tokens are contiguous ranges).

    A walk of the trie visits each distinct prefix once, where a walk of the tokens visits every
    byte of every token (SmolLM2: 100k nodes against 332k bytes), and a dead prefix drops its
    whole subtree at once.
    """

    byte: tuple[np.ndarray, ...]  # per level (n_d,) int64: the node's last byte
    child_lo: tuple[np.ndarray, ...]  # per level (n_d,) int64: its children are [lo, hi) of level d + 1
    child_hi: tuple[np.ndarray, ...]
    tok_lo: tuple[np.ndarray, ...]  # per level (n_d,) int64: tokens with this prefix are sorted positions [lo, hi)
    tok_hi: tuple[np.ndarray, ...]
    # per level (n_d,) int64: tokens that are the whole prefix (a repeated token once per copy);
    # they sort first among the node's tokens: sorted positions [tok_lo, tok_lo + end_count)
    end_count: tuple[np.ndarray, ...]
    rank: np.ndarray  # (n,) int64: sorted position -> its index in `TrieTables.by_length`

    @functools.cached_property
    def below(self) -> tuple[np.ndarray, ...]:
        """Per level (n_d, 4) uint64: the bytes of the node's tokens past its prefix (bit b % 64
        of word b // 64 set if a token under the node has byte b after its first d + 1 bytes; 0
        for a node whose tokens all end there). A walk whose configuration loops on every such
        byte accepts the node's tokens whole (`GrammarIndex._walk_trie_many`). Read-only."""
        levels = len(self.byte)
        out: list[np.ndarray] = [np.zeros((0, 4), dtype=np.uint64)] * levels
        for d in range(levels - 1, -1, -1):
            n = len(self.byte[d])
            acc = np.zeros((n, 4), dtype=np.uint64)
            if d + 1 < levels and len(self.byte[d + 1]):
                # NOTE: each child contributes its own byte and what lies below it; the children of
                # the nodes that have any are consecutive ranges covering the next level in order
                child = out[d + 1].copy()
                b = self.byte[d + 1]
                child[np.arange(len(b)), b >> 6] |= np.left_shift(np.uint64(1), (b & 63).astype(np.uint64))
                lo, hi = self.child_lo[d], self.child_hi[d]
                has = np.flatnonzero(hi > lo)
                if len(has):
                    acc[has] = np.bitwise_or.reduceat(child, lo[has], axis=0)
            acc.flags.writeable = False
            out[d] = acc
        return tuple(out)


def build_trie_levels(tables: TrieTables) -> TrieLevels:
    """The `TrieLevels` of sorted trie tables. Pure."""
    cols, lengths = tables.columns, tables.lengths
    n = len(lengths)
    parent_of = np.zeros(n, dtype=np.int64)  # per sorted position: its node at the previous level
    byte, tok_lo, tok_hi, end_count, parents = [], [], [], [], []
    for d in range(tables.max_length):
        sel = np.flatnonzero(lengths > d)
        col = cols[d, sel].astype(np.int64)
        par = parent_of[sel]
        new = np.ones(len(sel), dtype=bool)
        new[1:] = (col[1:] != col[:-1]) | (par[1:] != par[:-1])
        node = np.cumsum(new) - 1
        starts = np.flatnonzero(new)
        byte.append(col[starts])
        parents.append(par[starts])
        tok_lo.append(sel[starts].astype(np.int64))
        tok_hi.append(sel[np.append(starts[1:], len(sel)) - 1].astype(np.int64) + 1)
        end_count.append(np.bincount(node[lengths[sel] == d + 1], minlength=len(starts)).astype(np.int64))
        parent_of[sel] = node
    child_lo, child_hi = [], []
    for d in range(len(byte)):
        if d + 1 < len(byte):
            ids = np.arange(len(byte[d]))
            child_lo.append(np.searchsorted(parents[d + 1], ids, side="left").astype(np.int64))
            child_hi.append(np.searchsorted(parents[d + 1], ids, side="right").astype(np.int64))
        else:
            child_lo.append(np.zeros(len(byte[d]), dtype=np.int64))
            child_hi.append(np.zeros(len(byte[d]), dtype=np.int64))
    rank = np.empty(n, dtype=np.int64)
    rank[tables.by_length] = np.arange(n)
    return TrieLevels(byte=tuple(byte), child_lo=tuple(child_lo), child_hi=tuple(child_hi), tok_lo=tuple(tok_lo),
                      tok_hi=tuple(tok_hi), end_count=tuple(end_count), rank=rank)
