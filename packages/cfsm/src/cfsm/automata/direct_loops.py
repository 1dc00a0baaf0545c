"""Loop states of the direct construction (`direct`): whitespace runs ``[ \\t\\n\\r]*``.

With flexible whitespace a JSON Schema's tree puts a run of whitespace (an unbounded repeat of
ASCII ranges S) before and after every structural character. `direct._Builder` builds such a
run, in front of its continuation c, as one state L that loops on S:

- c a literal or union state: L has the ranges of S into L itself and c's other ranges (where
  c reads S, into a loop state on S whose other ranges are all c's, such as the run before a
  closing bracket that an empty array also reaches: S* S* is S*); c itself where c loops on S;
- a union of loop states on S (after a value: the run before a comma or the closing bracket)
  is one loop state on S with the union of their other ranges (`loop_union`);
- c a block's start (a number), or a choice between literal states and one block (an empty
  array or its first item, `block_choice`): a *block-union* state, literal ranges (the loop's)
  that take the block start's row too once the blocks are placed (`finish_block_unions`).

In the structural classes a loop state's key names its own loops with the class -1 and a
block-union state's key adds its block start's class (equal keys: equal languages); block-union
classes are never taken as proven apart by their keys alone (`direct._Builder.classes`).
"""

from __future__ import annotations

import numpy as np

from cfsm.automata.block_facts import BYTE_CUM, MASK
from cfsm.automata.blocks import Fallback, is_loop
from cfsm.regex.syntax import Alt, Cat, Chars, Intersect, Node, Repeat, Sep

__all__ = ["loop_sep", "LoopStates"]


def loop_sep(node: Node, memo: dict[int, bool]) -> bool:
    """Whether `node` holds a list (`Sep`) whose separator starts with a whitespace run (free
    JSON, unbounded arrays): its block would end reading the run that its continuation (the
    run before the closing bracket) starts with. `memo`: by node id (one tree)."""
    hit = memo.get(id(node))
    if hit is None:
        memo[id(node)] = False  # NOTE: recursive references (Shared) end here
        if isinstance(node, Sep):
            sep = node.sep
            hit = (isinstance(sep, Cat) and bool(sep.items) and is_loop(sep.items[0])) or loop_sep(node.item, memo)
        elif isinstance(node, Cat | Alt | Intersect):
            hit = any(loop_sep(it, memo) for it in node.items)
        else:
            item = getattr(node, "item", None)
            hit = item is not None and loop_sep(item, memo)
        memo[id(node)] = hit
    return hit


def _bits(lo: int, hi: int) -> int:
    return (1 << (hi + 1)) - (1 << lo)


def _ranges_bits(ranges: tuple[tuple[int, int], ...]) -> int:
    bits = 0
    for lo, hi in ranges:
        bits |= _bits(lo, hi)
    return bits


def _disjoint(entries: list[tuple[int, int, int]], bits: int = 0) -> int:
    """The bytes `entries` read (with `bits`), raising `Fallback` where two of them overlap."""
    for lo, hi, _ in entries:
        b = _bits(lo, hi)
        if b & bits:
            raise Fallback("two choices after a whitespace run read the same byte")
        bits |= b
    return bits


class LoopStates:
    """The loop-state part of `direct._Builder` (a mixin: it uses the builder's tables)."""

    size: int
    entry: dict[int, tuple[bool, int, int]]
    lit_src: list[int]
    lit_lo: list[int]
    lit_hi: list[int]
    lit_dst: list[int]
    lit_dist: list[int]
    finals: list[int]
    multi: dict[int, list[int]]
    made: list[int]

    def _entries(self, s: int) -> list[int] | None:
        raise NotImplementedError

    def _literal_state(self, entries: list[tuple[int, int, int]]) -> int:
        raise NotImplementedError

    def build(self, node: Node, cont: int) -> int:
        raise NotImplementedError

    def _init_loops(self) -> None:
        # loop states (block-union ones too): their loop bytes (256-bit int) and ranges
        self.loops: dict[int, tuple[int, tuple[tuple[int, int], ...]]] = {}
        self.block_union: dict[int, int] = {}  # block-union state -> its block's start
        self._loop_consed: dict[tuple[object, ...], int] = {}  # `_state`'s states by key
        self.saw_loop = 0  # whitespace runs `count_blocks` met
        self._sep_memo: dict[int, bool] = {}  # `loop_sep` by node id
        self.pending: set[int] = set()  # states of `loop_list` whose ranges are not set yet
        # `loop_list`'s states after an item: their continuation and the separator's first range
        self.cyclic_states: dict[int, tuple[int, int, int]] = {}
        self._run_bits: dict[tuple[tuple[int, int], ...], int] = {}  # a run's bytes by its ranges

    def _ranges(self, s: int) -> list[tuple[int, int, int]]:
        """The literal ranges (lo, hi, target) of a literal, union or block-union state."""
        return [(self.lit_lo[i], self.lit_hi[i], self.lit_dst[i]) for i in self.multi.get(s) or self._entries(s) or []]

    def loop(self, node: Repeat, cont: int) -> int:
        """`build(node, cont)` for a whitespace run (`is_loop`)."""
        assert isinstance(node.item, Chars)
        ranges = node.item.ranges
        s_bits = self._run_bits.get(ranges)
        if s_bits is None:
            s_bits = self._run_bits[ranges] = _ranges_bits(ranges)
        if cont in self.pending:
            raise Fallback("a whitespace run before a list's own continuation")
        hit = self.loops.get(cont)
        if hit is not None and hit[0] == s_bits:
            return cont  # S* S* R is S* R
        start = self.block_union.get(cont)
        cont_bits = self.entry[cont][2]
        if start is None and self._entries(cont) is None:
            if cont in self.finals:
                raise Fallback("a whitespace run at the end")
            start = cont  # a block's start
            rest: list[tuple[int, int, int]] = []
        elif start is None and not cont_bits & s_bits:  # most runs: before a literal state
            return self._state(s_bits, ranges, self._ranges(cont), None, s_bits | cont_bits)
        else:
            rest = self._rest_of(cont, s_bits)
        if start is not None and self.entry[start][2] & s_bits:
            raise Fallback("a whitespace run before a block that reads it")
        return self._state(s_bits, ranges, rest, start)

    def _rest_of(self, s: int, s_bits: int) -> list[tuple[int, int, int]]:
        """The ranges of state `s` outside S, where its ranges reading S lead to loop states on S
        whose other ranges are all among s's (so S* s is S* (s without them))."""
        ranges = self._ranges(s)
        out = [e for e in ranges if not _bits(e[0], e[1]) & s_bits]
        mine = set(out)
        for lo, hi, t in ranges:
            b = _bits(lo, hi)
            if not b & s_bits or t == s:
                continue
            hit = self.loops.get(t)
            if (b & ~s_bits or hit is None or hit[0] != s_bits or t in self.block_union
                    or not set(self._rest_of(t, s_bits)) <= mine):
                raise Fallback("a whitespace run before a state that reads it otherwise")
        return out

    def _state(self, s_bits: int, ranges: tuple[tuple[int, int], ...], rest: list[tuple[int, int, int]],
               start: int | None = None, bits: int | None = None) -> int:
        """A state looping on the ranges S (none where `s_bits` is 0) with the other ranges `rest`
        and, with `start`, the row of that block start (made once per key); `bits`: the bytes
        read where known to be disjoint (else checked)."""
        key = (ranges, start, *sorted(rest))
        hit = self._loop_consed.get(key)
        if hit is not None:
            return hit
        s = self.size
        self.size += 1
        if bits is None:
            bits = _disjoint(rest, s_bits)
        dists = [self.entry[t][1] for _, _, t in rest if self.entry[t][1] >= 0]
        acc = False
        if start is not None:
            acc, d0, b0 = self.entry[start]
            if b0 & bits:
                raise Fallback("a choice before a block that reads its byte")
            bits |= b0
            dists.extend([d0 - 1] if d0 >= 0 else [])
        d = min(dists) + 1 if dists else -1
        self.entry[s] = (acc, d, bits)
        first = len(self.lit_src)
        for lo, hi, t in sorted([*rest, *((lo, hi, s) for lo, hi in ranges)]):
            self.lit_src.append(s)
            self.lit_lo.append(lo)
            self.lit_hi.append(hi)
            self.lit_dst.append(t)
            self.lit_dist.append(d)
        if len(self.lit_src) == first:
            raise Fallback("a block choice without literal ranges")
        self.multi[s] = list(range(first, len(self.lit_src)))
        self.made.append(first)
        if s_bits:
            self.loops[s] = (s_bits, ranges)
        if start is not None:
            self.block_union[s] = start
        self._loop_consed[key] = s
        return s

    def loop_list(self, node: Sep, cont: int) -> int:
        """`build(node, cont)` for a list whose separator starts with a whitespace run (`item (S*
        sep-rest item)*` before cont, a loop state on the same S: an array's items before ``S* ]``).

        The state U after an item (a loop state on S: the separator's rest or cont's other ranges)
        is made first and its ranges set once the item is built in front of it. The table is then
        cyclic: U's class is a fresh one, never proven apart by its key (`loop_key`)."""
        sep = node.sep
        if not (isinstance(sep, Cat) and len(sep.items) > 1 and is_loop(sep.items[0])):
            raise Fallback("a list separator")
        first = sep.items[0]
        assert isinstance(first, Repeat) and isinstance(first.item, Chars)
        ranges = first.item.ranges
        s_bits = self.lead_loop(sep, cont)
        hit = self.loops.get(cont)
        lead = sep.items[1]
        if (hit is None or hit[0] != s_bits or cont in self.block_union or not isinstance(lead, Chars)
                or len(lead.ranges) != 1 or lead.ranges[0][1] >= 0x80):
            raise Fallback("a list before a state that is not a run of its separator's bytes")
        rest_c = self._rest_of(cont, s_bits)
        u = self.size
        self.size += 1
        self.entry[u] = (False, self.entry[cont][1], s_bits | self.entry[cont][2] | _bits(*lead.ranges[0]))
        # NOTE: U takes its class before the item's states (which lead to it): a fresh one (`loop_key`)
        pos = len(self.made)
        self.made.append(-1)
        self.cyclic_states[u] = (cont, *lead.ranges[0])
        self.pending.add(u)
        x = self.build(node.item, u)
        self.pending.discard(u)
        p = self.build(Cat(sep.items[1:]), x)
        if self._entries(p) is None or self.entry[p][2] & s_bits:
            raise Fallback("a list separator")
        rest = [*self._ranges(p), *rest_c]
        _disjoint(rest, s_bits)
        d = self.entry[u][1]
        at = len(self.lit_src)
        for lo, hi, t in sorted([*rest, *((lo, hi, u) for lo, hi in ranges)]):
            self.lit_src.append(u)
            self.lit_lo.append(lo)
            self.lit_hi.append(hi)
            self.lit_dst.append(t)
            self.lit_dist.append(d)
        self.multi[u] = list(range(at, len(self.lit_src)))
        self.made[pos] = at
        self.loops[u] = (s_bits, ranges)
        return x

    def block_choice(self, heads: list[int], start: int) -> int:
        """The union of literal, union or loop states `heads` (their `_union`) and the state
        `start` built for a choice led by a block: a literal or union state (their union), a
        block's start or a block-union state (a block-union state with all their ranges)."""
        if start in self.finals or start in self.pending:
            raise Fallback("a choice of blocks")
        if self._entries(start) is not None:  # not led by a block after all (a shared tail)
            u = self._union([*heads, start])
            _disjoint(self._ranges(u))
            return u
        head = heads[0] if len(heads) == 1 else self._union(heads)
        if self.entry[head][2] & self.entry[start][2]:
            raise Fallback("a choice before a block that reads its byte")
        # NOTE: a loop head keeps its ranges into itself (S* R or the block: not S* (R or the block))
        rest = self._ranges(head)
        if start in self.block_union:
            rest += self._ranges(start)
            start = self.block_union[start]
        return self._state(0, (), rest, start)

    def _union(self, heads: list[int]) -> int:
        raise NotImplementedError

    def lead_loop(self, node: Node, cont: int) -> int:
        """The loop bytes of the state `build(node, cont)` makes where it is a loop state (a
        whitespace run first, or the empty string before a loop state), else 0."""
        if isinstance(node, Cat):
            if not node.items:
                hit = self.loops.get(cont)
                return 0 if hit is None or cont in self.block_union else hit[0]
            node = node.items[0]
        if is_loop(node):
            assert isinstance(node, Repeat) and isinstance(node.item, Chars)
            bits = 0
            for lo, hi in node.item.ranges:
                bits |= _bits(lo, hi)
            return bits
        return 0

    def loop_union(self, heads: list[int]) -> int | None:
        """`_union(heads)` where two or more heads are loop states on one S: one loop state on S
        with all their other ranges, in a union with the other heads (which must not read S).
        None where at most one head is a loop state (the plain union is right)."""
        loops = [h for h in heads if h in self.loops and h not in self.block_union]
        if len(loops) < 2:
            return None
        s_bits, ranges = self.loops[loops[0]]
        if any(self.loops[h][0] != s_bits for h in loops):
            raise Fallback("a union of runs of different bytes")
        rest: dict[tuple[int, int, int], None] = {}
        for h in loops:
            for e in self._rest_of(h, s_bits):
                rest[e] = None
        merged = self._state(s_bits, ranges, list(rest))
        others = [h for h in heads if h not in loops]
        if not others:
            return merged
        extra: list[tuple[int, int, int]] = []
        for h in others:
            if self._entries(h) is None or self.entry[h][2] & s_bits:
                raise Fallback("a union of a run and a state that reads it")
            extra.extend(self._ranges(h))
        _disjoint([*rest, *extra])
        return self._literal_state([*((lo, hi, merged) for lo, hi in ranges), *rest, *extra])

    def loop_key(self, s: int, cls_l: list[int], live_l: list[int]) -> tuple[tuple[object, ...] | None, int] | None:
        """The hash-consing key and live-byte hash of a loop or block-union state `s` (the classes
        of its targets from `cls_l`, its own loops marked -1), None where `s` is not one."""
        start = self.block_union.get(s)
        if start is None and s not in self.loops:
            return None
        cyc = self.cyclic_states.get(s)
        if cyc is not None:  # a fresh class, dead where the list's continuation is
            c, lo, hi = cyc
            return (("U", s), (live_l[c] + BYTE_CUM[hi + 1] - BYTE_CUM[lo]) & MASK) if cls_l[c] else (None, 0)
        live = 0
        parts: list[list[int]] = []
        for lo, hi, k in sorted((lo, hi, -1 if t == s else cls_l[t]) for lo, hi, t in self._ranges(s)):
            if k == 0:
                continue  # into a state that accepts nothing
            live += BYTE_CUM[hi + 1] - BYTE_CUM[lo]
            if parts and parts[-1][1] + 1 == lo and parts[-1][2] == k:  # as `_union_key`: one range per run
                parts[-1][1] = hi
            else:
                parts.append([lo, hi, k])
        live_start = start is not None and cls_l[start] != 0
        if not live_start and all(k == -1 for _, _, k in parts):
            return None, 0  # no way out of the loop: accepts nothing (dead)
        if start is not None and live_start:
            return ("B", cls_l[start], *(tuple(x) for x in parts)), (live + live_l[start]) & MASK
        return ("L", *(tuple(x) for x in parts)), live & MASK

    def loop_alias(self, s: int, cls_l: list[int] | np.ndarray, loop_rest: dict[int, tuple[object, ...]]) -> int | None:
        """The class of the loop state that union state `s` equals, if any: `s` reads every byte
        of S (and only those) into one loop class c on S, and its other ranges are c's
        (`loop_rest`: per loop class its ranges outside S): S L | R is S* R, L itself."""
        if s in self.block_union or s in self.loops:  # reads as its block too / its own key
            return None
        rng = self._ranges(s)
        loops = {self.loops[t][0] for _, _, t in rng if t in self.loops and t not in self.block_union}
        if len(loops) != 1:
            return None
        s_bits = loops.pop()
        covered = 0
        into: set[int] = set()
        parts: list[list[int]] = []
        for lo, hi, t in sorted(rng):
            b = _bits(lo, hi)
            k = int(cls_l[t])
            if b & s_bits:
                if b & ~s_bits:
                    return None
                covered |= b
                into.add(k)
                k = -1
            elif k == 0:
                continue
            if parts and parts[-1][1] + 1 == lo and parts[-1][2] == k:
                parts[-1][1] = hi
            else:
                parts.append([lo, hi, k])
        if covered != s_bits or len(into) != 1:
            return None
        c = into.pop()
        return c if loop_rest.get(c) == tuple(tuple(x) for x in parts if x[2] != -1) else None

    @staticmethod
    def loop_rest_of(key: tuple[object, ...]) -> tuple[object, ...]:
        """A loop state's ranges outside S from its key (`loop_key`'s "L" keys)."""
        return tuple(x for x in key[1:] if isinstance(x, tuple) and x[2] != -1)

    def finish_block_unions(self, t: np.ndarray) -> None:
        """Give every block-union state its block start's row (the blocks placed and merged; a
        start is a plain block start, whose row is final by then)."""
        n = t.shape[0] - 1
        states = np.fromiter(self.block_union, dtype=np.int64, count=len(self.block_union))
        rows = t[np.fromiter(self.block_union.values(), dtype=np.int64, count=len(self.block_union))]
        mine = t[states]
        if ((mine != n) & (rows != n)).any():
            raise Fallback("a choice before a block that reads its byte")
        t[states] = np.where(mine == n, rows, mine)

    def block_union_acceptance(self, acc: np.ndarray) -> None:
        """A block-union state accepts where its block start does."""
        for s, start in self.block_union.items():
            acc[s] = acc[start]
