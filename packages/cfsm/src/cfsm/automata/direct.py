"""JSON-shaped syntax trees straight to a DFA table, without an NFA or a subset construction.

A JSON Schema's tree is mostly concatenation: `{`, a key's literal characters, `:`, a value,
`,`, ... `}`. Such a tree is built backward, each piece in front of its continuation (the state
it hands over to): a literal ASCII character is one state with one byte range into the
continuation; any other piece (a string body, a number, an enum, an array) is a *block*, the
piece's own minimal DFA copied in as a numpy block whose accepting states take the
continuation's row. That stays deterministic as long as those rows do not share a byte (checked;
otherwise the caller falls back to the generic construction). Blocks are built once per structure
(hash-consed: the same value schema under many keys is one DFA, copied), and `Shared` suffixes
(whose references all have the same continuation) are one state. A choice decided by its first
byte (an alternation of literal-led items or the empty string, the optional items of a short
bounded repeat such as an array's `maxItems`) is one *union state* holding the byte ranges of
each choice's head, so its items are literal states and blocks too (string bodies stay proven,
no block of its own to build); standard value trees (`regex_ast.Piece`: number, boolean,
formats) are one prepared block each.

The table is then minimized and put in breadth-first order (bytes ascending, unreachable
states dropped). The generic construction discovers states in that same order, so the minimal
DFA is numbered identically (each class by its shortlex-least access word): the result is the
very `Dfa` that `build_dfa` returns, arrays and byte classes included. The classes of equivalent
states come from the structure (`_Builder.classes`: a block's own classes with its
continuation's class, literal states hash-consed) where invariants prove them apart, else from
`minimize`'s refinement rounds. The states of JSON string bodies followed by their closing
quote, and the states of broad formats, are handed to the index as proven (`Dfa.facts`, a
`DirectFacts`, read by `templates.match_string_states` and `index.build_index`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cfsm.automata.automaton import (
    COUNTED_MIN,
    DEFAULT_MAX_DFA_STATES,
    Dfa,
    DfaNode,
    DirectFacts,
    Nfa,
    byte_segments,
    concat_ranges,
    minimal_dfa,
    minimize,
    small_unique,
)
from cfsm.automata.block_facts import (
    BYTE_CUM,
    BYTE_CUM_U64,
    LOOK_AHEAD,
    MASK,
    look_ahead,
)
from cfsm.automata.blocks import (
    DAG_MAX,
    PREPARED,
    Block,
    Fallback,
    dag_size,
    fixed_count,
    holds_prepared,
    is_literal,
    is_loop,
    led,
    prepare_blocks,
)
from cfsm.automata.direct_loops import LoopStates, loop_sep
from cfsm.regex.syntax import Alt, Cat, Chars, Complement, Intersect, Node, Piece, Repeat, Scope, Sep, Shared

__all__ = ["build_dfa_direct", "prepare_blocks"]

# trees with at least this many whitespace runs outside blocks take the direct construction always
_MANY_RUNS = 8


class _Builder(LoopStates):
    def __init__(self, limit: int = DEFAULT_MAX_DFA_STATES) -> None:
        self._init_loops()
        self.limit = limit  # `CfsmLimits.max_dfa_states`: past it, `Fallback` (the generic build reports it)
        self.size = 0
        # per state that can be a continuation (the final state, literal states, block starts):
        # (accepting, shortest accepted length or -1, the bytes its row reads as a 256-bit int)
        # NOTE: a state's shortest accepted length is known by construction: a literal state's is
        # 1 + its continuation's; a block state's, its length inside the block + the continuation's
        # (the block is left only from its accepting states, all into the same continuation)
        self.entry: dict[int, tuple[bool, int, int]] = {}
        # literal states: one byte range each
        self.lit_src: list[int] = []
        self.lit_lo: list[int] = []
        self.lit_hi: list[int] = []
        self.lit_dst: list[int] = []
        self.lit_dist: list[int] = []
        self.finals: list[int] = []
        # block copies: (first state id, block, continuation, its accepting flag and length)
        self.copies: list[tuple[int, Block, int, bool, int]] = []
        self.blocks: dict[int, Block] = {}  # by structure key
        self.keys: dict[int, int] = {}  # id(node) -> structure key
        self.interned: dict[tuple[object, ...], int] = {}
        self.nodes: list[Node] = []  # keeps keyed nodes alive while their ids are in use
        self.shared: list[dict[int, tuple[int, int]]] = [{}]
        # literal states (index into lit_*, >= 0) and copies (~index into copies) as made: by id
        # (a union state: the index of its first entry)
        self.made: list[int] = []
        # union states (`_union`: several byte ranges, each into its own target): their entries
        self.multi: dict[int, list[int]] = {}
        self._lit_at: dict[int, int] = {}  # literal state -> its (first) entry (`_entries`)
        self._lit_done = 0  # entries indexed in _lit_at so far
        self._consed: dict[tuple[tuple[int, int, int], ...], int] = {}  # `_literal_state`'s states by ranges
        # loop-free literal trees (`dag_size`) by structure key: how many copies (`count_blocks`)
        self.dag_counts: dict[int, int] = {}
        self.prepared_keys: set[int] = set()  # structure keys of prepared blocks (`count_blocks`)
        self._dag_memo: dict[int, int] = {}  # `dag_size` by node id
        self._prep_memo: dict[int, bool] = {}  # `holds_prepared` by node id
        self._lit_np: dict[str, np.ndarray] = {}  # `_lit`

    def _lit(self, name: str) -> np.ndarray:
        """`lit_<name>` as a read-only int64 array, made once (call only after `build`: the
        literal entries are complete then)."""
        a = self._lit_np.get(name)
        if a is None:
            a = self._lit_np[name] = np.asarray(getattr(self, f"lit_{name}"), dtype=np.int64)
            a.flags.writeable = False
        return a

    def final(self) -> int:
        """The state after the whole tree: accepting, no transitions."""
        s = self.size
        self.size += 1
        self.entry[s] = (True, 0, 0)
        self.finals.append(s)
        return s

    def build(self, node: Node, cont: int) -> int:
        """A state whose language is node's language followed by cont's."""
        if type(node) is Repeat and is_loop(node):
            return self.loop(node, cont)
        if type(node) is Sep and self.loops and loop_sep(node, self._sep_memo):
            return self.loop_list(node, cont)
        if isinstance(node, Cat):
            entry, made = self.entry, self.made
            lit_src, lit_lo, lit_hi, lit_dst, lit_dist = self.lit_src, self.lit_lo, self.lit_hi, self.lit_dst, self.lit_dist
            for item in reversed(node.items):
                if type(item) is Chars and len(item.ranges) == 1 and item.ranges[0][1] < 0x80:
                    # NOTE: the literal state of the branch below, inlined (most of a schema's states)
                    lo, hi = item.ranges[0]
                    d = entry[cont][1]
                    d = d + 1 if d >= 0 else -1
                    s = self.size
                    self.size = s + 1
                    entry[s] = (False, d, (1 << (hi + 1)) - (1 << lo))
                    made.append(len(lit_src))
                    lit_src.append(s)
                    lit_lo.append(lo)
                    lit_hi.append(hi)
                    lit_dst.append(cont)
                    lit_dist.append(d)
                    cont = s
                else:
                    cont = self.build(item, cont)
            return cont
        if isinstance(node, Chars):
            r = node.ranges
            if len(r) == 1 and r[0][1] < 0x80:  # one ASCII range: one state
                lo, hi = r[0]
                d = self.entry[cont][1]
                d = d + 1 if d >= 0 else -1
                s = self.size
                self.size += 1
                self.entry[s] = (False, d, (1 << (hi + 1)) - (1 << lo))
                self.lit_src.append(s)
                self.lit_lo.append(lo)
                self.lit_hi.append(hi)
                self.lit_dst.append(cont)
                self.lit_dist.append(d)
                self.made.append(len(self.lit_src) - 1)
                return s
            return self.block(node, cont)
        if isinstance(node, Scope):
            if type(node) is Piece:  # a standard value tree: one block (prepared, `prepare_blocks`)
                return self.block(node, cont)
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
                raise Fallback("a shared piece with two continuations")
            return hit[0]
        if isinstance(node, Alt | Repeat) and 0 <= dag_size(node, self._dag_memo) <= DAG_MAX:
            # NOTE: a structure copied several times is one block built once (cheaper than one
            # subset construction per copy); before a block (whose row is placed later) too
            if self.dag_counts.get(self.key(node), 0) <= 1 and self._entries(cont) is not None:
                return self._literal_states(node, cont)
            return self.block(node, cont)
        if isinstance(node, Alt | Repeat) and (holds_prepared(node, self._prep_memo) or fixed_count(node)
                                               or bool(self.loops)):  # NOTE: a block would read the runs
            head = self._choice(node, cont)
            if head is not None:
                return head
        return self.block(node, cont)

    def _entries(self, s: int) -> list[int] | None:
        """The literal entries (indices into lit_*) of state `s`, None if it is not a literal or
        union state (a block's state, the final state)."""
        hit = self.multi.get(s)
        if hit is not None:
            return None if s in self.block_union else hit
        if s in self.pending:
            return None
        at = self._lit_at
        for i in range(self._lit_done, len(self.lit_src)):  # NOTE: indexed lazily (unions are rare)
            at.setdefault(self.lit_src[i], i)
        self._lit_done = len(self.lit_src)
        i = at.get(s, -1)
        return None if i < 0 or s in self.multi else [i]

    def _first_bits(self, node: Node, cont: int) -> int | None:
        """The bytes `build(node, cont)`'s state reads (256-bit int) where that state is a literal
        or union state: node the empty string (then cont's) or led by a literal ASCII range; else None."""
        if isinstance(node, Cat):
            if not node.items:
                return self.entry[cont][2] if self._entries(cont) is not None else None
            if is_loop(node.items[0]):  # a whitespace run's bytes, and those of what follows it
                rest = self._first_bits(Cat(node.items[1:]), cont)
                return None if rest is None else rest | self.lead_loop(node, cont)
            node = node.items[0]
        if is_loop(node):
            rest = self._first_bits(Cat(()), cont)
            return None if rest is None else rest | self.lead_loop(node, cont)
        if is_literal(node) and isinstance(node, Chars):
            lo, hi = node.ranges[0]
            return (1 << (hi + 1)) - (1 << lo)
        return None

    def _literal_states(self, node: Node, cont: int) -> int:
        """`build(node, cont)` for a tree of literal ASCII ranges without loops (`dag_size`: an
        enum, an integer range): its minimal DFA as literal and union states, made from the
        node's NFA by a subset construction that creates a state after its targets and reuses
        any state with the same ranges into the same states (so none is made twice), the NFA's end
        being cont (its ranges taken into the states that may end)."""
        nfa = Nfa()
        s0, end = nfa.build(node)
        eps, trans = nfa.eps, nfa.trans
        cont_entries = self._entries(cont)
        cont_bits = self.entry[cont][2]
        memo: dict[frozenset[int], int] = {}

        def closure(qs: frozenset[int]) -> frozenset[int]:
            seen = set(qs)
            stack = list(qs)
            while stack:
                for y in eps[stack.pop()]:
                    if y not in seen:
                        seen.add(y)
                        stack.append(y)
            return frozenset(x for x in seen if trans[x] or x == end)

        def det(group: frozenset[int]) -> int:
            hit = memo.get(group)
            if hit is not None:
                return hit
            ranges = [t for q in group for t in trans[q]]
            entries = [(lo, hi, det(closure(tg))) for lo, hi, tg in (byte_segments(ranges) if ranges else [])]
            if end in group:
                bits = 0
                for lo, hi, _ in entries:
                    bits |= (1 << (hi + 1)) - (1 << lo)
                if bits & cont_bits:
                    raise Fallback("a piece's end and its continuation read the same byte")
                if not entries:
                    memo[group] = cont
                    return cont
                assert cont_entries is not None, "a literal piece before a block state (`build` checks)"
                entries += [(self.lit_lo[i], self.lit_hi[i], self.lit_dst[i]) for i in cont_entries]
            state = memo[group] = self._literal_state(entries)
            return state

        return det(closure(frozenset((s0,))))

    def _literal_state(self, entries: list[tuple[int, int, int]]) -> int:
        """A literal state (one range) or union state with these disjoint ranges (lo, hi, target);
        the state made earlier with the same ranges if any (`_literal_states`)."""
        key = tuple(sorted(entries))
        hit = self._consed.get(key)
        if hit is not None:
            return hit
        s = self.size
        self.size += 1
        entry = self.entry
        dists = [entry[t][1] for _, _, t in entries if entry[t][1] >= 0]
        d = min(dists) + 1 if dists else -1
        bits = 0
        for lo, hi, _ in entries:
            bits |= (1 << (hi + 1)) - (1 << lo)
        entry[s] = (False, d, bits)
        first = len(self.lit_src)
        for lo, hi, t in key:
            self.lit_src.append(s)
            self.lit_lo.append(lo)
            self.lit_hi.append(hi)
            self.lit_dst.append(t)
            self.lit_dist.append(d)
        if len(key) > 1:
            self.multi[s] = list(range(first, len(self.lit_src)))
        self.made.append(first)
        self._consed[key] = s
        return s

    def _choice(self, node: Alt | Repeat, cont: int) -> int | None:
        """`build(node, cont)` without a block where every choice it makes is decided by its first
        byte: an Alt whose items are led by literal ranges (or are empty) with disjoint bytes, a
        bounded short Repeat of a literal-led item (its optional copies each a union with cont);
        the head state of each choice becomes one union state. None (nothing built) otherwise."""
        if isinstance(node, Alt):
            # NOTE: choices led by whitespace runs on one S may share S (`loop_union` merges them)
            bits = loop_bits = 0
            block_item = None  # with whitespace runs: one choice led by a block (`block_choice`)
            for it in node.items:
                b = self._first_bits(it, cont)
                if b is None:
                    if block_item is not None or not self.loops:
                        return None
                    block_item = it
                    continue
                lb = self.lead_loop(it, cont)
                if (lb and loop_bits and lb != loop_bits) or (b & ~lb) & (bits | loop_bits) or lb & bits:
                    return None
                bits |= b & ~lb
                loop_bits |= lb
            if len(node.items) < 2:
                return None
            heads = [cont if isinstance(it, Cat) and not it.items else self.build(it, cont)
                     for it in node.items if it is not block_item]
            if block_item is not None:
                return self.block_choice(heads, self.build(block_item, cont))
            return self._union(heads)
        lo, hi = node.lo, node.hi
        if lo == 0 and hi == 1 and self.loops:  # an optional block-led item: as a choice with the empty string
            return self._choice(Alt((Cat(()), node.item)), cont)
        if hi is None or hi >= COUNTED_MIN or lo > hi or hi == 0:
            return None
        b = self._first_bits(node.item, cont)
        shared = self.lead_loop(node.item, cont) & self.lead_loop(Cat(()), cont)  # runs merged by `loop_union`
        if b is None or (hi > lo and (self._entries(cont) is None or b & self.entry[cont][2] & ~shared)):
            return None
        s = cont
        for _ in range(hi - lo):
            s = self._union([self.build(node.item, s), cont])
        for _ in range(lo):
            s = self.build(node.item, s)
        return s

    def _union(self, heads: list[int]) -> int:
        """A new state with the byte ranges of every head (literal or union states, reading disjoint
        bytes): its language is the union of theirs. The heads themselves stay (unreachable
        unless something else leads to them)."""
        merged = self.loop_union(heads) if self.loops else None
        if merged is not None:
            return merged
        entries = []
        for h in heads:
            e = self._entries(h)
            assert e is not None, "a union of states that are not literal ones"
            entries.extend(e)
        s = self.size
        self.size += 1
        dists = [self.entry[h][1] for h in heads if self.entry[h][1] >= 0]
        d = min(dists) if dists else -1
        bits = 0
        for h in heads:
            bits |= self.entry[h][2]
        self.entry[s] = (False, d, bits)
        mine = []
        for i in entries:
            mine.append(len(self.lit_src))
            self.lit_src.append(s)
            self.lit_lo.append(self.lit_lo[i])
            self.lit_hi.append(self.lit_hi[i])
            self.lit_dst.append(self.lit_dst[i])
            self.lit_dist.append(d)  # NOTE: the state's (`arrays`), not the entry's
        self.multi[s] = mine
        self.made.append(mine[0])
        return s

    def count_blocks(self, node: Node, counts: dict[int, int], seen: set[int]) -> None:
        """How many copies of each block structure `build(node)` makes (the plan's cost)."""
        if isinstance(node, Chars) and len(node.ranges) == 1 and node.ranges[0][1] < 0x80:
            return
        if is_loop(node):
            self.saw_loop += 1
            return
        if isinstance(node, Alt | Repeat) and 0 <= dag_size(node, self._dag_memo) <= DAG_MAX:
            k = self.key(node)
            self.dag_counts[k] = self.dag_counts.get(k, 0) + 1
            if self.dag_counts[k] == 2:  # built as a block (`build`), counted as one from now on
                counts[k] = counts.get(k, 0) + 2
            elif self.dag_counts[k] > 2:
                counts[k] += 1
            return
        if isinstance(node, Cat):
            for item in node.items:
                # NOTE: literal characters (most items: keys) skipped here, not in a call each
                if type(item) is not Chars or len(item.ranges) != 1 or item.ranges[0][1] >= 0x80:
                    self.count_blocks(item, counts, seen)
        elif isinstance(node, Alt) and len(node.items) > 1 and all(led(it) for it in node.items) and holds_prepared(
                node, self._prep_memo):
            for item in node.items:  # NOTE: as `_choice` builds it, if the bytes turn out disjoint
                self.count_blocks(item, counts, seen)
        elif (isinstance(node, Repeat) and node.hi is not None and 0 < node.hi < COUNTED_MIN and led(node.item)
              and (holds_prepared(node, self._prep_memo) or fixed_count(node))):
            for _ in range(node.hi):
                self.count_blocks(node.item, counts, seen)
        elif isinstance(node, Scope | Shared) and type(node) is not Piece:
            if id(node) not in seen:  # a Shared node is built once per Scope: counted once
                seen.add(id(node))
                self.count_blocks(node.item, counts, seen)
        else:
            if isinstance(node, Sep) and loop_sep(node, self._sep_memo):
                self.count_blocks(node.item, counts, seen)  # as `loop_list` builds it
                self.count_blocks(node.sep, counts, seen)
                return
            k = self.key(node)
            counts[k] = counts.get(k, 0) + 1
            ready = PREPARED.get(id(node))
            if ready is not None and ready[0] is node:
                self.prepared_keys.add(k)

    def block(self, node: Node, cont: int) -> int:
        key = self.key(node)
        blk = self.blocks.get(key)
        if blk is None:
            ready = PREPARED.get(id(node))
            # NOTE: a prepared block is the very block `Block(node)` would build (the node is a
            # per-process tree, kept alive by the table)
            blk = self.blocks[key] = ready[1] if ready is not None and ready[0] is node else Block(node, self.limit)
        acc, d, first = self.entry[cont]
        if cont in self.block_union:
            raise Fallback("a block before a choice with a block")
        if blk.acc_bits & first:
            raise Fallback("a piece's end and its continuation read the same byte")
        base = self.size
        self.size += blk.size
        if self.size > self.limit:
            raise Fallback("too large: the generic construction reports it")
        self.made.append(~len(self.copies))
        self.copies.append((base, blk, cont, acc, d))
        start = base + blk.start
        sd = blk.start_dist
        ends = blk.start_accepting  # the start takes the continuation's row too
        self.entry[start] = (ends and acc, sd + d if sd >= 0 and d >= 0 else -1,
                             blk.start_bits | (first if ends else 0))
        return start

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
            raise Fallback(f"unknown node {type(node).__name__}")
        k = self.interned.setdefault(sig, len(self.interned))
        self.keys[id(node)] = k
        self.nodes.append(node)
        return k

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """(table, byte_map): one column per byte interval that steps alike from every state
        (ascending), `byte_map[b]` the column of byte b; rows (size + 1), the dead state last."""
        n = self.size
        lo, hi = self._lit("lo"), self._lit("hi")
        cuts = [np.array([0]), lo, hi + 1]
        for blk in {id(c[1]): c[1] for c in self.copies}.values():
            cuts.append(blk.cuts)
        starts = small_unique(np.concatenate(cuts))[0]  # the cuts are bytes 0..256
        starts = starts[starts < 256]
        byte_map = np.searchsorted(starts, np.arange(256), side="right") - 1
        width = len(starts)
        t = np.full((n + 1, width), n, dtype=np.int32)
        if self.lit_src:
            src, dst = self._lit("src"), self._lit("dst")
            clo, chi = byte_map[lo], byte_map[hi]
            one = clo == chi
            t[src[one], clo[one]] = dst[one]
            for i in np.flatnonzero(~one).tolist():
                t[src[i], clo[i] : chi[i] + 1] = dst[i]
        # every block's copies placed at once (their rows shifted by each copy's first id)
        groups: dict[int, tuple[Block, list[int], list[int]]] = {}
        for base, blk, cont, *_ in self.copies:
            g = groups.get(id(blk))
            if g is None:
                g = groups[id(blk)] = (blk, [], [])
            g[1].append(base)
            g[2].append(cont)
        merged = np.zeros(n + 1, dtype=bool)  # the accepting rows of copies (they take a row)
        for blk, bases, _ in groups.values():
            rows = np.take(blk.rows, blk.col_of[starts], axis=1).astype(np.int32)
            live = rows >= 0  # the dead entries keep t's initial n
            for base in bases:
                np.copyto(t[base : base + blk.size], rows + np.int32(base), where=live)
            b = np.asarray(bases, dtype=np.int64)
            merged[(b[:, None] + blk.accepting[None, :]).reshape(-1)] = True
        # accepting rows take their continuation's row: at once where that row is final (not
        # itself a merged accepting row), then the others one by one in the order copies were
        # made (backward: a copy's continuation, a smaller id, and its own merge come first)
        later: list[tuple[int, Block, int]] = []
        for blk, bases, conts in groups.values():
            if not len(blk.accepting):
                continue
            b, c = np.asarray(bases, dtype=np.int64), np.asarray(conts, dtype=np.int64)
            now = ~merged[c]
            if not now.all():
                later.extend((int(x), blk, int(y)) for x, y in zip(b[~now], c[~now], strict=True))
                b, c = b[now], c[now]
            ids = b[:, None] + blk.accepting[None, :]  # (copies, accepting)
            mine = t[ids]
            theirs = t[c][:, None, :]
            if ((mine != n) & (theirs != n)).any():
                raise Fallback("a piece's end and its continuation read the same byte")
            t[ids] = np.where(mine == n, theirs, mine)
        for base, blk, cont in sorted(later, key=lambda x: x[0]):
            ids = blk.accepting + base
            mine = t[ids]
            theirs = t[cont]
            if ((mine != n) & (theirs != n)).any():
                raise Fallback("a piece's end and its continuation read the same byte")
            t[ids] = np.where(mine == n, theirs, mine)
        if self.block_union:
            self.finish_block_unions(t)
        return t, byte_map

    def classes(self, table: np.ndarray, acc: np.ndarray, dist: np.ndarray) -> np.ndarray | None:
        """Per state (the dead state last): its class in the minimal DFA, by structure instead of
        refinement rounds, or None where the structure does not prove it (then refine).

        States are taken in id order (a state's continuation, and everything it leads to, has a
        smaller id): the final state; a literal state is its byte range and its target's class; a
        copy's state is its block's own class with the continuation's class (equal blocks with
        equal continuations: equal states), or that continuation's class where the state's own
        language is the empty string, or the dead state's class where it accepts nothing.
        # NOTE: that partition never merges too much. It merges enough where no two of its
        # classes with equal invariants (acceptance, shortest accepted length, the set of live
        # bytes; then also those of every state up to `LOOK_AHEAD` bytes further) could be
        # equal: two literal classes never are (different first bytes or different rests); two
        # classes of one block with one
        # continuation class are not (the block's own classes differ and no accepting state of
        # the block reads a byte its continuation starts with, so where one string splits into
        # the block's part and the continuation's is fixed), nor are equal own classes with
        # different continuations (the same argument from a shortest word of the block). Other
        # pairs with equal invariants (a block whose loop the next piece repeats, as in the
        # email format's local part) return None.
        """
        n = self.size
        fast = self._fresh_classes()
        if fast is not None:
            cls, live, made, groups = fast
        else:
            cls, live, made, groups = self._hash_consed_classes()
        for blk, bases, offs, kcs, lks in groups.values():
            at = np.asarray(bases, dtype=np.int64)[:, None]
            ids2 = at + np.arange(blk.size)  # (copies, size)
            cls[ids2] = np.asarray(offs, dtype=np.int64)[:, None] + blk.classes
            if len(blk.eps):
                cls[at + blk.eps] = np.asarray(kcs, dtype=np.int64)[:, None]
            if len(blk.void):
                cls[at + blk.void] = 0
            live[ids2] = blk.live_bytes  # the copies' ids are disjoint: no index repeats below
            if len(blk.accepting):
                live[at + blk.accepting] += np.asarray(lks, dtype=np.uint64)[:, None]
        num = max(int(cls.max()) + 1, max((o + k for o, k, _, _ in made), default=0))
        # the classes' invariants (from any member) and what each class was made of
        any_rep = np.zeros(num, dtype=np.int64)
        any_rep[cls] = np.arange(n + 1)
        inv = (dist[any_rep] + 1) * 2 + acc[any_rep]
        lh = live[any_rep]
        blk_of = np.full(num, -1, dtype=np.int64)  # -1: a literal class (or the final or dead one)
        cont_of = np.zeros(num, dtype=np.int64)
        own_of = np.zeros(num, dtype=np.int64)
        if made:
            m = np.asarray(made, dtype=np.int64)
            ids_ = concat_ranges(m[:, 0], m[:, 1])
            blk_of[ids_] = np.repeat(m[:, 2], m[:, 1])
            cont_of[ids_] = np.repeat(m[:, 3], m[:, 1])
            own_of[ids_] = ids_ - np.repeat(m[:, 0], m[:, 1])
        if self.block_union or self.cyclic_states:  # NOTE: never proven apart by their keys alone (`direct_loops`)
            bu = cls[np.fromiter([*self.block_union, *self.cyclic_states], dtype=np.int64)]
            blk_of[bu] = (1 << 40) + bu
        used = np.zeros(num, dtype=bool)
        used[cls] = True
        used[0] = False
        live_cls = np.flatnonzero(used)
        o = live_cls[np.lexsort((lh[live_cls], inv[live_cls]))]
        eq = (inv[o[1:]] == inv[o[:-1]]) & (lh[o[1:]] == lh[o[:-1]])
        if eq.any():
            # NOTE: a group of classes with equal invariants is proven apart when all are literal
            # classes, or all come from one block and share the continuation class or the own class
            starts = np.flatnonzero(np.concatenate([[True], ~eq]))
            ok = _proven_apart(o, starts, blk_of, cont_of, own_of)
            if not ok.all():
                # NOTE: look a few bytes further where the invariants do not tell the classes
                # apart (their successors' invariants, a few Moore rounds on those classes only)
                sizes = np.diff(np.append(starts, len(o)))
                grp = np.repeat(np.arange(len(starts)), sizes)
                sel = np.flatnonzero(~ok[grp])
                h0 = live * np.uint64(0xC2B2AE3D27D4EB4F) + (dist * 2 + acc + 2).astype(np.uint64)
                sig = look_ahead(table, h0, any_rep[o[sel]], LOOK_AHEAD)
                order2 = np.lexsort((sig, grp[sel]))
                o2 = o[sel][order2]
                s_sorted, g_sorted = sig[order2], grp[sel][order2]
                eq2 = (s_sorted[1:] == s_sorted[:-1]) & (g_sorted[1:] == g_sorted[:-1])
                if eq2.any():
                    st2 = np.flatnonzero(np.concatenate([[True], ~eq2]))
                    if not _proven_apart(o2, st2, blk_of, cont_of, own_of).all():
                        return None
        return cls

    def _hash_consed_classes(self) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int, int]], dict[
            int, tuple[Block, list[int], list[int], list[int], list[int]]]]:
        """The classes of the states that pieces lead to (literal states, block starts, the final
        state), hash-consed one by one in id order, with their live-byte hashes; the classes made
        from blocks (first id, number, block number, continuation class); and per block its copies
        (bases, first ids, continuation classes, continuation live-byte hashes)."""
        n = self.size
        cls_l = [0] * (n + 1)  # the dead state's class is 0
        live_l = [0] * (n + 1)  # the hash of the set of bytes that lead to a state accepting something
        ids: dict[tuple[object, ...], int] = {}
        # per class made from a block: (first id, number, block number, continuation class)
        made: list[tuple[int, int, int, int]] = []
        block_no: dict[int, int] = {}
        num = 2
        for s in self.finals:
            cls_l[s] = 1
        lit_src, lit_lo, lit_hi, lit_dst = self.lit_src, self.lit_lo, self.lit_hi, self.lit_dst
        copies = self.copies
        multi = self.multi
        groups: dict[int, tuple[Block, list[int], list[int], list[int], list[int]]] = {}
        loop_rest: dict[int, tuple[object, ...]] = {}  # per loop class: its ranges outside S (`loop_alias`)
        for i in self.made:
            if i >= 0 and multi and lit_src[i] in multi:
                s = lit_src[i]
                loop_k = self.loop_key(s, cls_l, live_l) if self.loops else None
                key2, live = loop_k if loop_k is not None else _union_key([(lit_lo[j], lit_hi[j], cls_l[lit_dst[j]])
                                                                   for j in multi[s]])
                if key2 is None:
                    continue  # every range leads to a state that accepts nothing: stays dead
                alias = self.loop_alias(s, cls_l, loop_rest) if self.loops and loop_k is None else None
                c = ids.get(key2) if alias is None else alias
                if c is None:
                    c = ids[key2] = num
                    num += 1
                    if key2[0] == "L":
                        loop_rest[c] = self.loop_rest_of(key2)
                cls_l[s] = c
                live_l[s] = live
            elif i >= 0:
                d = lit_dst[i]
                kd = cls_l[d]
                if kd == 0:  # NOTE: leads only to a state that accepts nothing: stays dead
                    continue
                s = lit_src[i]
                lo = lit_lo[i]
                key = (lo, lit_hi[i], kd)
                c = ids.get(key)
                if c is None:
                    c = ids[key] = num
                    num += 1
                cls_l[s] = c
                live_l[s] = (BYTE_CUM[lit_hi[i] + 1] - BYTE_CUM[lo]) & MASK
            else:
                base, blk, cont, _, _ = copies[~i]
                kc = cls_l[cont]
                if kc == 0:
                    continue  # every state of the copy stays dead
                key = (-1 - id(blk), kc, 0)
                off = ids.get(key)
                if off is None:
                    off = ids[key] = num
                    num += blk.num_classes
                    made.append((off, blk.num_classes, block_no.setdefault(id(blk), len(block_no)), kc))
                lk = live_l[cont]
                _add_copy(groups, blk, base, off, kc, lk)
                st = base + blk.start
                own = blk.start_class
                cls_l[st] = off + own if own >= 0 else (kc if own == -1 else 0)
                live_l[st] = (blk.start_live + (lk if blk.start_accepting else 0)) & MASK
        return np.asarray(cls_l, dtype=np.int64), np.asarray(live_l, dtype=np.uint64), made, groups

    def _fresh_classes(self) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int, int]], dict[
            int, tuple[Block, list[int], list[int], list[int], list[int]]]] | None:
        """`_hash_consed_classes` where no key repeats (no two literal states with one byte range
        into one class, no two copies of one block with one continuation class): every literal
        state its own class at once, the copies in id order; None where a key repeats or a piece
        leads to a state that accepts nothing (then the hash-consing loop). A union state's key is
        its canonical set of ranges (`_union_key`).
        # NOTE: with no repeated key the loop would give every item a fresh class: the same
        # partition (other ids)
        """
        n = self.size
        src, lo, hi, dst = self._lit("src"), self._lit("lo"), self._lit("hi"), self._lit("dst")
        cls = np.zeros(n + 1, dtype=np.int64)
        cls[self.finals] = 1
        cls[src] = 2 + np.arange(len(src))  # a union state: its last entry's (one id per state)
        live = np.zeros(n + 1, dtype=np.uint64)
        if self.multi:  # NOTE: a union state's live bytes: the sum over its ranges (wrapping)
            np.add.at(live, src, BYTE_CUM_U64[hi + 1] - BYTE_CUM_U64[lo])
        else:
            live[src] = BYTE_CUM_U64[hi + 1] - BYTE_CUM_U64[lo]
        num = 2 + len(src)
        made: list[tuple[int, int, int, int]] = []
        block_no: dict[int, int] = {}
        groups: dict[int, tuple[Block, list[int], list[int], list[int], list[int]]] = {}
        for base, blk, cont, _, _ in self.copies:  # NOTE: in id order (continuations first)
            kc = int(cls[cont])
            own = blk.start_class
            if kc == 0 or own == -2:
                return None
            off = num
            num += blk.num_classes
            made.append((off, blk.num_classes, block_no.setdefault(id(blk), len(block_no)), kc))
            lk = int(live[cont])
            _add_copy(groups, blk, base, off, kc, lk)
            st = base + blk.start
            cls[st] = off + own if own >= 0 else kc
            live[st] = (blk.start_live + (lk if blk.start_accepting else 0)) & MASK
        kd = cls[dst]
        if len(kd) and not kd.all():
            return None
        if self.block_union:  # NOTE: a block-union state reads as its block start too
            bu = np.fromiter(self.block_union, dtype=np.int64)
            live[bu] += live[np.fromiter(self.block_union.values(), dtype=np.int64)]
        lit_keys = (lo * 128 + hi) * (num + 1) + kd
        if self.multi:
            in_union = np.zeros(n + 1, dtype=bool)
            in_union[list(self.multi)] = True
            lit_keys = lit_keys[~in_union[src]]
            kd_l = kd.tolist()
            if self.loops:  # NOTE: a loop state's own loops: -1 (`loop_key`)
                own = dst == src
                kd_l = np.where(own, -1, kd).tolist()
            lit_lo, lit_hi = self.lit_lo, self.lit_hi
            raw = {u: _union_key([(lit_lo[j], lit_hi[j], kd_l[j]) for j in e], live=False)[0]
                   for u, e in self.multi.items()}
            loop_rest: dict[int, tuple[object, ...]] = {}
            if self.loops:
                for u, k in raw.items():
                    if (k is not None and isinstance(k[0], tuple) and u in self.loops and u not in self.block_union
                            and u not in self.cyclic_states):
                        loop_rest[int(cls[u])] = self.loop_rest_of(("L", *k))
            keys: set[object] = set()
            for u, k in raw.items():
                if loop_rest and u not in self.loops and self.loop_alias(u, cls, loop_rest) is not None:
                    return None  # a union state that is a loop state: the loop merges them
                special = u in self.block_union or u in self.cyclic_states
                # NOTE: a union whose ranges merge into one range has a literal state's key: the loop
                if k is None or not (special or isinstance(k[0], tuple)):
                    return None
                if special:
                    keys.add(("U", u) if u in self.cyclic_states else ("B", int(cls[self.block_union[u]]), k))
                else:
                    keys.add(k)
            if len(keys) < len(self.multi):
                return None
        copy_keys = np.asarray([b * (num + 1) + k for _, _, b, k in made], dtype=np.int64)
        if _repeats(lit_keys) or _repeats(copy_keys):
            return None
        return cls, live, made, groups

    def _after_quote(self, s: int) -> int | None:
        """The target of literal state `s` where it reads a closing quote and nothing else (not a
        union state), else None."""
        if s in self.multi:
            return None
        e = self._entries(s)
        if e is None:
            return None
        i = e[0]
        return self.lit_dst[i] if self.lit_lo[i] == self.lit_hi[i] == 0x22 else None

    def string_states(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The states of copies of JSON string bodies (`Block.string_body`) followed by a
        literal closing quote, each behaving exactly like a state of the string automaton T: (the
        states, their T state, characters still allowed, still required, the state after the
        closing quote)."""
        parts = []
        for base, blk, cont, _, _ in self.copies:
            facts = blk.string_facts
            if facts is not None:
                after = self._after_quote(cont)
                if after is not None:
                    keep, ts, rem, need = facts
                    parts.append((base + keep, ts, rem, need, np.full(len(keep), after, dtype=np.int64)))
        if not parts:
            e = np.zeros(0, dtype=np.int64)
            return e, e, e, e, e
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(5))  # type: ignore[return-value]

    def fragment_states(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per format with a block map (`Block.fragment`): the states of its copies followed by a
        literal closing quote, their F states and the state after the quote."""
        parts: dict[str, list[tuple[np.ndarray, np.ndarray, int]]] = {}
        for base, blk, cont, _, _ in self.copies:
            if blk.fragment is not None and blk.fragment_facts is not None:
                after = self._after_quote(cont)
                if after is not None:
                    keep, fs = blk.fragment_facts
                    parts.setdefault(blk.fragment[0], []).append((base + keep, fs, after))
        return {fmt: (np.concatenate([p[0] for p in ps]), np.concatenate([p[1] for p in ps]),
                      np.concatenate([np.full(len(p[0]), p[2], dtype=np.int64) for p in ps])) for fmt, ps in parts.items()}

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(accepting, shortest accepted lengths) of every state, the dead state last."""
        n = self.size
        acc = np.zeros(n + 1, dtype=bool)
        dist = np.full(n + 1, -1, dtype=np.int64)
        for s in self.finals:
            acc[s] = True
            dist[s] = 0
        dist[self._lit("src")] = self._lit("dist")
        # every block's copies at once (copies occupy disjoint ids)
        groups: dict[int, tuple[Block, list[int], list[int], list[int]]] = {}
        for base, blk, _, cacc, d in self.copies:
            g = groups.get(id(blk))
            if g is None:
                g = groups[id(blk)] = (blk, [], [], [])
            if cacc:
                g[1].append(base)
            if d >= 0:
                g[2].append(base)
                g[3].append(d)
        for blk, acc_bases, dist_bases, ds in groups.values():
            if acc_bases and len(blk.accepting):
                acc[(np.asarray(acc_bases, dtype=np.int64)[:, None] + blk.accepting).reshape(-1)] = True
            if dist_bases:
                vals = np.where(blk.dist >= 0, blk.dist + np.asarray(ds, dtype=np.int64)[:, None], -1)
                dist[np.asarray(dist_bases, dtype=np.int64)[:, None] + np.arange(blk.size)] = vals
        if self.block_union:
            self.block_union_acceptance(acc)
        return acc, dist


def _repeats(keys: np.ndarray) -> bool:
    """Whether some value occurs twice in `keys` (`len(np.unique(keys)) < len(keys)`)."""
    k = np.sort(keys)
    return bool((k[1:] == k[:-1]).any())


def _add_copy(groups: dict[int, tuple[Block, list[int], list[int], list[int], list[int]]], blk: Block, base: int,
              off: int, kc: int, lk: int) -> None:
    """Records one copy of `blk` (first id, first class, continuation class and live hash) in its block's group."""
    g = groups.get(id(blk))
    if g is None:
        g = groups[id(blk)] = (blk, [], [], [], [])
    g[1].append(base)
    g[2].append(off)
    g[3].append(kc)
    g[4].append(lk)


def _union_key(ranges: list[tuple[int, int, int]], live: bool = True) -> tuple[tuple[object, ...] | None, int]:
    """The hash-consing key of a union state from its ranges (lo, hi, target class) and the hash of
    its live bytes: ranges into the dead class dropped, adjacent ones into one class merged, so
    that a key is a function of the state's byte -> class map (one range: a literal state's key).
    (None, 0) where no range is live; with `live` False, 0 for the hash (not computed)."""
    out: list[list[int]] = []
    for lo, hi, k in sorted(r for r in ranges if r[2] != 0):
        if out and out[-1][1] + 1 == lo and out[-1][2] == k:
            out[-1][1] = hi
        else:
            out.append([lo, hi, k])
    if not out:
        return None, 0
    key: tuple[object, ...] = tuple(out[0]) if len(out) == 1 else tuple(tuple(x) for x in out)
    if not live:  # the key only (the live-byte hash: 0)
        return key, 0
    h = 0
    for lo, hi, _ in out:
        h += BYTE_CUM[hi + 1] - BYTE_CUM[lo]
    return key, h & MASK


def _proven_apart(order: np.ndarray, starts: np.ndarray, blk_of: np.ndarray, cont_of: np.ndarray,
                  own_of: np.ndarray) -> np.ndarray:
    """Per group of classes (`order` cut at `starts`), whether its members are known to be pairwise
    distinct: all literal classes, or all from one block with one continuation class or one own class."""
    b, k, q = blk_of[order], cont_of[order], own_of[order]
    one_block = np.minimum.reduceat(b, starts) == np.maximum.reduceat(b, starts)
    literal = np.maximum.reduceat(b, starts) < 0
    same_cont = np.minimum.reduceat(k, starts) == np.maximum.reduceat(k, starts)
    same_own = np.minimum.reduceat(q, starts) == np.maximum.reduceat(q, starts)
    return one_block & (literal | same_cont | same_own)  # type: ignore[no-any-return]


def build_dfa_direct(node: Node, *, force: bool = False, limit: int = DEFAULT_MAX_DFA_STATES) -> Dfa | None:
    """The minimal DFA of `node`, equal to `build_dfa(node, limit=limit)`, or None where the tree
    does not fit the direct construction, would pass `limit` states (`CfsmLimits.max_dfa_states`)
    or (unless `force`) would not be faster: then use `build_dfa`. Mutates nothing."""
    b = _Builder(limit)
    try:
        counts: dict[int, int] = {}
        b.count_blocks(node, counts, set())
        # NOTE: each distinct block built per compile pays a subset construction's fixed cost; the
        # generic construction pays it once for the whole tree: worth it only where blocks repeat
        # or are prepared (standard pieces, `prepare_blocks`)
        # (with whitespace runs around many literal pieces, always: the generic construction's
        # subsets multiply there; free JSON, its runs inside blocks, stays generic)
        if not force and b.saw_loop < _MANY_RUNS and 2 * len(counts.keys() - b.prepared_keys) > sum(counts.values()):
            return None
        final = b.final()
        start = b.build(node, final)
        if start == final:
            return None  # the empty string: nothing to gain
        t, byte_map = b.table()
    except Fallback:
        return None
    acc, dist = b.arrays()
    # NOTE: unreachable states (a literal state whose every entry was merged into a block's
    # accepting rows) are dropped by the breadth-first numbering
    cls = b.classes(t, acc, dist)
    if cls is None:
        dfa = minimize(t, acc, start, byte_map, dist=dist, bfs=True)
        new_ids = None
    else:
        dfa, new_ids = minimal_dfa(t, acc, start, byte_map, cls)
    if new_ids is not None:
        text: tuple[np.ndarray, np.ndarray] | None = None
        strings, ts, rem, need, cont = b.string_states()
        if len(strings):
            at = new_ids[strings]
            live = at < dfa.num_states  # reachable
            mine = np.zeros(dfa.num_states + 1, dtype=bool)
            mine[at[live]] = True
            # NOTE: `DirectFacts.string_text`
            values = np.full((4, dfa.num_states + 1), -1, dtype=np.int64)
            values[:, at[live]] = np.stack([ts[live], rem[live], need[live], new_ids[cont[live]]])
            text = (mine, values)
        # NOTE: `DirectFacts.fragment_states` (read by `index.build_index` instead of
        # `fragments.match_fragment`)
        frags = {}
        for fmt, (states, fs, conts) in b.fragment_states().items():
            at = new_ids[states]
            live = at < dfa.num_states
            f = np.full(dfa.num_states + 1, -1, dtype=np.int64)
            c = np.full(dfa.num_states + 1, dfa.dead, dtype=np.int64)
            f[at[live]] = fs[live]
            c[at[live]] = new_ids[conts[live]]
            frags[fmt] = (f, c)
        dfa = dataclasses.replace(dfa, facts=DirectFacts(string_text=text, fragment_states=frags))
    return dfa
