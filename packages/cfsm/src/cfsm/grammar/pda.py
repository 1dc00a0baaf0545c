"""A `Grammar` to a recursive transition network: one byte DFA per rule whose edges also call rules.

Every maximal part of a rule body without rule references is built as the minimal DFA cfsm's
regular compiler gives (`automaton.build_dfa`, exact UTF-8; small parts directly: `_ascii_dfa`,
`_small_dfa`) and embedded when the subset construction first reaches it;
references, concatenation, alternation and repetition around them are a small NFA per rule,
determinized over bytes and called rules.
States are numbered globally: `trans[s, b]` is the next state on byte b inside the same rule
(-1: none), `calls[s]` the (called rule, return state) pairs, `accepting[s]` whether the rule may
end at s. A runtime stack is a tuple of states: return states, then the current state on top.

Checks (all `GrammarError`, naming the rule and where it is defined): an empty language,
left recursion (a rule that can call itself before reading a byte; write it with repetition).
Rules that can never complete are removed, and states that cannot reach their rule's end are
trimmed, so every non-empty stack set can still complete the grammar.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from cfsm.automata.automaton import Nfa, build_dfa, byte_closure, byte_segments
from cfsm.config import CfsmLimits
from cfsm.errors import GrammarError, GrammarTooLargeError, PushdownTooLargeError
from cfsm.grammar.rules import Grammar, RuleRef, has_refs
from cfsm.regex.syntax import Alt, Cat, Chars, Node, Repeat, Scope, Sep, Shared

__all__ = ["Pda", "build_pda"]


@dataclass(frozen=True, eq=False)
class Pda:
    """The network of all rules (see the module docstring). Immutable after `build_pda`."""

    trans: np.ndarray  # (num_states, 256) int32, -1: no edge
    calls: tuple[tuple[tuple[int, int], ...], ...]  # per state: (rule, return state)
    accepting: np.ndarray  # (num_states,) bool
    has_bytes: np.ndarray  # (num_states,) bool: some byte edge leaves the state
    state_rule: np.ndarray  # (num_states,) int32: the rule of each state
    rule_start: tuple[int, ...]
    rule_names: tuple[str, ...]
    root: int  # the start rule

    @property
    def num_states(self) -> int:
        return int(self.trans.shape[0])

    @property
    def start_stack(self) -> tuple[int, ...]:
        return (self.rule_start[self.root],)


class _Nfa:
    """Thompson NFA of one rule: epsilon edges, byte-range edges and call edges."""

    def __init__(self, names: dict[str, int], memo: dict[int, bool], dfas: dict[int, Any] | None = None,
                 limits: CfsmLimits | None = None) -> None:
        self.dfas = {} if dfas is None else dfas  # id(node) -> minimal DFA (a part inlined twice is built once)
        self.limits = limits or CfsmLimits()
        self.eps: list[list[int]] = []
        self.bytes: list[list[tuple[int, int, int]]] = []
        self.calls: list[list[tuple[int, int]]] = []
        self.names = names
        self.memo = memo
        # per enclosing Scope: the fragment of each Shared node, built once (Shared nodes sit in
        # tail position, so every reference may enter the same fragment, as in `automaton`)
        self.shared: list[dict[int, tuple[int, int]]] = [{}]
        # entry state -> (reference-free part, exit state) not embedded yet (`embed`)
        self.pending: dict[int, tuple[Node, int]] = {}

    def new(self) -> int:
        self.eps.append([])
        self.bytes.append([])
        self.calls.append([])
        if len(self.eps) > self.limits.max_pda_states:
            raise GrammarError(f"the grammar is too large (more than {self.limits.max_pda_states} automaton states)")
        return len(self.eps) - 1

    def build(self, node: Node) -> tuple[int, int]:
        if isinstance(node, Shared):
            memo = self.shared[-1]
            if id(node) not in memo:
                memo[id(node)] = self.build(node.item)
            return memo[id(node)]
        if isinstance(node, Scope) and has_refs(node, self.memo):
            self.shared.append({})
            try:
                return self.build(node.item)
            finally:
                self.shared.pop()
        if not has_refs(node, self.memo):
            return self._regular(node)
        if isinstance(node, RuleRef):
            s, e = self.new(), self.new()
            self.calls[s].append((self.names[node.name], e))
            return s, e
        if isinstance(node, Cat):
            s = e = self.new()
            for item in node.items:
                a, b = self.build(item)
                self.eps[e].append(a)
                e = b
            return s, e
        if isinstance(node, Alt):
            s, e = self.new(), self.new()
            for item in node.items:
                a, b = self.build(item)
                self.eps[s].append(a)
                self.eps[b].append(e)
            return s, e
        if isinstance(node, Repeat):
            return self._repeat(node.item, node.lo, node.hi)
        if isinstance(node, Sep):
            a, b = self.build(node.item)
            c, d = self.build(node.sep)
            self.eps[b].append(c)
            self.eps[d].append(a)
            return a, b
        if isinstance(node, Scope):
            return self.build(node.item)
        raise GrammarError(f"{type(node).__name__} over rule references is not supported (only over regular parts)")

    def _repeat(self, item: Node, lo: int, hi: int | None) -> tuple[int, int]:
        s = e = self.new()
        for _ in range(lo):
            a, b = self.build(item)
            self.eps[e].append(a)
            e = b
        if hi is None:
            a, b = self.build(item)
            self.eps[e].append(a)
            self.eps[b].append(a)
            out = self.new()
            self.eps[e].append(out)
            self.eps[b].append(out)
            return s, out
        out = self.new()
        for _ in range(hi - lo):
            a, b = self.build(item)
            self.eps[e].append(a)
            self.eps[e].append(out)
            e = b
        self.eps[e].append(out)
        return s, out

    def _regular(self, node: Node) -> tuple[int, int]:
        """A reference-free part: its entry and exit states; its minimal DFA is built and
        embedded when the subset construction first reaches the entry (`embed`), so a build
        stopped at a position limit never builds the parts it did not reach."""
        s, e = self.new(), self.new()
        self.pending[s] = (node, e)
        return s, e

    def embed(self, s: int) -> None:
        """Embed the minimal DFA of the part pending at entry state `s` (see `_regular`)."""
        node, e = self.pending.pop(s)
        dfa = self.dfas.get(id(node))
        if dfa is None:
            limit = self.limits.max_dfa_states
            chain = _ascii_dfa(node)
            if chain is None or chain.num_states > limit:
                chain = _small_dfa(node, limit)
            dfa = self.dfas[id(node)] = (chain if chain is not None and chain.num_states <= limit
                                         else build_dfa(node, limit=limit))
        n = dfa.num_states
        if n == 0:
            return  # the empty language: no path from s to e
        base = len(self.eps)
        if base + n > self.limits.max_pda_states:
            raise GrammarError(f"the grammar is too large (more than {self.limits.max_pda_states} automaton states)")
        self.eps.extend([] for _ in range(n))
        self.bytes.extend([] for _ in range(n))
        self.calls.extend([] for _ in range(n))
        if isinstance(dfa, _Chain):
            # NOTE: a chain's edges are its classes' byte ranges (no table scan: most parts are chains)
            for k, ranges in enumerate(dfa.runs):
                self.bytes[base + k].extend((lo, hi, base + t) for lo, hi, t in ranges)
            for q in dfa.ends:
                self.eps[base + q].append(e)
            self.eps[s].append(base + dfa.start)
            return
        # runs of equal targets over consecutive bytes, of every row at once (row-major order:
        # each row's runs by increasing byte, one start and one end per run)
        table = dfa.transitions[:n]
        live = table != dfa.dead
        same = np.zeros((n, 256), dtype=bool)
        same[:, 1:] = live[:, 1:] & live[:, :-1] & (table[:, 1:] == table[:, :-1])
        starts = np.flatnonzero(live & ~same)
        ends = np.flatnonzero(live & ~np.concatenate([same[:, 1:], np.zeros((n, 1), dtype=bool)], axis=1))
        edges = self.bytes
        for at, end, t in zip(starts.tolist(), (ends & 255).tolist(), (table.ravel().take(starts) + base).tolist(),
                              strict=True):
            edges[base + (at >> 8)].append((at & 255, end, t))
        for q in np.flatnonzero(dfa.accepting[:n]).tolist():
            self.eps[base + q].append(e)
        self.eps[s].append(base + dfa.start)


@dataclass(frozen=True, eq=False)
class _Chain:
    """A minimal DFA built without the regular compiler (`_ascii_dfa`, `_small_dfa`): its edges,
    which `embed` reads, and the fields of `Dfa` (built on first use: tests compare them with
    `build_dfa`'s)."""

    start: int
    dead: int
    num_states: int
    runs: tuple[tuple[tuple[int, int, int], ...], ...]  # per state: its edges (lo, hi, target) by increasing byte
    ends: tuple[int, ...]  # the accepting states, ascending

    @functools.cached_property
    def transitions(self) -> np.ndarray:
        """(num_states + 1, 256) int32; row num_states: the dead state."""
        table = np.full((self.num_states + 1, 256), self.dead, dtype=np.int32)
        for k, runs in enumerate(self.runs):
            for lo, hi, t in runs:
                table[k, lo:hi + 1] = t
        return table

    @functools.cached_property
    def accepting(self) -> np.ndarray:
        """(num_states + 1,) bool."""
        out = np.zeros(self.num_states + 1, dtype=bool)
        out[list(self.ends)] = True
        return out


def _ascii_class(node: Node) -> list[int] | None:
    """The bytes of `node` if it is one character out of ASCII ranges, else None. Pure."""
    if not isinstance(node, Chars) or not node.ranges or node.ranges[-1][1] >= 128:
        return None
    return [b for lo, hi in node.ranges for b in range(lo, hi + 1)]


def _byte_runs(edges: list[tuple[int, int]]) -> tuple[tuple[int, int, int], ...]:
    """Edges (byte, target) (distinct bytes) as ranges (lo, hi, target) of consecutive bytes with
    one target, by increasing byte. Pure."""
    out: list[tuple[int, int, int]] = []
    for b, t in sorted(edges):
        if out and out[-1][1] == b - 1 and out[-1][2] == t:
            out[-1] = (out[-1][0], b, t)
        else:
            out.append((b, b, t))
    return tuple(out)


def _ascii_dfa(node: Node) -> _Chain | None:
    """The minimal DFA `automaton.build_dfa` gives, built directly where `node` is a chain of
    ASCII classes: one class, a concatenation of classes (a literal) where a class may also
    repeat `{lo,}` times (``[ \\t]* "," [ \\t]*``: no two repeats in a row, a repeat's bytes
    not those of the class after it), or one class repeated `{lo,hi}` / `{lo,}` times; else None.
    Pure.

    NOTE: such a DFA is the chain itself (states 0..k in reading order, a repeat a loop on its
    state; no two alike: each reads a different number of bytes at least before it may end), as
    `build_dfa` numbers it; the regular compiler's general path (NFA, subset construction,
    minimization) took ~0.2-1 ms per part, most of a small grammar's network."""
    loops: dict[int, list[int]] = {}  # state -> the bytes that step it to itself
    if isinstance(node, Cat):
        if not node.items:
            return None
        links: list[list[int]] = []
        for item in node.items:
            cls = _ascii_class(item)
            if cls is not None:
                links.append(cls)
                continue
            if not isinstance(item, Repeat) or item.hi is not None or (cls := _ascii_class(item.item)) is None:
                return None
            links.extend([cls] * item.lo)
            if len(links) in loops:
                return None  # NOTE: two repeats in a row (`a* b*`): not a chain
            loops[len(links)] = cls
        if any(k < len(links) and set(cls) & set(links[k]) for k, cls in loops.items()):
            return None  # NOTE: a loop's byte would also step on (not deterministic as a chain)
        final = len(links)
        ends = [final]
    elif isinstance(node, Repeat):
        unit = _ascii_class(node.item)
        if unit is None or (node.hi is not None and not 0 < node.hi <= 64):
            return None
        if node.hi is None:
            links = [unit] * node.lo
            final = node.lo
            loops[final] = unit
            ends = [final]
        else:
            if node.lo > node.hi:
                return None
            links = [unit] * node.hi
            final = node.hi
            ends = list(range(node.lo, node.hi + 1))
    else:
        unit = _ascii_class(node)
        if unit is None:
            return None
        links, final, ends = [unit], 1, [1]
    n = final + 1
    runs = tuple(_byte_runs(([(b, k + 1) for b in links[k]] if k < final else []) + [(b, k) for b in loops.get(k, [])])
                 for k in range(n))
    return _Chain(start=0, dead=n, num_states=n, runs=runs, ends=tuple(sorted(set(ends))))


# parts whose NFA (`automaton.Nfa`) has at most this many states, and their subset construction
# at most this many subsets, are built by `_small_dfa`; larger ones by `build_dfa`
_SMALL_NFA = 64
_SMALL_SUBSETS = 24


def _small_dfa(node: Node, limit: int) -> _Chain | None:
    """The minimal DFA `automaton.build_dfa(node, limit=limit)` gives, built in Python over byte
    ranges where the part is small: the regular compiler's NFA of it, a subset construction over
    the NFA's ranges, trimmed, Moore rounds on each subset's runs of target classes, the classes
    numbered breadth-first from the start, each state's targets by ascending byte; None where
    the NFA passes `_SMALL_NFA` states or the subsets `_SMALL_SUBSETS`, the DFA passes `limit` or the language is empty
    (`build_dfa` then builds or refuses it). Pure.

    NOTE: the regular compiler's subset construction also discovers states breadth-first by
    ascending byte and its minimization numbers classes in first-seen order: each minimal state
    gets the rank of its shortlex-least access word either way, so the numbering is the same
    (`_ascii_dfa`'s chains: the same order). The numpy tables of `build_dfa` took ~0.3-0.5 ms
    per part (free JSON's number, quoted string and string body: ~1.2 ms of its compile)."""
    nfa = Nfa(_SMALL_NFA, limit)
    try:
        start, final = nfa.build(node)
    except GrammarTooLargeError:
        return None
    eps, ntrans = nfa.eps, nfa.trans
    closures: dict[int, frozenset[int]] = {}

    def closure(q: int) -> frozenset[int]:
        c = closures.get(q)
        if c is None:
            c = closures[q] = byte_closure(eps, ntrans, final, q)
        return c

    first = closure(start)
    ids = {first: 0}
    sets = [first]
    rows: list[list[tuple[int, int, int]]] = []
    accepting: list[bool] = []
    targets: dict[int | frozenset[int], int] = {}  # a segment's NFA target(s) -> its subset (-1: none)
    i = 0
    while i < len(sets):
        cur = sets[i]
        i += 1
        if len(cur) == 1:
            (q,) = cur
            ranges = sorted(ntrans[q])
        else:
            ranges = sorted([t for q in cur for t in ntrans[q]])
        row: list[tuple[int, int, int]] = []
        # NOTE: disjoint ranges (most subsets) have one target each: no sweep, no target sets
        segs: list[tuple[int, int, int]] | list[tuple[int, int, frozenset[int]]] = ranges
        end = -1
        for lo, hi, _ in ranges:
            if lo <= end:
                segs = byte_segments(ranges)
                break
            end = hi
        for lo, hi, tg in segs:
            j = targets.get(tg)
            if j is None:
                key = closure(tg) if isinstance(tg, int) else frozenset().union(*(closure(x) for x in tg))
                j = ids.get(key, -1) if key else -1
                if j < 0 and key:
                    if len(sets) >= min(_SMALL_SUBSETS, limit):
                        return None
                    j = ids[key] = len(sets)
                    sets.append(key)
                targets[tg] = j
            if j >= 0:
                row.append((lo, hi, j))
        rows.append(row)
        accepting.append(final in cur)
    # trim: the subsets that reach an accepting one, with the length of their shortest accepted string
    n = len(sets)
    preds: list[list[int]] = [[] for _ in range(n)]
    for p, row in enumerate(rows):
        for _, _, t in row:
            preds[t].append(p)
    dist = [0 if a else -1 for a in accepting]
    frontier = [q for q in range(n) if accepting[q]]
    d = 0
    while frontier:
        d += 1
        nxt: list[int] = []
        for q in frontier:
            for p in preds[q]:
                if dist[p] < 0:
                    dist[p] = d
                    nxt.append(p)
        frontier = nxt
    if dist[0] < 0:
        return None
    states = [q for q in range(n) if dist[q] >= 0]
    rows = [[e for e in row if dist[e[2]] >= 0] for row in rows]
    # Moore rounds: a state's signature is its class and its runs of target classes; the first
    # classes (acceptance, shortest accepted length: properties of a state's language) leave few rounds
    first_cls: dict[tuple[bool, int], int] = {}
    cls = [first_cls.setdefault((accepting[q], dist[q]), len(first_cls)) if dist[q] >= 0 else -1 for q in range(n)]
    num = len(first_cls)
    while True:
        sig: dict[tuple[Any, ...], int] = {}
        new = cls.copy()
        for q in states:
            new[q] = sig.setdefault((cls[q], _class_runs(rows[q], cls)), len(sig))
        cls = new
        if len(sig) == num:
            break
        num = len(sig)
    # renumber breadth-first from the start, each state's targets by ascending byte
    rep: dict[int, int] = {}
    for q in states:
        rep.setdefault(cls[q], q)
    order = [cls[0]]
    new_id = {cls[0]: 0}
    k = 0
    while k < len(order):
        for _, _, c in _class_runs(rows[rep[order[k]]], cls):
            if c not in new_id:
                new_id[c] = len(order)
                order.append(c)
        k += 1
    m = len(order)
    if m > limit:
        return None
    runs = tuple(tuple((lo, hi, new_id[c]) for lo, hi, c in _class_runs(rows[rep[c0]], cls)) for c0 in order)
    ends = tuple(k for k, c0 in enumerate(order) if accepting[rep[c0]])
    return _Chain(start=0, dead=m, num_states=m, runs=runs, ends=ends)


def _class_runs(row: list[tuple[int, int, int]], cls: list[int]) -> tuple[tuple[int, int, int], ...]:
    """Sorted disjoint byte ranges (lo, hi, state) as maximal runs (lo, hi, class of the state) of
    consecutive bytes with one class. Pure."""
    out: list[tuple[int, int, int]] = []
    for lo, hi, t in row:
        c = cls[t]
        if out and out[-1][1] == lo - 1 and out[-1][2] == c:
            out[-1] = (out[-1][0], hi, c)
        else:
            out.append((lo, hi, c))
    return tuple(out)


def _closure(nfa: _Nfa, states: frozenset[int]) -> frozenset[int]:
    if len(states) == 1:
        # NOTE: most subsets inside an embedded DFA: one state without epsilon edges
        (q,) = states
        if not nfa.eps[q] and q not in nfa.pending:
            return states
    out = set(states)
    work = list(states)
    pending = nfa.pending
    while work:
        q = work.pop()
        if q in pending:
            nfa.embed(q)
        for t in nfa.eps[q]:
            if t not in out:
                out.add(t)
                work.append(t)
    return frozenset(out)


def _pieces(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, frozenset[int]]]:
    """The byte ranges (lo, hi, target) of one subset's states as disjoint ranges of bytes with
    the same target set: (lo, hi, targets), in the order their bytes first appear in `ranges`
    (each range's bytes ascending), which numbers new subsets as stepping byte by byte would."""
    if len(ranges) <= 1:
        return [(lo, hi, frozenset((t,))) for lo, hi, t in ranges]
    by_lo = sorted(ranges)
    if all(a[1] < b[0] for a, b in zip(by_lo, by_lo[1:], strict=False)):
        return [(lo, hi, frozenset((t,))) for lo, hi, t in ranges]  # NOTE: disjoint (most subsets)
    cuts = sorted({lo for lo, _, _ in ranges} | {hi + 1 for _, hi, _ in ranges})
    at = {c: i for i, c in enumerate(cuts)}
    targets: list[set[int]] = [set() for _ in cuts]
    for lo, hi, t in ranges:
        for i in range(at[lo], at[hi + 1]):
            targets[i].add(t)
    out: list[tuple[int, int, frozenset[int]]] = []
    done = [False] * len(cuts)
    for lo, hi, _ in ranges:
        for i in range(at[lo], at[hi + 1]):
            if not done[i]:
                done[i] = True
                out.append((cuts[i], cuts[i + 1] - 1, frozenset(targets[i])))
    return out


def _determinize(nfa: _Nfa, start: int, end: int, reading: int = 0, limit: int = 0
                 ) -> tuple[list[list[tuple[int, int, int]]], list[dict[int, int]], list[bool]]:
    """Subset construction: per DFA state, byte ranges (lo, hi, state), rule -> return state,
    accepting.
    `limit` > 0: raise `PushdownTooLargeError` once `reading` (states that read a byte, of the
    rules before this one) plus this rule's pass it."""
    first = _closure(nfa, frozenset([start]))
    ids = {first: 0}
    sets = [first]
    byte_edges: list[list[tuple[int, int, int]]] = []
    call_edges: list[dict[int, int]] = []
    accepting: list[bool] = []
    i = 0
    while i < len(sets):
        cur = sets[i]
        i += 1
        ranges: list[tuple[int, int, int]] = []
        by_rule: dict[int, set[int]] = {}
        for q in cur:
            ranges.extend(nfa.bytes[q])
            for r, t in nfa.calls[q]:
                by_rule.setdefault(r, set()).add(t)
        row: list[tuple[int, int, int]] = []
        seen: dict[frozenset[int], int] = {}
        for lo, hi, key in _pieces(ranges):
            sid = seen.get(key)
            if sid is None:
                nxt = _closure(nfa, key)
                sid = ids.get(nxt)
                if sid is None:
                    sid = ids[nxt] = len(sets)
                    sets.append(nxt)
                    if len(sets) > nfa.limits.max_pda_states:
                        raise GrammarError("the grammar is too large (more than "
                                           f"{nfa.limits.max_pda_states} automaton states)")
                seen[key] = sid
            row.append((lo, hi, sid))
        calls: dict[int, int] = {}
        for r, ts in by_rule.items():
            nxt = _closure(nfa, frozenset(ts))
            sid = ids.get(nxt)
            if sid is None:
                sid = ids[nxt] = len(sets)
                sets.append(nxt)
            calls[r] = sid
        byte_edges.append(row)
        call_edges.append(calls)
        accepting.append(end in cur)
        if row:
            reading += 1
            if 0 < limit < reading:
                raise PushdownTooLargeError(reading, limit)
    return byte_edges, call_edges, accepting


def _where(grammar: Grammar, name: str) -> tuple[int, int]:
    return grammar.positions.get(name, (0, 0))


def build_pda(grammar: Grammar, max_positions: int = 0, limits: CfsmLimits | None = None) -> Pda:
    """Compile `grammar` (inline it first: `inline.inline_rules`) into a `Pda`. Pure. Raises
    `GrammarError` (see the module docstring), and with `max_positions` > 0
    `PushdownTooLargeError` as soon as the rules determinized so far have more states that read
    a byte (counted before trimming, which only removes states that cannot complete: an upper
    bound of the final positions, equal to it for grammars without dead ends), so a network far
    over the limit is not built whole. `limits`: `CfsmLimits.max_pda_states` (and the DFA limit
    of its regular parts)."""
    limits = limits or CfsmLimits()
    names = {name: i for i, name in enumerate(grammar.rules)}
    memo: dict[int, bool] = {}
    dfas: dict[int, Any] = {}
    rule_of: list[int] = []
    byte_edges: list[list[tuple[int, int, int]]] = []
    call_edges: list[dict[int, int]] = []
    accepting: list[bool] = []
    starts: list[int] = []
    reading = 0  # states so far that read a byte
    for r, (name, body) in enumerate(grammar.rules.items()):
        nfa = _Nfa(names, memo, dfas, limits)
        try:
            s, e = nfa.build(body)
        except GrammarError as exc:
            if exc.line:
                raise
            raise GrammarError(f"rule {name!r}: {exc.detail}", *_where(grammar, name)) from None
        be, ce, acc = _determinize(nfa, s, e, reading, max_positions)
        reading += sum(1 for row in be if row)
        base = len(rule_of)
        starts.append(base)
        for row, calls in zip(be, ce, strict=True):
            byte_edges.append([(lo, hi, base + t) for lo, hi, t in row])
            call_edges.append({c: base + t for c, t in calls.items()})
            rule_of.append(r)
        accepting.extend(acc)
    n = len(rule_of)
    if n > limits.max_pda_states:
        raise GrammarError(f"the grammar is too large ({n} automaton states, at most {limits.max_pda_states})")
    productive = _productive(byte_edges, call_edges, accepting, starts, rule_of)
    root = names[grammar.root]
    if not productive[root]:
        raise GrammarError(f"the language of rule {grammar.root!r} is empty (every derivation recurses forever or "
                           "uses an empty character class)", *_where(grammar, grammar.root))
    live = _coreachable(byte_edges, call_edges, accepting, productive, n)
    trans = np.full((n, 256), -1, dtype=np.int32)
    edges = [(s, lo, hi, t) for s, row in enumerate(byte_edges) for lo, hi, t in row]
    if edges:
        src, lo, hi, dst = np.array(edges, dtype=np.int64).T
        keep = live[src] & live[dst]
        src, lo, dst, width = src[keep], lo[keep], dst[keep], hi[keep] - lo[keep] + 1
        # NOTE: the byte ranges of one state are disjoint: one fancy assignment of every edge's bytes
        trans[np.repeat(src, width), np.repeat(lo - np.cumsum(width) + width, width) + np.arange(int(width.sum()))] \
            = np.repeat(dst, width)
    is_live: list[bool] = live.tolist()
    calls_out: list[tuple[tuple[int, int], ...]] = [
        tuple(sorted((c, t) for c, t in call_edges[s].items() if is_live[t] and productive[c])) if is_live[s] else ()
        for s in range(n)]
    pda = Pda(trans=trans, calls=tuple(calls_out), accepting=np.array(accepting, dtype=bool) & live,
              has_bytes=np.asarray((trans >= 0).any(axis=1)), state_rule=np.array(rule_of, dtype=np.int32), rule_start=tuple(starts), rule_names=tuple(grammar.rules),
              root=root)
    _check_left_recursion(pda, grammar)
    return pda


def _productive(byte_edges: list[list[tuple[int, int, int]]], call_edges: list[dict[int, int]], accepting: list[bool],
                starts: list[int], rule_of: list[int]) -> list[bool]:
    """Rules that derive at least one string (fixpoint)."""
    num_rules = len(starts)
    productive = [False] * num_rules
    changed = True
    while changed:
        changed = False
        for r in range(num_rules):
            if productive[r]:
                continue
            seen = {starts[r]}
            work = [starts[r]]
            while work:
                s = work.pop()
                if accepting[s]:
                    productive[r] = changed = True
                    break
                nxt = [t for _, _, t in byte_edges[s]] + [t for c, t in call_edges[s].items() if productive[c]]
                for t in nxt:
                    if t not in seen:
                        seen.add(t)
                        work.append(t)
    return productive


def _coreachable(byte_edges: list[list[tuple[int, int, int]]], call_edges: list[dict[int, int]], accepting: list[bool],
                 productive: list[bool], n: int) -> np.ndarray:
    back: list[list[int]] = [[] for _ in range(n)]
    for s in range(n):
        for _, _, t in byte_edges[s]:
            back[t].append(s)
        for c, t in call_edges[s].items():
            if productive[c]:
                back[t].append(s)
    live = np.array(accepting, dtype=bool)
    work = list(np.flatnonzero(live).tolist())
    while work:
        t = work.pop()
        for s in back[t]:
            if not live[s]:
                live[s] = True
                work.append(s)
    return live


def _check_left_recursion(pda: Pda, grammar: Grammar) -> None:
    """Raise `GrammarError` when a rule can call itself before reading a byte."""
    num_rules = len(pda.rule_start)
    nullable = [False] * num_rules
    changed = True
    while changed:
        changed = False
        for r in range(num_rules):
            if not nullable[r] and _reaches_end(pda, pda.rule_start[r], nullable):
                nullable[r] = changed = True
    corners: list[set[int]] = []
    for r in range(num_rules):
        seen = {pda.rule_start[r]}
        work = [pda.rule_start[r]]
        called: set[int] = set()
        while work:
            s = work.pop()
            for c, t in pda.calls[s]:
                called.add(c)
                if nullable[c] and t not in seen:
                    seen.add(t)
                    work.append(t)
        corners.append(called)
    # a cycle in "calls before reading a byte" (depth-first search with colors)
    color = [0] * num_rules
    for r0 in range(num_rules):
        if color[r0]:
            continue
        stack: list[tuple[int, list[int]]] = [(r0, sorted(corners[r0]))]
        color[r0] = 1
        while stack:
            r, todo = stack[-1]
            if not todo:
                color[r] = 2
                stack.pop()
                continue
            c = todo.pop()
            if color[c] == 1:
                cycle = [pda.rule_names[x] for x, _ in stack[[x for x, _ in stack].index(c):]] + [pda.rule_names[c]]
                name = pda.rule_names[c]
                raise GrammarError(
                    f"rule {name!r} is left-recursive ({' -> '.join(cycle)} before any character is read); "
                    f"rewrite it with repetition, e.g. expr ::= term (\"+\" term)* instead of expr ::= expr \"+\" term",
                    *_where(grammar, name))
            if color[c] == 0:
                color[c] = 1
                stack.append((c, sorted(corners[c])))


def _reaches_end(pda: Pda, start: int, nullable: list[bool]) -> bool:
    seen = {start}
    work = [start]
    while work:
        s = work.pop()
        if pda.accepting[s]:
            return True
        for c, t in pda.calls[s]:
            if nullable[c] and t not in seen:
                seen.add(t)
                work.append(t)
    return False
