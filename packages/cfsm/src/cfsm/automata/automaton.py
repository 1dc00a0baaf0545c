"""Syntax tree -> byte-level NFA (Thompson) -> DFA (subset construction) -> minimal DFA (Moore).

The DFA works on UTF-8 bytes, so it fits byte-level BPE and sentencepiece byte fallback alike.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cfsm.config import CfsmLimits
from cfsm.errors import GrammarTooLargeError
from cfsm.regex.charset import utf8_sequences
from cfsm.regex.syntax import Alt, Cat, Chars, Complement, Intersect, Node, Repeat, Scope, Sep, Shared

__all__ = ["ByteClasses", "Dfa", "DfaNode", "DirectFacts", "Unit", "build_dfa", "dfa_from_table", "unit_of"]

# the default of `CfsmLimits.max_dfa_states` (builds outside a compile: fixed trees such as the
# JSON string automaton, a unit's DFA, a grammar's regular parts)
DEFAULT_MAX_DFA_STATES = CfsmLimits().max_dfa_states


@dataclass(frozen=True, eq=False)
class ByteClasses:
    """A DFA's byte classes (bytes that step alike from every state) as its construction found
    them: `reps` a representative byte of each class (by class id), `of_byte` each byte's
    class, `table` the transitions with one column per class."""

    reps: np.ndarray  # (num_classes,) int64
    of_byte: np.ndarray  # (256,) int64
    table: np.ndarray  # (num_states + 1, num_classes) int32


@dataclass(frozen=True, eq=False)
class DirectFacts:
    """What the direct construction (`cfsm.automata.direct`) proves about its DFA's states, for
    the index (`cfsm.masks.templates.match_string_states`, `cfsm.masks.index.build_index`),
    which then skips its own recognition of those states.

    - `string_text` (None if it proved none): (states, values): per state ((num_states + 1,)
      bool) whether it is proven to be JSON string text followed by its closing quote, and
      ((4, num_states + 1) int64) its T state, characters still allowed and required, and the
      state after the closing quote (-1 where not proven).
    - `fragment_states`: per broad format (`json_automata.TABLE_FORMATS`) with states in the DFA,
      each state's F state (-1: none) and the state after the closing quote (formats absent: none).
    """

    string_text: tuple[np.ndarray, np.ndarray] | None = None
    fragment_states: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Dfa:
    """A trimmed, minimal DFA over bytes.

    `transitions` has shape (num_states + 1, 256); row `dead` (the last) is the dead state and
    every transition into a state that cannot reach acceptance goes to `dead`. `known_classes`:
    its byte classes where the construction found them (else computed on first use);
    `facts`: what the direct construction proved about its states (None: built otherwise).
    """

    transitions: np.ndarray  # (num_states + 1, 256) int32
    accepting: np.ndarray  # (num_states + 1,) bool
    start: int
    known_classes: ByteClasses | None = field(default=None, repr=False)
    facts: DirectFacts | None = field(default=None, repr=False)

    @property
    def dead(self) -> int:
        return int(self.transitions.shape[0] - 1)

    @property
    def num_states(self) -> int:
        return int(self.transitions.shape[0] - 1)

    def walk(self, state: int, data: bytes) -> int:
        """State after reading `data` from `state` (`dead` if rejected). Mutates nothing."""
        t = self.transitions
        for b in data:
            state = int(t[state, b])
        return state

    def fullmatch(self, data: bytes) -> bool:
        s = self.walk(self.start, data)
        return bool(self.accepting[s])

    @functools.cached_property
    def byte_classes(self) -> tuple[np.ndarray, np.ndarray]:
        """(representative byte of each class, class of each byte): bytes that step alike from
        every state. Computed on first use (or `known_classes`)."""
        if self.known_classes is not None:
            return self.known_classes.reps, self.known_classes.of_byte
        return _byte_classes(self.transitions)

    @functools.cached_property
    def class_table(self) -> np.ndarray:
        """The transitions with one column per byte class (`byte_classes`' representative byte of
        each), (num_states + 1, num_classes) int32. Computed on first use (or `known_classes`,
        set by `minimize`)."""
        if self.known_classes is not None:
            return self.known_classes.table
        return np.take(self.transitions, self.byte_classes[0], axis=1)


class Nfa:
    def __init__(self, max_states: int = 0, dfa_limit: int = DEFAULT_MAX_DFA_STATES,
                 counted_min: int | None = None) -> None:
        # > 0: `GrammarTooLargeError` once the NFA would pass this many states (`build_dfa`'s
        # cap, checked as states are made, so a build far over it stops early)
        self.max_states = max_states
        # the DFA limit of the DFAs built inside (intersections, complements: `build_dfa`'s `limit`)
        self.dfa_limit = dfa_limit
        # counted repeats of at least this many prefix-code units: one counter fragment
        # (`COUNTED_MIN` by default; either way the same minimal DFA)
        self.counted_min = COUNTED_MIN if counted_min is None else counted_min
        self.eps: list[list[int]] = []
        self.trans: list[list[tuple[int, int, int]]] = []
        self.shared: list[dict[int, tuple[int, int]]] = [{}]
        # states whose byte ranges were added sorted and disjoint, and no more are added later
        # (counted fragments and embedded DFAs): the subset construction takes them as they are
        self.presorted: set[int] = set()

    def new(self) -> int:
        if self.max_states and len(self.eps) >= self.max_states:
            raise GrammarTooLargeError(f"the NFA exceeds {self.max_states} states")
        self.eps.append([])
        self.trans.append([])
        return len(self.eps) - 1

    def build(self, node: Node) -> tuple[int, int]:
        if isinstance(node, Chars):
            return self._chars(node)
        if isinstance(node, Cat):
            if not node.items:
                s = self.new()
                return s, s
            s, e = self.build(node.items[0])
            for it in node.items[1:]:
                if isinstance(it, Chars):
                    # NOTE: a class's fresh start reached only through an epsilon edge from e is
                    # the same as starting its transitions at e (keys and literals: no epsilons)
                    r = it.ranges
                    if len(r) == 1 and r[0][1] < 0x80:  # one ASCII range (a literal character)
                        e2 = len(self.eps)
                        self.eps.append([])
                        self.trans.append([])
                        self.trans[e].append((r[0][0], r[0][1], e2))
                        e = e2
                    else:
                        e = self._chars(it, e)[1]
                    continue
                s2, e2 = self.build(it)
                self.eps[e].append(s2)
                e = e2
            return s, e
        if isinstance(node, Alt):
            s, e = self.new(), self.new()
            for it in node.items:
                s2, e2 = self.build(it)
                self.eps[s].append(s2)
                self.eps[e2].append(e)
            return s, e
        if isinstance(node, Repeat):
            return self._repeat(node)
        if isinstance(node, Intersect):
            dfa = build_dfa(node.items[0], limit=self.dfa_limit, counted_min=self.counted_min)
            for other in node.items[1:]:
                dfa = _product(dfa, build_dfa(other, limit=self.dfa_limit, counted_min=self.counted_min))
            return self._embed(dfa)
        if isinstance(node, Complement):
            return self._embed(_complement(build_dfa(node.item, limit=self.dfa_limit, counted_min=self.counted_min)))
        if isinstance(node, DfaNode):
            return self._embed(node.dfa)
        if isinstance(node, Shared):
            memo = self.shared[-1]
            key = id(node)
            if key not in memo:
                memo[key] = self.build(node.item)
            return memo[key]
        if isinstance(node, Scope):
            self.shared.append({})
            try:
                return self.build(node.item)
            finally:
                self.shared.pop()
        if isinstance(node, Sep):
            s, e = self.build(node.item)
            s2, e2 = self.build(node.sep)
            self.eps[e].append(s2)
            self.eps[e2].append(s)
            return s, e
        raise TypeError(f"unknown node {node!r}")

    def _repeat(self, node: Repeat) -> tuple[int, int]:
        if (node.lo if node.hi is None else node.hi) >= self.counted_min:
            unit = counted_unit(node.item)
            if unit is not None:
                return self._counted(unit, node.lo, node.hi)
        s = e = self.new()
        for _ in range(node.lo):
            s2, e2 = self.build(node.item)
            self.eps[e].append(s2)
            e = e2
        if node.hi is None:
            s2, e2 = self.build(node.item)
            loop = self.new()
            self.eps[e].append(loop)
            self.eps[loop].append(s2)
            self.eps[e2].append(loop)
            end = self.new()
            self.eps[loop].append(end)
            return s, end
        end = self.new()
        self.eps[e].append(end)
        for _ in range(node.hi - node.lo):
            s2, e2 = self.build(node.item)
            self.eps[e].append(s2)
            self.eps[e2].append(end)
            e = e2
        return s, end

    def _counted(self, unit: Unit, lo: int, hi: int | None) -> tuple[int, int]:
        """`unit` repeated lo..hi times (hi None: unbounded) as one deterministic fragment: its
        DFA states with a counter of completed units, instead of hi copies of its NFA."""
        top = lo if hi is None else hi
        n = len(unit.rows)
        end = self.new()
        # ids[j][q] = base + j * n + q: state q of the unit with j units completed; when bounded,
        # row top holds only the start (no unit may start there), as state base + top * n
        base = len(self.eps)
        count = (top + 1) * n if hi is None else top * n + 1
        self.eps.extend([] for _ in range(count))
        self.trans.extend([] for _ in range(count))
        last = top + 1 if hi is None else top  # rows with transitions
        for j in range(last):
            row0 = base + j * n
            done = row0 + n + unit.start if j < top else row0 + unit.start
            if hi is not None and j == top - 1:
                done = base + top * n  # the bounded last row's start
            for q, ranges in enumerate(unit.rows):
                # NOTE: unit rows are sorted disjoint ranges (from a DFA row), added in that order
                self.trans[row0 + q].extend([(a, b, done if t < 0 else row0 + t) for a, b, t in ranges])
        top_start = base + top * n + (unit.start if hi is None else 0)
        for j in range(lo, top + 1):
            self.eps[base + j * n + unit.start if j < top else top_start].append(end)
        self.presorted.update(range(base, base + count))
        return base + unit.start, end

    def _embed(self, dfa: Dfa) -> tuple[int, int]:
        """A DFA as an NFA fragment (one NFA state per live DFA state)."""
        n = dfa.num_states
        ids = [self.new() for _ in range(n)]
        end = self.new()
        trans = dfa.transitions
        for q in range(n):
            row = trans[q]
            cuts = np.flatnonzero(np.diff(row)) + 1
            starts = np.concatenate([[0], cuts])
            ends = np.concatenate([cuts - 1, [255]])
            for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
                dst = int(row[lo])
                if dst != dfa.dead:
                    self.trans[ids[q]].append((lo, hi, ids[dst]))
            if dfa.accepting[q]:
                self.eps[ids[q]].append(end)
        if n == 0:
            return self.new(), end
        return ids[dfa.start], end

    def _chars(self, node: Chars, start: int | None = None) -> tuple[int, int]:
        num_nodes, edges = _char_dag(node.ranges)
        s = self.new() if start is None else start
        e = self.new()
        ids = [s] + [self.new() for _ in range(num_nodes - 1)]
        for src, lo, hi, dst in edges:
            self.trans[ids[src]].append((lo, hi, e if dst < 0 else ids[dst]))
        return s, e


# counted repeats of at least this many units are built from the unit's DFA (`Nfa._counted`)
COUNTED_MIN = 8


@dataclass(frozen=True, eq=False)
class Unit:
    """The DFA of a prefix code (no string of it is a proper prefix of another, the empty
    string not included) whose start state has no incoming edge: per non-final state its byte
    ranges (lo, hi, target), target -1 the final state (a unit completed). `derived`: tables
    derived from the unit alone (`blocks`' dense table, `block_facts`' map onto the string
    automaton), owned by it: they live and go with the unit."""

    start: int
    rows: tuple[tuple[tuple[int, int, int], ...], ...]
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


# NOTE: pure memoization of immutable inputs, bounded: a syntax tree is immutable, the node is
# kept beside its unit (so its id is not reused while cached), and past 256 nodes it starts over
_UNITS: dict[int, tuple[Node, Unit | None]] = {}


def unit_of(node: Node) -> Unit | None:
    """`Unit` of `node`, or None if it is not a prefix code; cached by node identity."""
    hit = _UNITS.get(id(node))
    if hit is not None and hit[0] is node:
        return hit[1]
    dfa = build_dfa(node)
    trans = dfa.transitions
    final = np.flatnonzero(dfa.accepting)
    unit = None
    # NOTE: the start state must have no incoming edge, else a unit's middle could look like a
    # boundary between units (a*b: after "a" the DFA is back in its start state)
    if (len(final) == 1 and int(final[0]) != dfa.start and (trans[int(final[0])] == dfa.dead).all()
            and not (trans[: dfa.num_states] == dfa.start).any()):
        f = int(final[0])
        keep = [q for q in range(dfa.num_states) if q != f]
        new_id = {q: i for i, q in enumerate(keep)}
        new_id[f] = -1
        rows = []
        for q in keep:
            row = trans[q]
            cuts = np.flatnonzero(np.diff(row)) + 1
            starts = [0, *cuts.tolist()]
            ends = [*(cuts - 1).tolist(), 255]
            rows.append(tuple((a, b, new_id[int(row[a])]) for a, b in zip(starts, ends, strict=True)
                              if int(row[a]) != dfa.dead))
        unit = Unit(start=new_id[dfa.start], rows=tuple(rows))
    if len(_UNITS) > 256:
        _UNITS.clear()
    _UNITS[id(node)] = (node, unit)
    return unit


# NOTE: pure memoization of immutable inputs, bounded, as `_UNITS`
_ENTRY_UNITS: dict[int, tuple[Node, Unit | None]] = {}


def counted_unit(node: Node) -> Unit | None:
    """`unit_of(node)`, or where `node` is a prefix code whose start state has incoming edges (an
    item led by whitespace, `[ \\t]*,x`: JSON array items after the comma), its DFA with a fresh
    start state (a copy of the start's row that nothing enters): a `Unit` of the same language for
    `Nfa._counted` (a repeat of such items was one NFA copy per item: JSONSchemaBench o9958,
    1,000 items). Not minimal (the copy equals the start), so only counted fragments take it.
    Cached by node identity."""
    unit = unit_of(node)
    if unit is not None:
        return unit
    hit = _ENTRY_UNITS.get(id(node))
    if hit is not None and hit[0] is node:
        return hit[1]
    dfa = build_dfa(node)
    trans = dfa.transitions
    final = np.flatnonzero(dfa.accepting)
    if len(final) == 1 and int(final[0]) != dfa.start and (trans[int(final[0])] == dfa.dead).all():
        f = int(final[0])
        keep = [q for q in range(dfa.num_states) if q != f]
        new_id = {q: i for i, q in enumerate(keep)}
        new_id[f] = -1
        rows = []
        for q in [*keep, dfa.start]:  # the fresh start last: a copy of the start's row
            row = trans[q]
            cuts = np.flatnonzero(np.diff(row)) + 1
            starts = [0, *cuts.tolist()]
            ends = [*(cuts - 1).tolist(), 255]
            rows.append(tuple((a, b, new_id[int(row[a])]) for a, b in zip(starts, ends, strict=True)
                              if int(row[a]) != dfa.dead))
        unit = Unit(start=len(keep), rows=tuple(rows))
    if len(_ENTRY_UNITS) > 256:
        _ENTRY_UNITS.clear()
    _ENTRY_UNITS[id(node)] = (node, unit)
    return unit


# NOTE: pure memoization of immutable inputs (code point ranges), bounded (4096 entries)
@functools.lru_cache(maxsize=4096)
def _char_dag(ranges: tuple[tuple[int, int], ...]) -> tuple[int, tuple[tuple[int, int, int, int], ...]]:
    """The UTF-8 byte automaton of a code point set: (number of nodes, edges (src, lo, hi, dst)),
    node 0 the start, dst -1 the end.

    The sequences' prefix trie with equal subtrees shared (a DAWG): the states after different
    lead bytes that need the same continuation bytes are one node, so the DFA has no duplicate
    states to minimize away later.
    """
    children: list[dict[tuple[int, int], int]] = [{}]  # node -> {(lo, hi): child}, child -1: the end
    for seq in _sequences(ranges):
        cur = 0
        for k, (blo, bhi) in enumerate(seq):
            if k == len(seq) - 1:
                children[cur][(blo, bhi)] = -1
            else:
                nxt = children[cur].get((blo, bhi))
                if nxt is None or nxt < 0:
                    nxt = len(children)
                    children.append({})
                    children[cur][(blo, bhi)] = nxt
                cur = nxt
    # children are created after their parents: canonicalize bottom-up by (range, child) sets
    canon = [0] * len(children)
    by_sig: dict[tuple[tuple[int, int, int], ...], int] = {}
    for node in range(len(children) - 1, -1, -1):
        sig = tuple(sorted((lo, hi, c if c < 0 else canon[c]) for (lo, hi), c in children[node].items()))
        canon[node] = by_sig.setdefault(sig, node) if node else 0
    order = sorted({canon[x] for x in range(len(children))})
    new_id = {old: i for i, old in enumerate(order)}  # node 0 stays 0
    edges = tuple((new_id[node], lo, hi, c if c < 0 else new_id[canon[c]])
                  for node in order for (lo, hi), c in children[node].items())
    return len(order), edges


# NOTE: pure memoization of immutable inputs (code point ranges), bounded (4096 entries)
@functools.lru_cache(maxsize=4096)
def _sequences(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """UTF-8 byte-range sequences of a code point set (ASCII ranges are one step)."""
    out: list[tuple[tuple[int, int], ...]] = []
    for lo, hi in ranges:
        if hi <= 0x7F:
            out.append(((lo, hi),))
        else:
            out.extend(utf8_sequences(lo, hi))
    return tuple(out)


# `byte_segments` of at most this many ranges checks each range per segment (no sweep)
_FEW_RANGES = 8


def byte_segments(trs: list[tuple[int, int, int]]) -> list[tuple[int, int, frozenset[int]]]:
    """Split byte ranges (lo, hi, target) into disjoint segments (lo, hi, targets), by a sweep
    (few ranges: each segment's ranges looked up directly)."""
    if len(trs) == 1:
        lo, hi, t = trs[0]
        return [(lo, hi, frozenset((t,)))]
    if len(trs) <= _FEW_RANGES:
        points = sorted({x for lo, hi, _ in trs for x in (lo, hi + 1)})
        segs = []
        for p, nxt in zip(points, points[1:], strict=False):
            targets = frozenset([t for lo, hi, t in trs if lo <= p <= hi])
            if targets:
                segs.append((p, nxt - 1, targets))
        return segs
    events: dict[int, list[tuple[int, int]]] = {}
    for lo, hi, t in trs:
        events.setdefault(lo, []).append((1, t))
        events.setdefault(hi + 1, []).append((-1, t))
    active: dict[int, int] = {}
    out: list[tuple[int, int, frozenset[int]]] = []
    points = sorted(events)
    for p, nxt in zip(points, points[1:], strict=False):
        for delta, t in events[p]:
            c = active.get(t, 0) + delta
            if c:
                active[t] = c
            else:
                del active[t]
        if active:
            out.append((p, nxt - 1, frozenset(active)))
    return out


def _disjoint(ranges: list[tuple[int, int, int]]) -> bool:
    """True when sorted byte ranges (lo, hi, target) do not overlap."""
    end = -1
    for lo, hi, _ in ranges:
        if lo <= end:
            return False
        end = hi
    return True


def byte_closure(eps: list[list[int]], trans: list[list[tuple[int, int, int]]], final: int, q: int) -> frozenset[int]:
    """The states of NFA state `q`'s epsilon closure (`eps`, `trans`: an `Nfa`'s lists) that
    matter to a subset construction: those with byte transitions, and `final`. Pure."""
    if not eps[q]:  # NOTE: most states of deterministic fragments
        return frozenset((q,)) if trans[q] or q == final else frozenset()
    seen = {q}
    stack = [q]
    while stack:
        for y in eps[stack.pop()]:
            if y not in seen:
                seen.add(y)
                stack.append(y)
    return frozenset(x for x in seen if trans[x] or x == final)


def subset_construction(nfa: Nfa, start: int, final: int, max_states: int | None = None,
                        limit: int = DEFAULT_MAX_DFA_STATES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Subset construction: (transition table over byte intervals with the dead state last,
    accepting flags, the interval (column) of each byte). Raises `GrammarTooLargeError` past
    `max_states` states (None: `limit`, `CfsmLimits.max_dfa_states`; never more than that)."""
    limit = limit if max_states is None else min(max_states, limit)
    closures: dict[int, frozenset[int]] = {}
    eps, ntrans = nfa.eps, nfa.trans

    def closure(q: int) -> frozenset[int]:
        c = closures.get(q)
        if c is None:
            c = closures[q] = byte_closure(eps, ntrans, final, q)
        return c

    ids: dict[frozenset[int], int] = {}
    states: list[frozenset[int]] = []

    def intern(key: frozenset[int]) -> int:
        i = ids.get(key)
        if i is None:
            if len(states) >= limit:
                raise GrammarTooLargeError(
                    f"the DFA exceeds {limit} states; shorten counted repeats (maxLength, {{m,n}}) "
                    "or split the grammar")
            i = ids[key] = len(states)
            states.append(key)
        return i

    target_cache: dict[int | frozenset[int], int] = {}  # an NFA state or a set of them
    # per NFA state: its ranges sorted, and whether they are disjoint
    sorted_of: dict[int, tuple[list[tuple[int, int, int]], bool]] = {}
    presorted = nfa.presorted
    intern(closure(start))
    # the table as flat range lists: state k's ranges are [bounds[k], bounds[k + 1])
    los: list[int] = []
    his: list[int] = []
    dsts: list[int] = []
    bounds = [0]
    accepting: list[bool] = []
    k = 0
    while k < len(states):
        members = states[k]
        accepting.append(final in members)
        if len(members) == 1:
            (q,) = members
            if q in presorted:
                trs, disjoint = ntrans[q], True
            else:
                hit = sorted_of.get(q)
                if hit is None:
                    trs = sorted(ntrans[q])
                    hit = sorted_of[q] = (trs, _disjoint(trs))
                trs, disjoint = hit
        else:
            trs = sorted([t for q in members for t in ntrans[q]])
            disjoint = _disjoint(trs)
        # NOTE: disjoint ranges (most states) have one target each: no sweep, no target sets
        segs: list[tuple[int, int, int]] | list[tuple[int, int, frozenset[int]]] = trs if disjoint else byte_segments(trs)
        for a, b, tg in segs:
            dst = target_cache.get(tg)
            if dst is None:
                key = closure(tg) if isinstance(tg, int) else frozenset().union(*(closure(x) for x in tg))
                dst = target_cache[tg] = intern(key)
            los.append(a)
            his.append(b)
            dsts.append(dst)
        bounds.append(len(los))
        k += 1
    n = len(states)
    # NOTE: the table has one column per byte interval between the ranges' bounds (bytes of one
    # interval step alike from every state); `byte_map[b]` is the column of byte b
    lo = np.asarray(los, dtype=np.int64)
    hi = np.asarray(his, dtype=np.int64)
    starts = np.unique(np.concatenate([[0], lo, hi + 1]))
    starts = starts[starts < 256]
    byte_map = np.searchsorted(starts, np.arange(256), side="right") - 1
    width = len(starts)
    table = np.full((n + 1, width), n, dtype=np.int32)
    if los:
        ilo = byte_map[lo]
        lens = byte_map[hi] - ilo + 1
        per_state = np.asarray(bounds[1:], dtype=np.int64) - np.asarray(bounds[:-1], dtype=np.int64)
        src = np.repeat(np.arange(n, dtype=np.int64), per_state)
        idx = concat_ranges(src * width + ilo, lens)
        table.reshape(-1)[idx] = np.repeat(np.asarray(dsts, dtype=np.int32), lens)
    return table, np.array(accepting + [False], dtype=bool), byte_map


def concat_ranges(lo: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The positions of the ranges [lo[i], lo[i] + sizes[i]) one after another (int64). Pure."""
    offsets = np.cumsum(sizes) - sizes
    return np.repeat(lo - offsets, sizes) + np.arange(int(sizes.sum()), dtype=np.int64)  # type: ignore[no-any-return]


def stable_argsort(keys: np.ndarray, bound: int) -> np.ndarray:
    """`np.argsort(keys, kind="stable")` for keys in [0, bound): as 16-bit keys where they fit,
    which numpy sorts by radix (linear) instead of a merge sort."""
    if bound <= 2**15:
        keys = keys.astype(np.int16)
    return np.argsort(keys, kind="stable")


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the first row of each distinct row, distinct-row index of every row) of a 2-D
    array: rows compared as raw bytes (one sort of fixed-size byte strings, much faster than
    `np.unique(axis=0)`); the order of the distinct rows is unspecified."""
    a = np.ascontiguousarray(a)
    if a.shape[0] == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    v = a.view(np.dtype((np.void, a.dtype.itemsize * a.shape[1]))).reshape(-1)
    _, first, inverse = np.unique(v, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


def small_unique(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(x, return_inverse=True)` for a non-empty array of small non-negative ints (state
    ids, byte cuts, continuation keys): marked in a bool array instead of sorted."""
    present = np.zeros(int(x.max()) + 1, dtype=bool)
    present[x] = True
    return np.flatnonzero(present), (np.cumsum(present) - 1)[x]


def accept_distance(cols: np.ndarray, accepting: np.ndarray, dead: int) -> np.ndarray:
    """Per state: the length of its shortest accepted string, -1 if it accepts none (reverse BFS
    over byte classes, level by level).

    Edges into `dead` (most of them) and repeats of an edge between the same two states in
    adjacent columns are left out: they cannot change the result.
    """
    n, k = cols.shape
    keep = cols != dead
    keep[:, 1:] &= cols[:, 1:] != cols[:, :-1]
    edge = np.flatnonzero(keep.reshape(-1))
    dst = cols.reshape(-1)[edge]
    order = stable_argsort(dst, n)
    preds = (edge[order] // k).tolist()
    bounds = np.searchsorted(dst[order], np.arange(n + 1)).tolist()
    dist = np.where(accepting, 0, -1).tolist()
    frontier = np.flatnonzero(accepting).tolist()
    d = 0
    while frontier:
        d += 1
        nxt = []
        for q in frontier:
            for p in preds[bounds[q] : bounds[q + 1]]:
                if dist[p] < 0:
                    dist[p] = d
                    nxt.append(p)
        frontier = nxt
    return np.asarray(dist, dtype=np.int64)


def split_round(
    order: np.ndarray, cls: np.ndarray, sigs: tuple[np.ndarray, ...], num: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """One Moore round over the states `order`, sorted by (class, *sigs): where a class's members
    differ in a signature, its first group keeps the class id and the others get fresh ids from
    `num` up. Returns (states that changed class, their new ids, number of fresh ids). Pure."""
    m = len(order)
    c_s = cls[order]
    new_group = np.ones(m, dtype=bool)
    diff = c_s[1:] != c_s[:-1]
    for sig in sigs:
        s_s = sig[order]
        diff |= s_s[1:] != s_s[:-1]
    new_group[1:] = diff
    split = new_group.copy()
    split[1:] &= c_s[1:] == c_s[:-1]  # a group start that is not its class's first group
    split[0] = False
    num_new = int(split.sum())
    if num_new == 0:
        return order[:0], order[:0], 0
    group_start = np.maximum.accumulate(np.where(new_group, np.arange(m), 0))
    fresh = split[group_start]
    return order[fresh], num + np.cumsum(split)[group_start[fresh]] - 1, num_new


def in_edges(bounds: np.ndarray, states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the reverse edges into `states` (edges grouped by target, target q's at
    bounds[q]:bounds[q + 1]) and how many each state has. Pure."""
    lo, hi = bounds[states], bounds[states + 1]
    sizes = hi - lo
    return concat_ranges(lo, sizes), sizes


# NOTE: pure memoization of immutable inputs (a width), bounded (16 entries)
@functools.lru_cache(maxsize=16)
def _refine_weights(k: int) -> np.ndarray:
    """`refine`'s random odd 64-bit column weights (fixed seed), read-only."""
    rng = np.random.default_rng(0x5EED)
    w = np.asarray(rng.integers(1, 2**63, size=k, dtype=np.uint64)) | np.uint64(1)
    w.flags.writeable = False
    return w


# tables of at most this many entries (states x columns) are refined in plain Python
_SMALL_REFINE = 512


def _refine_small(cols: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """`refine` for a small table: Moore rounds on exact row signatures (tuples), in Python
    (numpy's per-call cost dominates there). The same partition (other ids)."""
    rows = cols.tolist()
    c = cls.tolist()
    num = len(set(c))
    while True:
        ids: dict[tuple[int, ...], int] = {}
        new = [ids.setdefault((c[p], *[c[x] for x in row]), len(ids)) for p, row in enumerate(rows)]
        if len(ids) == num:
            return np.asarray(new, dtype=np.int64)
        c, num = new, len(ids)


def refine(cols: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """Moore refinement to the coarsest congruence, with 64-bit row hashes as signatures.

    Incremental: a class that splits keeps its id for its first part and gives fresh ids to the
    others, so only the predecessors of states that changed class get their hash updated
    (`h[p] = sum_j w_j * cls[cols[p, j]]`, kept modulo 2^64).
    # NOTE: a hash collision could only merge too much; the result is checked to be a
    # congruence and, if not, refined again with exact row comparisons.
    """
    n, k = cols.shape
    if n * k <= _SMALL_REFINE:
        return _refine_small(cols, cls)
    weights = _refine_weights(k)
    _, cls = np.unique(cls, return_inverse=True)
    cls = cls.reshape(-1).astype(np.int64)
    num = int(cls.max()) + 1
    # reverse edges (p --j--> q) grouped by q; edges into a closed class (every member's
    # successors inside it, as the trimmed class) are dropped: such a class never changes ids
    flat_dst = cols.reshape(-1)
    succ = np.take(cls.astype(np.int32), cols)  # the class of every successor (int32 gathers: ~2x faster)
    leaves = (succ != cls[:, None]).any(axis=1)  # a member with a successor outside its class
    closed = np.bincount(cls, weights=leaves, minlength=num) == 0
    # NOTE: most edges lead to the dead state, whose class is closed: those are dropped first
    edge = np.flatnonzero(flat_dst != n - 1)
    edge = edge[~closed[succ.reshape(-1)[edge]]]
    dst = flat_dst[edge]
    by_dst = stable_argsort(dst, n)
    edge, dst = edge[by_dst], dst[by_dst]
    edge_src = edge // k
    edge_w = weights[edge % k]
    bounds = np.searchsorted(dst, np.arange(n + 1))
    h = succ.astype(np.uint64) @ weights  # NOTE: integer matmul wraps modulo 2^64, ~10x a sum of products
    # NOTE: after each round every class has one hash; only classes holding a state whose hash
    # changed (a predecessor of a state that changed class) can split in the next round
    sub = np.arange(n)
    while len(sub):
        o = sub[np.lexsort((h[sub], cls[sub]))]
        changed, new_ids, num_new = split_round(o, cls, (h,), num)
        if num_new == 0:
            break
        delta = (new_ids - cls[changed]).astype(np.uint64)  # positive: fresh ids are the largest
        cls[changed] = new_ids
        num += num_new
        idx, sizes = in_edges(bounds, changed)
        if not len(idx):
            break
        touched = edge_src[idx]
        np.add.at(h, touched, edge_w[idx] * np.repeat(delta, sizes))
        hit = np.zeros(num, dtype=bool)
        hit[cls[touched]] = True
        sub = np.flatnonzero(hit[cls])
    reps = np.zeros(num, dtype=np.int64)
    reps[cls] = np.arange(len(cls))
    succ = np.take(cls.astype(np.int32), cols)
    if np.array_equal(succ, succ[reps[cls]]):
        return cls
    while True:  # exact fallback (never seen in practice)
        _, new_cls = np.unique(np.column_stack([cls, cls[cols]]), axis=0, return_inverse=True)
        new_cls = new_cls.reshape(-1)
        if int(new_cls.max()) + 1 == num:
            return new_cls
        cls, num = new_cls, int(new_cls.max()) + 1


# NOTE: pure memoization of immutable inputs, bounded: one read-only draw per fixed seed (three
# seeds, each draw as long as the longest asked for), the same values a fresh draw gives
_SEEDED: dict[int, np.ndarray] = {}


def seeded_weights(seed: int, n: int) -> np.ndarray:
    """`np.random.default_rng(seed).integers(1, 2**63, size=n, dtype=np.uint64)`, read-only: a
    prefix of one draw per seed kept for the process (a larger draw begins with the same values,
    so slicing gives exactly the values of a fresh draw; grammar-independent)."""
    w = _SEEDED.get(seed)
    if w is None or len(w) < n:
        w = np.random.default_rng(seed).integers(1, 2**63, size=max(n, 1024, 2 * len(w) if w is not None else 0),
                                                 dtype=np.uint64)
        w.flags.writeable = False
        _SEEDED[seed] = w
    return w[:n]


def _byte_classes(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(representative byte of each class, class of each byte): bytes with equal columns (any
    number of columns).

    On a table of 256 byte columns, runs of adjacent equal columns are merged exactly first
    (rows are mostly byte ranges), so only one column per run is hashed; narrower tables (one
    column per byte interval or class) are hashed as they are.
    """
    width = table.shape[1]
    if width >= 256:
        step = np.ones(width, dtype=bool)
        step[1:] = (table[:, 1:] != table[:, :-1]).any(axis=0)
        starts = np.flatnonzero(step)
        run_of = np.cumsum(step) - 1  # the run of each byte
        runs = np.take(table, starts, axis=1)
    else:
        starts = run_of = np.arange(width)
        runs = table
    weights = seeded_weights(0xB17E, table.shape[0])
    h = weights @ runs.astype(np.uint64)  # (num_runs,), modulo 2^64
    _, first, cls = np.unique(h, return_index=True, return_inverse=True)
    cls = cls.reshape(-1)
    # only the runs merged into an earlier one can be a collision: compare those with it
    dup = np.flatnonzero(first[cls] != np.arange(len(cls)))
    if not np.array_equal(runs[:, first[cls[dup]]], runs[:, dup]):  # a collision: exact fallback
        _, first, cls = np.unique(runs.T, axis=0, return_index=True, return_inverse=True)
        cls = cls.reshape(-1)
    return starts[first], cls[run_of]


def _runs(step: np.ndarray, live: np.ndarray) -> np.ndarray:
    """Per state: how many steps along `step` stay in live states (capped at the number of
    states: a cycle of live states). Pointer jumping: log2(states) rounds."""
    n = len(step)
    nxt = np.where(live[step], step, -1).astype(np.int64)  # -1: the next step leaves the live states
    run = np.where(nxt >= 0, 1, 0).astype(np.int64)  # steps taken so far (up to the jump length)
    jump = nxt.copy()  # state after `run` steps, -1 once stopped
    length = 1
    while length < n and (jump >= 0).any():
        ok = jump >= 0
        more = np.zeros(n, dtype=np.int64)
        after = np.full(n, -1, dtype=np.int64)
        more[ok] = run[jump[ok]]
        after[ok] = jump[jump[ok]]
        run = run + more
        jump = after
        length *= 2
    return np.minimum(run, n)


def _bfs_order(cols: np.ndarray, start: int, dead: int) -> np.ndarray:
    """States reachable from `start` (dead excluded) in breadth-first order, each state's targets
    by ascending column (columns in ascending first byte): the subset construction's order."""
    n, k = cols.shape
    # the live entries in row-major order, a repeat of the previous entry's target in its row
    # dropped (rows are mostly runs of one target over adjacent columns)
    flat = np.flatnonzero(cols.reshape(-1) != dead)
    t = cols.reshape(-1)[flat]
    r = flat // k
    keep = np.ones(len(t), dtype=bool)
    keep[1:] = (t[1:] != t[:-1]) | (r[1:] != r[:-1])
    targets = t[keep].tolist()
    bounds = np.searchsorted(r[keep], np.arange(n + 1)).tolist()
    seen = [False] * n
    seen[start] = True
    order = [start]
    append = order.append
    for q in order:  # NOTE: iterates over the states appended meanwhile (breadth-first)
        lo, hi = bounds[q], bounds[q + 1]
        if hi - lo == 1:  # most states (literal ones): one target
            x = targets[lo]
            if not seen[x]:
                seen[x] = True
                append(x)
        else:
            for x in targets[lo:hi]:
                if not seen[x]:
                    seen[x] = True
                    append(x)
    return np.asarray(order, dtype=np.int64)


# tables of at most this many entries (states x columns) are minimized in plain Python
# (`_minimize_small`: a small regex's DFA, where numpy's per-call cost was most of the time)
_SMALL_MINIMIZE = 1024


def _runs_small(step: list[int], live: list[bool]) -> list[int]:
    """`_runs` in plain Python: per state, how many steps along `step` stay in live states
    (capped at the number of states: a cycle of live states)."""
    n = len(step)
    run = [-1] * n  # -2: on the path being followed
    for q in range(n):
        path = []
        x = q
        while run[x] == -1:
            run[x] = -2
            path.append(x)
            if not live[step[x]]:
                x = -1  # the path's last step leaves the live states
                break
            x = step[x]
        if x >= 0 and run[x] == -2:  # the path closed a cycle of live states
            for p in path:
                run[p] = n
            continue
        base = 0 if x < 0 else run[x] + 1
        for i, p in enumerate(reversed(path)):
            run[p] = min(base + i, n)
    return run


def _minimize_small(table: np.ndarray, accepting: np.ndarray, start: int, byte_map: np.ndarray | None) -> Dfa | None:
    """`minimize(table, accepting, start, byte_map)` (first-seen numbering) of a small table in
    plain Python: the same `Dfa`, byte classes included (their ids are the ranks of the same
    column hashes as `_byte_classes`'). None where two distinct columns of the minimal table
    share a hash (the numpy path's exact fallback orders them then)."""
    n = table.shape[0]
    dead = n - 1
    col_ids: dict[tuple[int, ...], int] = {}
    col_of = [col_ids.setdefault(c, len(col_ids)) for c in zip(*table.tolist(), strict=True)]
    rows = list(zip(*col_ids, strict=True))  # per state: its target in each distinct column
    k = len(col_ids)
    acc = accepting.tolist()
    # trim: the length of each state's shortest accepted string (-1: none), a reverse BFS
    preds: list[list[int]] = [[] for _ in range(n)]
    for p, row in enumerate(rows):
        for q in set(row):
            preds[q].append(p)
    dist = [0 if a else -1 for a in acc]
    dist[dead] = -1
    frontier = [q for q in range(n) if dist[q] == 0]
    d = 0
    while frontier:
        d += 1
        nxt_front = []
        for q in frontier:
            for p in preds[q]:
                if dist[p] < 0 and p != dead:
                    dist[p] = d
                    nxt_front.append(p)
        frontier = nxt_front
    live = [x >= 0 for x in dist]
    # the first split, as `minimize`'s (properties of each state's language: acceptance, shortest
    # accepted length, how many bytes of the widest column in a row), then Moore rounds
    byte_col = np.array(col_of, dtype=np.int64)  # the distinct column of each byte
    if byte_map is not None:
        byte_col = byte_col[byte_map]
    widest = int(np.argmax(np.bincount(byte_col, minlength=k)))
    runs = _runs_small([row[widest] for row in rows], live)
    keys: dict[tuple[int, ...], int] = {(-1,): 0}  # class 0: the states that accept nothing
    c = [keys.setdefault((acc[q], dist[q], runs[q]) if live[q] else (-1,), len(keys)) for q in range(n)]
    live_states = [q for q in range(n) if live[q]]
    groups: dict[int, list[int]] = {}
    for q in live_states:
        groups.setdefault(c[q], []).append(q)
    # NOTE: a class that splits keeps its id for its first part (the others get fresh ids), so
    # only classes of several states are looked at again; splitting on ids updated within a
    # round is still splitting by the successors' classes: the same coarsest congruence
    open_groups = [g for g in groups.values() if len(g) > 1]
    num = len(keys)
    get = c.__getitem__
    while open_groups:
        still: list[list[int]] = []
        split = False
        for g in open_groups:
            parts: dict[tuple[int, ...], list[int]] = {}
            for p in g:
                parts.setdefault(tuple(map(get, rows[p])), []).append(p)
            if len(parts) == 1:
                still.append(g)
                continue
            split = True
            for i, part in enumerate(parts.values()):
                if i:
                    for p in part:
                        c[p] = num
                    num += 1
                if len(part) > 1:
                    still.append(part)
        if not split:
            break
        open_groups = still
    # renumber: the classes in first-seen order, the dead class (class 0) last
    new_of: dict[int, int] = {}
    reps: list[int] = []
    for q in live_states:
        if c[q] not in new_of:
            new_of[c[q]] = len(reps)
            reps.append(q)
    m = len(reps)
    sid = [new_of.get(x, m) for x in c]
    sid[dead] = m
    min_rows = [[sid[x] for x in rows[r]] for r in reps]
    min_rows.append([m] * k)
    # the minimal DFA's byte classes: its distinct columns, numbered by the rank of their hash
    narrow = np.array(min_rows, dtype=np.int32)  # (m + 1, k)
    hashes = (seeded_weights(0xB17E, m + 1) @ narrow.astype(np.uint64)).tolist()  # modulo 2^64
    first_of = {h: j for j, h in reversed(list(enumerate(hashes)))}
    if len(first_of) != len(set(zip(*min_rows, strict=True))):  # equal hashes of distinct columns
        return None
    rank = {h: i for i, h in enumerate(sorted(first_of))}
    of_byte = np.array([rank[h] for h in hashes], dtype=np.int64)[byte_col]
    rep_bytes = np.unique(of_byte, return_index=True)[1]  # the first byte of each class
    by_class = [first_of[h] for h in sorted(first_of)]  # a column of `narrow` per class
    classes = ByteClasses(reps=rep_bytes, of_byte=of_byte, table=np.take(narrow, by_class, axis=1))
    trans = np.take(narrow, byte_col, axis=1)
    accept = np.array([acc[r] for r in reps] + [False], dtype=bool)
    return Dfa(transitions=trans, accepting=accept, start=sid[start], known_classes=classes)


def minimize(table: np.ndarray, accepting: np.ndarray, start: int, byte_map: np.ndarray | None = None,
              dist: np.ndarray | None = None, bfs: bool = False) -> Dfa:
    """Trimmed minimal DFA of `table` (the dead state last; one column per byte, or per group of
    bytes where `byte_map[b]` is the column of byte b). `dist`, when given, is what
    `accept_distance` would compute (the caller knows it by construction). States are numbered
    in first-seen order from state 0 (`bfs`: in breadth-first order from `start`, where the table
    is not in that order or holds unreachable states)."""
    if not bfs and dist is None and table.size <= _SMALL_MINIMIZE:
        small = _minimize_small(table, accepting, start, byte_map)
        if small is not None:
            return small
    n = table.shape[0]  # includes the dead state (last row)
    dead = n - 1
    # byte classes: bytes whose columns are equal behave the same everywhere
    col_rep, byte_class = _byte_classes(table)
    if byte_map is not None:
        byte_class = byte_class[byte_map]
    cols = np.take(table, col_rep, axis=1)  # NOTE: np.take: far faster than [:, idx] here
    # trim: states that cannot reach acceptance behave like the dead state
    # NOTE: the shortest accepted length is a property of the state's language too: states far
    # apart in a document (a key's string in one section and in the next) split at once
    dist = accept_distance(cols, accepting, dead) if dist is None else dist.copy()
    dist[dead] = -1
    live = dist >= 0
    cls = np.where(live, accepting.astype(np.int64) + 1, 0)
    cls = cls * (int(dist.max()) + 2) + dist + 1
    # NOTE: how many times the byte of the widest class can be read in a row (a property of the
    # state's language, so equal for equivalent states) starts the refinement split: counter
    # states of a repeat (maxLength strings) are apart at once instead of after one round each
    widest = int(np.argmax(np.bincount(byte_class.reshape(-1))))
    runs = _runs(cols[:, widest], live)
    cls = cls * (int(runs.max()) + 1) + np.where(live, runs, 0)
    cls = refine(cols, cls)
    num = int(cls.max()) + 1
    dead_cls = int(cls[dead])
    if bfs:
        # renumber in breadth-first order from the start (targets by ascending first byte): the
        # order of the subset construction, so the same numbering as below for its tables;
        # classes not reachable from the start are dropped
        any_rep = np.zeros(num, dtype=np.int64)
        any_rep[cls] = np.arange(n)
        by_byte = np.argsort(col_rep, kind="stable")  # columns by their first byte
        ccols = np.take(cls.astype(np.int32), np.take(np.take(cols, any_rep, axis=0), by_byte, axis=1))
        start_cls = int(cls[start])
        order = _bfs_order(ccols, start_cls, dead_cls) if start_cls != dead_cls else np.zeros(0, dtype=np.int64)
    else:
        # renumber: the dead class last, the rest in first-seen order from state 0
        first_seen = np.full(num, n, dtype=np.int64)
        np.minimum.at(first_seen, cls, np.arange(n))
        order = np.argsort(first_seen, kind="stable")
        order = order[order != dead_cls]
    return _renumbered(cols, accepting, start, byte_class.reshape(-1), cls, num, order)


def minimal_dfa(table: np.ndarray, accepting: np.ndarray, start: int, byte_map: np.ndarray,
                 cls: np.ndarray) -> tuple[Dfa, np.ndarray]:
    """`minimize(table, accepting, start, byte_map, bfs=True)` where the classes of equivalent
    states are known (`cls`, any ids, one per language: the partition `refine` would give): the
    same `Dfa`, byte classes included, without refinement rounds; and each state's state in it.
    The table's columns are byte intervals in ascending byte order (`byte_map[b]` the column of
    byte b), the dead state last."""
    n = table.shape[0]
    num = int(cls.max()) + 1
    any_rep = np.zeros(num, dtype=np.int64)
    any_rep[cls] = np.arange(n)
    ccols = np.take(cls.astype(np.int32), np.take(table, any_rep, axis=0))
    start_cls, dead_cls = int(cls[start]), int(cls[n - 1])
    order = _bfs_order(ccols, start_cls, dead_cls) if start_cls != dead_cls else np.zeros(0, dtype=np.int64)
    nxt = len(order)
    remap = np.full(num, nxt, dtype=np.int32)  # the dead class (and unreachable ones) last
    remap[order] = np.arange(nxt, dtype=np.int32)
    min_cols = np.empty((nxt + 1, table.shape[1]), dtype=np.int32)  # (num, num_byte_intervals)
    np.take(remap, np.take(ccols, order, axis=0), out=min_cols[:nxt])
    min_cols[nxt] = nxt
    # NOTE: byte intervals in ascending order: the 256-wide table repeats each column
    trans = np.repeat(min_cols, np.bincount(byte_map, minlength=table.shape[1]), axis=1)
    acc = np.append(accepting[any_rep[order]], False)
    dfa = _with_classes(Dfa(transitions=trans, accepting=acc, start=int(remap[cls[start]])), min_cols, byte_map)
    return dfa, remap[cls]


def _renumbered(cols: np.ndarray, accepting: np.ndarray, start: int, byte_class: np.ndarray, cls: np.ndarray,
                num: int, order: np.ndarray) -> Dfa:
    """The minimal DFA: class `order[i]` becomes state i, the other classes (the dead one and
    unreachable ones) the dead state; `cols` one column per byte class (`byte_class[b]` byte
    b's), `cls` the class of each of its states."""
    n = cols.shape[0]
    nxt = len(order)
    remap = np.full(num, nxt, dtype=np.int64)  # the dead class (and unreachable ones) last
    remap[order] = np.arange(nxt)
    new_ids = remap[cls]
    reps = np.zeros(nxt + 1, dtype=np.int64)
    reps[new_ids] = np.arange(n)
    min_cols = np.take(new_ids.astype(np.int32), np.take(cols, reps, axis=0))  # (num, num_byte_classes)
    min_cols[nxt] = nxt
    trans = np.take(min_cols, byte_class, axis=1)
    acc = accepting[reps].copy()
    acc[nxt] = False
    return _with_classes(Dfa(transitions=trans, accepting=acc, start=int(new_ids[start])), min_cols, byte_class)


def _with_classes(dfa: Dfa, min_cols: np.ndarray, byte_class: np.ndarray) -> Dfa:
    """`dfa` with its byte classes and class table cached, from its narrow table `min_cols` (one
    column per byte class of a coarser partition, `byte_class[b]` byte b's)."""
    # the minimal DFA's byte classes merge the classes whose columns became equal
    rep2, cls2 = _byte_classes(min_cols)
    classes = cls2[byte_class]
    _, rep_bytes = np.unique(classes, return_index=True)  # a byte of each class, by class id
    # the table of one column per final class, from the narrow table (not the 256-wide one)
    table = np.take(min_cols, byte_class[rep_bytes], axis=1)
    return dataclasses.replace(dfa, known_classes=ByteClasses(reps=rep_bytes, of_byte=classes, table=table))


def _product(a: Dfa, b: Dfa) -> Dfa:
    """DFA of the intersection of two DFAs' languages.

    Breadth-first over pairs of states, one frontier at a time and one column per joint byte
    class (bytes both DFAs step alike): pairs are numbered in the order a pair-by-pair walk
    meets them (the frontier's rows in order, each row's targets by ascending pair key), so the
    minimal DFA is the one that walk gives. Pairs with a dead side are not states."""
    ca = a.byte_classes[1].astype(np.int64)
    cb = b.byte_classes[1].astype(np.int64)
    _, reps, byte_map = np.unique(ca * (int(cb.max()) + 1) + cb, return_index=True, return_inverse=True)
    ta = np.take(a.transitions, reps, axis=1).astype(np.int64)  # (states + 1, joint classes)
    tb = np.take(b.transitions, reps, axis=1).astype(np.int64)
    nb = b.num_states + 1
    ids: dict[int, int] = {a.start * nb + b.start: 0}
    fx = np.array([a.start], dtype=np.int64)
    fy = np.array([b.start], dtype=np.int64)
    xs, ys, rows = [fx], [fy], []
    while len(fx):
        ax = np.take(ta, fx, axis=0)
        by = np.take(tb, fy, axis=0)
        keys = ax * nb + by
        keys[(ax == a.dead) | (by == b.dead)] = -1
        flat = np.sort(keys, axis=1).reshape(-1)
        uniq, first = np.unique(flat[flat >= 0], return_index=True)
        order = np.argsort(first, kind="stable")  # the keys in the order the walk meets them
        found = np.empty(len(uniq), dtype=np.int64)
        new_keys = []
        get = ids.get
        for j, key in zip(order.tolist(), uniq[order].tolist(), strict=True):
            i = get(key)
            if i is None:
                i = ids[key] = len(ids)
                new_keys.append(key)
            found[j] = i
        row = np.take(found, np.searchsorted(uniq, keys)) if len(uniq) else np.zeros(keys.shape, dtype=np.int64)
        row[keys < 0] = -1
        rows.append(row)
        nk = np.array(new_keys, dtype=np.int64)
        fx, fy = nk // nb, nk % nb
        xs.append(fx)
        ys.append(fy)
    n = len(ids)
    table = np.concatenate([*rows, np.full((1, ta.shape[1]), n, dtype=np.int64)])
    table[table < 0] = n
    x, y = np.concatenate(xs), np.concatenate(ys)
    acc = np.append(a.accepting[x] & b.accepting[y], False)
    return minimize(table.astype(np.int32), acc, 0, byte_map.reshape(-1))


def _complement(a: Dfa) -> Dfa:
    n = a.num_states + 1  # the old dead state becomes an accepting sink
    table = np.vstack([a.transitions, np.full((1, 256), n, dtype=np.int32)]).astype(np.int32)
    acc = np.concatenate([~a.accepting, [False]])
    return minimize(table, acc, a.start)


class DfaNode(Node):
    """A ready DFA used as a syntax-tree leaf."""

    __slots__ = ("dfa",)

    def __init__(self, dfa: Dfa) -> None:
        self.dfa = dfa


def dfa_from_table(table: list[list[int]], start: int, accepting: set[int], alphabet: bytes) -> DfaNode:
    """A syntax-tree leaf from a small table: `table[state][i]` is the target on `alphabet[i]`."""
    n = len(table)
    dense = np.full((n + 1, 256), n, dtype=np.int32)
    for q, row in enumerate(table):
        for i, b in enumerate(alphabet):
            dense[q, b] = row[i]
    acc = np.array([q in accepting for q in range(n)] + [False])
    return DfaNode(minimize(dense, acc, start))


# `build_dfa(node, max_states)` stops once its NFA passes this many times `max_states` states
# (JSON Schema trees: their subset constructions make 0.2-0.35 DFA states per NFA state)
NFA_STATES_PER_DFA_STATE = 4


def build_dfa(node: Node, max_states: int | None = None, *, limit: int = DEFAULT_MAX_DFA_STATES,
              counted_min: int | None = None) -> Dfa:
    """Compile a syntax tree into a trimmed minimal byte DFA. Mutates nothing.

    `max_states`: raise `GrammarTooLargeError` as soon as the subset construction passes that
    many states, or the NFA `NFA_STATES_PER_DFA_STATE` times as many (a build known to be too
    large stops early; None: `limit`, the compile's `CfsmLimits.max_dfa_states`, for the DFA
    only). A build within the cap is the same `Dfa`. `counted_min`: `Nfa`'s (tests)."""
    if isinstance(node, DfaNode):
        if max_states is not None and node.dfa.num_states > max_states:
            raise GrammarTooLargeError(f"the DFA exceeds {max_states} states")
        return node.dfa
    nfa = Nfa(0 if max_states is None else NFA_STATES_PER_DFA_STATE * max_states, limit, counted_min)
    s, e = nfa.build(node)
    table, accepting, byte_map = subset_construction(nfa, s, e, max_states, limit)
    return minimize(table, accepting, 0, byte_map)
