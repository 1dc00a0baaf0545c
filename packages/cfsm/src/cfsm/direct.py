"""JSON-shaped syntax trees straight to a DFA table, without an NFA or a subset construction.

A JSON Schema's tree is mostly concatenation: `{`, a key's literal characters, `:`, a value,
`,`, ... `}`. Such a tree is built backward, each piece in front of its continuation (the state
it hands over to): a literal ASCII character is one state with one byte range into the
continuation; any other piece (a string body, a number, an enum, an array) is a *block*, the
piece's own minimal DFA copied in as a numpy block whose accepting states take the
continuation's row. That stays deterministic as long as those rows do not share a byte (checked;
otherwise the caller falls back to the generic construction). Blocks are built once per structure
(hash-consed: the same value schema under many keys is one DFA, copied), and `Shared` suffixes
(whose references all have the same continuation) are one state.

The table is then put in breadth-first order (bytes ascending, unreachable states dropped) and
minimized. The generic construction discovers states in that same order, so `_minimize`
numbers the minimal DFA identically (each class by its shortlex-least access word): the result
is the very `Dfa` that `build_dfa` returns, arrays and byte classes included.
"""

from __future__ import annotations

import numpy as np

from cfsm.automaton import MAX_DFA_STATES, Dfa, DfaNode, _minimize, _Nfa, _subset_construction
from cfsm.errors import GrammarTooLargeError
from cfsm.gcpause import without_gc
from cfsm.regex_ast import Alt, Cat, Chars, Complement, Intersect, Node, Repeat, Scope, Sep, Shared

__all__ = ["build_dfa_direct"]


class _Fallback(Exception):
    """The tree does not fit the direct construction."""


class _Block:
    """A piece's DFA, ready to copy: rows without the dead state, dead entries -1.

    # NOTE: not minimized (the whole table is, once): a block is its subset construction
    """

    __slots__ = ("rows", "accepting", "start", "size", "cuts")

    def __init__(self, node: Node) -> None:
        if isinstance(node, DfaNode):
            dfa = node.dfa
            n, start = dfa.num_states, dfa.start
            if n == 0:
                raise _Fallback("a piece accepts nothing")
            t = dfa.transitions[:n].astype(np.int64)
            acc = dfa.accepting[:n]
        else:
            nfa = _Nfa()
            s, e = nfa.build(node)
            try:
                narrow, accepting, byte_map = _subset_construction(nfa, s, e)
            except GrammarTooLargeError as exc:
                raise _Fallback("too large: the generic construction reports it") from exc
            n, start = narrow.shape[0] - 1, 0
            t = np.take(narrow[:n].astype(np.int64), byte_map, axis=1)
            acc = accepting[:n]
        t[t == n] = -1
        self.rows = t
        self.accepting = np.flatnonzero(acc)
        self.start = start
        self.size = n
        self.cuts = np.flatnonzero((t[:, 1:] != t[:, :-1]).any(axis=0)) + 1  # where a byte interval starts


class _Builder:
    def __init__(self) -> None:
        self.size = 0
        self.accepting: list[bool] = []
        # literal states: one byte range each
        self.lit_src: list[int] = []
        self.lit_lo: list[int] = []
        self.lit_hi: list[int] = []
        self.lit_dst: list[int] = []
        # block copies: (first state id, block, continuation or -1)
        self.copies: list[tuple[int, _Block, int]] = []
        self.blocks: dict[int, _Block] = {}  # by structure key
        self.keys: dict[int, int] = {}  # id(node) -> structure key
        self.interned: dict[tuple[object, ...], int] = {}
        self.nodes: list[Node] = []  # keeps keyed nodes alive while their ids are in use
        self.shared: list[dict[int, tuple[int, int]]] = [{}]

    def new(self, accepting: bool) -> int:
        self.accepting.append(accepting)
        self.size += 1
        return self.size - 1

    def build(self, node: Node, cont: int) -> int:
        """A state whose language is node's language followed by cont's."""
        if isinstance(node, Chars):
            r = node.ranges
            if len(r) == 1 and r[0][1] < 0x80:  # one ASCII range: one state
                s = self.new(False)
                self.lit_src.append(s)
                self.lit_lo.append(r[0][0])
                self.lit_hi.append(r[0][1])
                self.lit_dst.append(cont)
                return s
            return self.block(node, cont)
        if isinstance(node, Cat):
            for item in reversed(node.items):
                cont = self.build(item, cont)
            return cont
        if isinstance(node, Scope):
            self.shared.append({})
            try:
                return self.build(node.item, cont)
            finally:
                self.shared.pop()
        if isinstance(node, Shared):
            memo = self.shared[-1]
            hit = memo.get(id(node))
            if hit is None:
                hit = memo[id(node)] = (self.build(node.item, cont), cont)
            if hit[1] != cont:  # NOTE: Shared's contract (one continuation) broken: be safe
                raise _Fallback("a shared piece with two continuations")
            return hit[0]
        return self.block(node, cont)

    def count_blocks(self, node: Node, counts: dict[int, int], seen: set[int]) -> None:
        """How many copies of each block structure `build(node)` makes (the plan's cost)."""
        if isinstance(node, Chars) and len(node.ranges) == 1 and node.ranges[0][1] < 0x80:
            return
        if isinstance(node, Cat):
            for item in node.items:
                self.count_blocks(item, counts, seen)
        elif isinstance(node, Scope | Shared):
            if id(node) not in seen:  # a Shared node is built once per Scope: counted once
                seen.add(id(node))
                self.count_blocks(node.item, counts, seen)
        else:
            k = self.key(node)
            counts[k] = counts.get(k, 0) + 1

    def block(self, node: Node, cont: int) -> int:
        key = self.key(node)
        blk = self.blocks.get(key)
        if blk is None:
            blk = self.blocks[key] = _Block(node)
        base = self.size
        self.size += blk.size
        acc = np.zeros(blk.size, dtype=bool)
        acc[blk.accepting] = True
        if cont >= 0:
            acc[blk.accepting] = self.accepting[cont]
        self.accepting.extend(acc.tolist())
        self.copies.append((base, blk, cont))
        if self.size > MAX_DFA_STATES:
            raise _Fallback("too large: the generic construction reports it")
        return base + blk.start

    def key(self, node: Node) -> int:
        """A small int per structure (equal languages by construction get equal keys)."""
        k = self.keys.get(id(node))
        if k is not None:
            return k
        sig: tuple[object, ...]
        if isinstance(node, Chars):
            sig = ("C", node.ranges)
        elif isinstance(node, Cat | Alt | Intersect):
            sig = (type(node).__name__, *(self.key(it) for it in node.items))
        elif isinstance(node, Repeat):
            sig = ("R", self.key(node.item), node.lo, node.hi)
        elif isinstance(node, Sep):
            sig = ("S", self.key(node.item), self.key(node.sep))
        elif isinstance(node, Shared | Scope):
            # NOTE: inside a block both only choose how much of the NFA is shared: the language is
            # the item's (a block is built whole by the generic construction)
            sig = (type(node).__name__, id(node))
        elif isinstance(node, Complement):
            sig = ("N", self.key(node.item))
        elif isinstance(node, DfaNode):
            sig = ("D", id(node))
        else:
            raise _Fallback(f"unknown node {type(node).__name__}")
        k = self.interned.setdefault(sig, len(self.interned))
        self.keys[id(node)] = k
        self.nodes.append(node)
        return k

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """(table, byte_map): one column per byte interval that steps alike from every state
        (ascending), `byte_map[b]` the column of byte b; rows (size + 1), the dead state last."""
        n = self.size
        lo = np.asarray(self.lit_lo, dtype=np.int64)
        hi = np.asarray(self.lit_hi, dtype=np.int64)
        cuts = [np.array([0]), lo, hi + 1]
        for blk in {id(b): b for _, b, _ in self.copies}.values():
            cuts.append(blk.cuts)
        starts = np.unique(np.concatenate(cuts))
        starts = starts[starts < 256]
        byte_map = np.searchsorted(starts, np.arange(256), side="right") - 1
        width = len(starts)
        t = np.full((n + 1, width), n, dtype=np.int32)
        if self.lit_src:
            src = np.asarray(self.lit_src, dtype=np.int64)
            dst = np.asarray(self.lit_dst, dtype=np.int32)
            clo, chi = byte_map[lo], byte_map[hi]
            one = clo == chi
            t[src[one], clo[one]] = dst[one]
            for i in np.flatnonzero(~one).tolist():
                t[src[i], clo[i] : chi[i] + 1] = dst[i]
        # NOTE: copies are made backward, so a copy's continuation (a smaller id) and that
        # continuation's own merge are final when the copy's accepting rows take its row
        narrow: dict[int, np.ndarray] = {}
        for base, blk, _ in self.copies:
            rows = narrow.get(id(blk))
            if rows is None:
                rows = narrow[id(blk)] = np.take(blk.rows, starts, axis=1)
            t[base : base + blk.size] = np.where(rows < 0, n, rows + base)
        for base, blk, cont in self.copies:
            if cont < 0 or not len(blk.accepting):
                continue
            ids = blk.accepting + base
            mine = t[ids]
            theirs = t[cont]
            if ((mine != n) & (theirs != n)).any():
                raise _Fallback("a piece's end and its continuation read the same byte")
            t[ids] = np.where(mine == n, theirs, mine)
        return t, byte_map


def _bfs_order(t: np.ndarray, start: int) -> np.ndarray:
    """Reachable states in breadth-first order, each state's targets by ascending first byte
    (the order in which the subset construction discovers states); columns are ascending byte
    intervals."""
    n, k = t.shape[0] - 1, t.shape[1]
    keep = np.ones(t.shape, dtype=bool)
    keep[:, 1:] = t[:, 1:] != t[:, :-1]
    keep &= t != n
    flat = np.flatnonzero(keep.reshape(-1))
    targets = t.reshape(-1)[flat].tolist()
    bounds = np.searchsorted(flat, np.arange(n + 1) * k).tolist()
    seen = [False] * (n + 1)
    seen[start] = True
    order = [start]
    i = 0
    while i < len(order):
        q = order[i]
        for x in targets[bounds[q] : bounds[q + 1]]:
            if not seen[x]:
                seen[x] = True
                order.append(x)
        i += 1
    return np.asarray(order, dtype=np.int64)


@without_gc
def build_dfa_direct(node: Node, *, force: bool = False) -> Dfa | None:
    """The minimal DFA of `node`, equal to `build_dfa(node)`, or None where the tree does not
    fit the direct construction or (unless `force`) would not be faster: then use `build_dfa`.
    Mutates nothing."""
    b = _Builder()
    try:
        counts: dict[int, int] = {}
        b.count_blocks(node, counts, set())
        # NOTE: each distinct block pays a subset construction's fixed cost; the generic
        # construction pays it once for the whole tree: worth it only where blocks repeat
        if not force and 2 * len(counts) > sum(counts.values()):
            return None
        final = b.new(True)
        start = b.build(node, final)
        if start == final:
            return None  # the empty string: nothing to gain
        t, byte_map = b.table()
    except _Fallback:
        return None
    order = _bfs_order(t, start)
    n = t.shape[0] - 1
    m = len(order)
    remap = np.full(n + 1, m, dtype=np.int32)  # unreachable and dead -> the new dead state
    remap[order] = np.arange(m, dtype=np.int32)
    table = np.empty((m + 1, t.shape[1]), dtype=np.int32)
    table[:m] = remap[t[order]]
    table[m] = m
    acc = np.zeros(m + 1, dtype=bool)
    acc[:m] = np.asarray(b.accepting, dtype=bool)[order]
    return _minimize(table, acc, 0, byte_map)
