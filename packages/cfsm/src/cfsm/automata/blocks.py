"""Blocks of the direct construction (`direct`): a value piece's own DFA, ready to copy.

A block is built once per structure (its subset construction, or counted repeats such as a
`maxLength` string directly as numpy rows: `_counted`), with the facts the structural
minimization needs (own classes, live bytes, shortest accepted lengths) and, for JSON string
bodies and broad formats, the map of its states onto the per-vocabulary automata
(`templates`, `fragments`). The blocks of the value trees every schema shares are prepared
once per process (`prepare_blocks`). Also the predicates `direct._Builder` uses to choose
between literal states, union states and blocks.
"""

from __future__ import annotations

import numpy as np

from cfsm.automata.automaton import (
    COUNTED_MIN,
    DEFAULT_MAX_DFA_STATES,
    DfaNode,
    Nfa,
    Unit,
    accept_distance,
    subset_construction,
    unit_of,
)
from cfsm.automata.block_facts import (
    SMALL_BLOCK,
    counted_classes,
    counted_string_map,
    facts_small,
    is_json_char,
    live_bytes,
    own_classes,
    string_map,
    unit_map,
)
from cfsm.automata.json_automata import INF, TABLE_FORMATS, f_automaton
from cfsm.errors import GrammarTooLargeError
from cfsm.regex.json_lexical import JSON_CHAR
from cfsm.regex.json_values import format_node, standard_pieces
from cfsm.regex.syntax import Alt, Cat, Chars, Node, Piece, Repeat, Scope, Shared

__all__ = ["prepare_blocks"]


class Fallback(Exception):
    """The tree does not fit the direct construction."""


class Block:
    """A piece's DFA, ready to copy: rows without the dead state, dead entries -1.

    # NOTE: not minimized (the whole table is, once): a block is its subset construction
    """

    __slots__ = ("rows", "col_of", "dist", "accepting", "start", "size", "cuts", "start_bits", "acc_bits",
                 "start_dist", "start_accepting", "classes", "num_classes", "eps", "void", "live_bytes", "start_class",
                 "start_live", "string_body", "string_map", "string_bounds", "fragment", "string_facts", "fragment_facts")

    def __init__(self, node: Node, limit: int = DEFAULT_MAX_DFA_STATES) -> None:
        # a JSON string's text with at most a bound of characters (or none and no minimum): each
        # state behaves exactly like a state of the vocabulary's string automaton once a closing
        # quote follows (`templates`)
        body = node if isinstance(node, Repeat) and is_json_char(node.item) and (
            node.hi is not None or node.lo == 0) else None
        self.string_body = body is not None
        self.string_bounds: tuple[int, int | None] = (body.lo, body.hi) if body is not None else (0, None)
        counted = _counted(node) if isinstance(node, Repeat) else None
        col_of = None
        classes = None  # computed below where the block is not known to be minimal
        if counted is not None and isinstance(node, Repeat):
            t, acc, dist, col_of = counted  # one column per byte interval of the unit
            n, start = len(t), 0
            classes = counted_classes(node, t.shape[0], unit_of(node.item))
        elif isinstance(node, DfaNode):
            dfa = node.dfa
            n, start = dfa.num_states, dfa.start
            if n == 0:
                raise Fallback("a piece accepts nothing")
            t = dfa.transitions[:n].astype(np.int64)
            acc = dfa.accepting[:n]
            dist = accept_distance(dfa.transitions, dfa.accepting, n)[:n]
            classes = np.arange(n, dtype=np.int64)  # a Dfa is minimal and trimmed
        else:
            nfa = Nfa(0, limit)
            s, e = nfa.build(node)
            try:
                narrow, accepting, byte_map = subset_construction(nfa, s, e, limit=limit)
            except GrammarTooLargeError as exc:
                raise Fallback("too large: the generic construction reports it") from exc
            n, start = narrow.shape[0] - 1, 0
            t = narrow[:n].astype(np.int64)  # one column per byte group of the construction
            t[t == n] = -1
            acc = accepting[:n]
            dist = accept_distance(narrow, accepting, n)[:n]
            col_of = np.asarray(byte_map, dtype=np.int64)
        if col_of is None:
            t[t == n] = -1
            col_of = _IDENTITY
            self.cuts = np.flatnonzero((t[:, 1:] != t[:, :-1]).any(axis=0)) + 1  # where a byte interval starts
        else:  # where a byte interval starts: bytes whose column differs from the previous byte's
            ch = np.flatnonzero(col_of[1:] != col_of[:-1]) + 1
            self.cuts = ch[(np.take(t, col_of[ch], axis=1) != np.take(t, col_of[ch - 1], axis=1)).any(axis=0)]
        self.rows = t  # column col_of[b] is byte b's
        self.col_of = col_of
        self.dist = dist  # per state: the shortest accepted length inside the block, -1: none
        self.accepting = np.flatnonzero(acc)
        self.start = start
        self.size = n
        # the bytes the start reads, and the bytes some accepting state reads (bit b: byte b)
        self.start_bits = _bits((t[start] >= 0)[col_of])
        self.start_dist = int(dist[start])
        self.start_accepting = bool(acc[start])
        self.acc_bits = _bits(np.asarray((t[self.accepting] >= 0).any(axis=0))[col_of])
        # per state: its class in the block's own minimal DFA (-1: accepts nothing) and the hash of
        # the set of bytes that lead to a state accepting something (an invariant of its language)
        if n <= SMALL_BLOCK and classes is None:
            classes, self.live_bytes = facts_small(t, acc, dist, col_of)
        else:
            if classes is None:
                classes = own_classes(t, acc, dist)
            self.live_bytes = live_bytes(t, classes, col_of)
        self.classes = classes
        self.num_classes = int(classes.max()) + 1 if n else 0
        # states whose own language is the empty string (accepting, no byte leads to a state that
        # accepts something): a copy's such state is its continuation
        self.eps = np.flatnonzero(acc & ~((t >= 0) & (np.take(classes, np.maximum(t, 0)) >= 0)).any(axis=1))
        self.void = np.flatnonzero(classes < 0)  # states that accept nothing: a copy's are dead
        # for a string body: per state its T state and completed characters (`string_map`)
        self.string_map: np.ndarray | None = None
        if body is not None and n:
            self.string_map = string_map(body, t, col_of, start, n) if counted is None else counted_string_map(
                body, n)
            if self.string_map is None:
                self.string_body = False
        # a format with per-vocabulary tables (`fragments`): the format and each state's F state
        self.fragment = _fragment_map(node, t, acc, col_of, start, classes) if type(node) is Piece and n else None
        # what `_Builder.string_states` and `fragment_states` take from each copy (shifted by its base)
        self.string_facts: tuple[np.ndarray, ...] | None = None
        if self.string_body and self.string_map is not None:
            keep = np.flatnonzero(classes >= 0)
            ts, js = self.string_map
            node_lo, node_hi = self.string_bounds
            rem = np.full(len(keep), INF, dtype=np.int64) if node_hi is None else node_hi - js[keep]
            need = np.zeros(len(keep), dtype=np.int64) if node_hi is None else np.maximum(node_lo - js[keep], 0)
            self.string_facts = (keep, ts[keep], rem, need)
        self.fragment_facts: tuple[np.ndarray, np.ndarray] | None = None
        if self.fragment is not None:
            keep = np.flatnonzero(self.fragment[1] >= 0)
            self.fragment_facts = (keep, self.fragment[1][keep])
        # the start's own class (-1: its language is the empty string, -2: none) and live bytes
        if n:
            self.start_class = -1 if start in self.eps else (-2 if classes[start] < 0 else int(classes[start]))
            self.start_live = int(self.live_bytes[start])
        else:
            self.start_class, self.start_live = -2, 0


_IDENTITY = np.arange(256)


def _fragment_map(node: Piece, t: np.ndarray, acc: np.ndarray, col_of: np.ndarray, start: int,
                  classes: np.ndarray) -> tuple[str, np.ndarray] | None:
    """For the block of a format piece with per-vocabulary tables (`json_automata.TABLE_FORMATS`):
    (the format, per block state its state s in the format's F, -1 for states that accept
    nothing), proven by walking both in step: state q's language followed by a closing quote is
    exactly F's from s (every byte checked). None for other pieces or where a step disagrees."""
    fmt = next((f for f in TABLE_FORMATS if node.item is format_node(f)), None)
    auto = None if fmt is None else f_automaton(fmt)
    if fmt is None or auto is None:
        return None
    code, f_start = auto
    num_f = code.shape[0]
    rows = np.where((t >= 0) & (np.take(classes, np.maximum(t, 0)) >= 0), t, -1)[:, col_of].tolist()
    ends = acc.tolist()
    fm = [-1] * len(rows)
    fm[start] = f_start
    todo = [start]
    codes = code.tolist()
    for q in todo:
        row, frow = rows[q], codes[fm[q]]
        if (frow[0x22] == num_f) != bool(ends[q]):
            return None  # F leaves at the quote exactly where the block may end
        for b in range(256):
            q2, s2 = row[b], frow[b]
            if q2 < 0:
                if s2 < num_f or (s2 == num_f and b != 0x22):
                    return None  # F reads on where the block is dead
                continue
            if s2 >= num_f:
                return None
            if fm[q2] < 0:
                fm[q2] = s2
                todo.append(q2)
            elif fm[q2] != s2:
                return None
    return fmt, np.asarray(fm, dtype=np.int64)


_COUNTED_MAX_STATES = 50_000


def _dense_unit(unit: Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The unit's table with one column per byte interval (-1 dead, -2 the unit completed), each
    state's shortest completion, and the column of each byte; kept by the unit (`Unit.derived`)."""
    hit = unit.derived.get("dense")
    if hit is not None:
        return hit  # type: ignore[no-any-return]
    n = len(unit.rows)
    u = np.full((n, 256), -1, dtype=np.int64)
    for q, ranges in enumerate(unit.rows):
        for a, b, t in ranges:
            u[q, a : b + 1] = t if t >= 0 else -2
    # shortest completion: the unit as a DFA whose one accepting state (n) is the completion
    table = np.where(u == -2, n, np.where(u < 0, n + 1, u))
    table = np.vstack([table, np.full((2, 256), n + 1)])
    acc = np.zeros(n + 2, dtype=bool)
    acc[n] = True
    d = accept_distance(table, acc, n + 1)[:n]
    step = np.ones(256, dtype=bool)
    step[1:] = (u[:, 1:] != u[:, :-1]).any(axis=0)
    col_of = np.cumsum(step) - 1
    u = np.ascontiguousarray(u[:, np.flatnonzero(step)])
    unit.derived["dense"] = (u, d, col_of)
    return u, d, col_of


def _counted(node: Repeat) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(rows, accepting, shortest accepted lengths, column of each byte) of `item{lo,hi}` for a
    prefix-code item, built as numpy blocks: state j * n + q is the unit's state q after j
    completed units (the generic construction's counter fragment, `Nfa._counted`, already
    deterministic); bounded, one last state (hi units read). Rows have one column per byte
    interval of the unit (bytes whose columns in the unit's table are equal and adjacent; -1:
    dead). None if the item is not a prefix code. Start: state 0."""
    lo, hi = node.lo, node.hi
    top = lo if hi is None else hi
    if hi is not None and (top < COUNTED_MIN or lo > hi):
        return None  # small (the subset construction is as cheap), or empty
    unit = unit_of(node.item)
    if unit is None or top == 0:
        return None
    u, du, col_of = _dense_unit(unit)
    n, s0 = len(u), unit.start
    k = u.shape[1]
    rows_n = top + 1 if hi is None else top  # rows of unit states
    size = rows_n * n + (0 if hi is None else 1)
    if size > _COUNTED_MAX_STATES:
        return None
    j = np.arange(rows_n, dtype=np.int64)
    done = np.minimum(j + 1, top) * n + s0 if hi is None else np.where(j + 1 < top, (j + 1) * n + s0, top * n)
    if unit.start != 0:  # NOTE: state 0 must be the start: swap the unit's states 0 and s0
        return None
    flat = u.reshape(-1)
    inner = np.flatnonzero(flat >= 0)
    comp = np.flatnonzero(flat == -2)
    t = np.full((size, k), -1, dtype=np.int64)  # the bounded form's last row stays dead
    body = t[: rows_n * n].reshape(rows_n, n * k)
    body[:, inner] = flat[inner][None, :] + (j * n)[:, None]
    body[:, comp] = done[:, None]
    # shortest accepted length of (j, q): finish this unit, then the units still owed to lo
    owe = np.maximum(lo - j - 1, 0)[:, None] * int(du[s0])
    dist = np.empty(size, dtype=np.int64)
    dist[: rows_n * n] = (du[None, :] + owe).reshape(-1)
    acc = np.zeros(size, dtype=bool)
    if hi is None:
        acc[top * n + s0] = True
        dist[top * n + s0] = 0
    else:
        acc[np.arange(lo, top) * n + s0] = True
        dist[np.arange(lo, top) * n + s0] = 0
        acc[-1] = True
        dist[-1] = 0
    return t, acc, dist, col_of


# blocks of per-process value trees, built once (`prepare_blocks`): id(node) -> (node, block)
# NOTE: pure memoization of immutable inputs, bounded: only the standard value trees of
# `cfsm.regex.json_values` (one per format and a few more), each kept beside its block
PREPARED: dict[int, tuple[Node, Block]] = {}


def is_loop(node: Node) -> bool:
    """An unbounded repeat of ASCII ranges (a whitespace run): one loop state (`direct_loops`)."""
    return (isinstance(node, Repeat) and node.lo == 0 and node.hi is None and isinstance(node.item, Chars)
            and bool(node.item.ranges) and node.item.ranges[-1][1] < 0x80)


def is_literal(node: Node) -> bool:
    """One ASCII range: a literal state of the construction, not a block."""
    return isinstance(node, Chars) and len(node.ranges) == 1 and node.ranges[0][1] < 0x80


def holds_prepared(node: Node, memo: dict[int, bool]) -> bool:
    """Whether a prepared block (a standard value tree, an unbounded string body) lies inside
    `node`: then its choices are worth union states (`_Builder._choice`), which copy those blocks
    instead of building a block around them per compile. `memo`: by node id (one tree)."""
    hit = memo.get(id(node))
    if hit is None:
        if id(node) in PREPARED and PREPARED[id(node)][0] is node:
            hit = True
        elif isinstance(node, Cat | Alt):
            hit = any(holds_prepared(it, memo) for it in node.items)
        elif isinstance(node, Repeat):
            hit = holds_prepared(node.item, memo)
        else:
            hit = False
        memo[id(node)] = hit
    return hit


# `_Builder._literal_states` takes loop-free literal trees of at most this many nodes
DAG_MAX = 400


def dag_size(node: Node, memo: dict[int, int]) -> int:
    """The node count of a tree made of literal ASCII ranges, concatenation, alternation and
    repeats with an upper bound (no loop; repeats counted unrolled), -1 if it is not one.
    `memo`: by node id (one tree)."""
    hit = memo.get(id(node))
    if hit is not None:
        return hit
    size = -1
    if isinstance(node, Chars):
        size = 1 if is_literal(node) else -1
    elif isinstance(node, Cat | Alt):
        if not (isinstance(node, Alt) and not node.items):
            size = 1
            for it in node.items:
                k = dag_size(it, memo)
                if k < 0:
                    size = -1
                    break
                size += k
    elif isinstance(node, Repeat) and node.hi is not None and node.lo <= node.hi:
        k = dag_size(node.item, memo)
        size = -1 if k < 0 else 1 + k * max(node.hi, 1)
    memo[id(node)] = size
    return size


def fixed_count(node: Node) -> bool:
    """A repeat with lo == hi (`[0-9]{5}`): as `_Builder._choice` builds it, no union state, only
    copies of its item (literal states for a literal item)."""
    return isinstance(node, Repeat) and node.lo == node.hi


def led(node: Node) -> bool:
    """The empty string or led by a literal ASCII range or a whitespace run (a candidate choice of
    `_Builder._choice`)."""
    if isinstance(node, Cat):
        return not node.items or is_literal(node.items[0]) or is_loop(node.items[0])
    return is_literal(node) or is_loop(node)


def _block_nodes(node: Node, out: list[Node]) -> None:
    """The nodes that `_Builder.build(node)` makes blocks of (as `count_blocks` walks it)."""
    if is_literal(node):
        return
    if isinstance(node, Cat):
        for item in node.items:
            _block_nodes(item, out)
    elif type(node) is Piece:
        out.append(node)
    elif isinstance(node, Scope | Shared):
        _block_nodes(node.item, out)
    else:
        out.append(node)


def prepare_blocks() -> None:
    """Build the blocks of the per-process value trees that schemas share (string body,
    boolean, number, integer, formats: `cfsm.regex.json_values.standard_pieces`) once, so that compiles
    copy them instead of running their subset constructions. Grammar-independent; called by
    `Vocabulary.prepare()`. Idempotent."""
    for piece in standard_pieces():
        found: list[Node] = []
        _block_nodes(piece, found)
        for node in found:
            if id(node) not in PREPARED:
                try:
                    PREPARED[id(node)] = (node, Block(node))
                except Fallback:
                    continue
    # the JSON character's unit tables, which every counted string body (`maxLength`) reads
    unit = unit_of(JSON_CHAR)
    if unit is not None:
        _dense_unit(unit)
        unit_map(unit)


def _bits(mask: np.ndarray) -> int:
    """A 256-bit int with bit b set where mask[b]."""
    return int.from_bytes(np.packbits(mask, bitorder="little").tobytes(), "little")
