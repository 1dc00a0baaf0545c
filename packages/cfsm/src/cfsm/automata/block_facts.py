"""Facts about one block of the direct construction (`cfsm.automata.direct`) and its copies' states, used to
find the minimal DFA's classes from the structure: a block's own classes (its minimal DFA's),
the hash of each state's live-byte set, a few Moore rounds on chosen states, and the map of a
JSON string body's states onto the string automaton T (`cfsm.masks.templates`).
"""

from __future__ import annotations

import numpy as np

from cfsm.automata.automaton import Unit, refine, seeded_weights, unit_of
from cfsm.automata.json_automata import joint_reps, t_automaton, t_automaton_classes
from cfsm.regex.json_lexical import JSON_CHAR
from cfsm.regex.syntax import Node, Repeat

MASK = (1 << 64) - 1
# the hash of a byte set: the sum of its bytes' weights, modulo 2 ** 64 (additive over disjoint sets)
_BYTE_W = np.random.default_rng(0xB7E5).integers(1, 2**63, size=256, dtype=np.uint64)
BYTE_CUM = [0]
for _w in _BYTE_W.tolist():
    BYTE_CUM.append((BYTE_CUM[-1] + _w) & MASK)
BYTE_CUM_U64 = np.asarray(BYTE_CUM, dtype=np.uint64)  # the same as an array (differences wrap alike)


def _column_weights(col_of: np.ndarray, k: int) -> np.ndarray:
    w = np.zeros(k, dtype=np.uint64)
    np.add.at(w, col_of, _BYTE_W)
    return w


def live_bytes(t: np.ndarray, classes: np.ndarray, col_of: np.ndarray) -> np.ndarray:
    """Per state of a block's table: the hash of the set of bytes that lead to a state accepting
    something (the sum of their `_BYTE_W`). Pure."""
    live_t = (t >= 0) & (np.take(classes, np.maximum(t, 0)) >= 0)
    return live_t.astype(np.uint64) @ _column_weights(col_of, t.shape[1])


# blocks of at most this many states find their own classes by plain Python rounds
SMALL_BLOCK = 48


def string_map(node: Repeat, t: np.ndarray, col_of: np.ndarray, start: int, n: int) -> np.ndarray | None:
    """Per state of a string body's table (`Block.string_body`), as two rows: its state in the
    string automaton T and how many characters it completed (-1 for every state of an unbounded
    body), by walking both from (start, T's text state); None where a state meets two (then the
    block proves nothing). Pure."""
    code, text = t_automaton()
    num_t = code.shape[0]
    bounded = node.hi is not None
    t_byte_class = t_automaton_classes()
    reps = joint_reps(col_of, t_byte_class).tolist()
    cols = col_of[reps].tolist()
    rows = t.tolist()
    ts = [-1] * n
    js = [-1] * n
    ts[start], js[start] = text, 0 if bounded else -1
    todo = [start]
    for q in todo:
        s, j = ts[q], js[q]
        row = rows[q]
        for b, c in zip(reps, cols, strict=True):
            q2 = row[c]
            if q2 < 0:
                continue
            s2 = int(code[s, b])
            if s2 >= num_t:  # T leaves or dies where the body reads on
                return None
            j2 = j + (s2 == text) if bounded else -1
            if ts[q2] < 0:
                ts[q2], js[q2] = s2, j2
                todo.append(q2)
            elif ts[q2] != s2 or js[q2] != j2:
                return None
    return np.asarray([ts, js], dtype=np.int64)


def unit_map(unit: Unit) -> np.ndarray | None:
    """`_unit_string_map(unit)`, kept by the unit (`Unit.derived`)."""
    if "string_map" not in unit.derived:
        unit.derived["string_map"] = _unit_string_map(unit)
    return unit.derived["string_map"]  # type: ignore[no-any-return]


def counted_string_map(node: Repeat, size: int) -> np.ndarray | None:
    """`string_map` of a counted string body (state j * n + q: the unit's state q after j
    characters; the bounded form's last state: all characters read) from the unit's map. Pure."""
    unit = unit_of(node.item)
    if unit is None or node.hi is None:
        return None
    umap = unit_map(unit)
    if umap is None:
        return None
    n = len(unit.rows)
    j = np.arange(size, dtype=np.int64) // n
    ts = np.tile(umap, size // n + 1)[:size]
    ts[-1], j[-1] = t_automaton()[1], node.hi  # the last state: hi characters read (T's text state)
    return np.stack([ts, j])


def _unit_string_map(unit: Unit) -> np.ndarray | None:
    """Per state of JSON_CHAR's unit DFA: its state in T (the unit's start: T's text state), by
    walking both over every byte; None where they disagree."""
    code, text = t_automaton()
    num_t = code.shape[0]
    m = [-1] * len(unit.rows)
    m[unit.start] = text
    todo = [unit.start]
    for q in todo:
        s = m[q]
        for a, b, tg in unit.rows[q]:
            for byte in range(a, b + 1):
                s2 = int(code[s, byte])
                if tg < 0:  # the unit completes: T is back in its text state
                    if s2 != text:
                        return None
                    continue
                if s2 >= num_t:
                    return None
                if m[tg] < 0:
                    m[tg] = s2
                    todo.append(tg)
                elif m[tg] != s2:
                    return None
    return np.asarray(m, dtype=np.int64)


def is_json_char(node: Node) -> bool:
    return node is JSON_CHAR


def own_classes(t: np.ndarray, acc: np.ndarray, dist: np.ndarray) -> np.ndarray:
    """Per state of a block's table (dead entries -1): its class in the block's own minimal DFA
    (0, 1, ...), -1 where it accepts nothing. Pure."""
    n = len(t)
    cols = np.vstack([np.where(t < 0, n, t), np.full((1, t.shape[1]), n, dtype=np.int64)])
    d = np.append(dist, -1)
    live = d >= 0
    cls = np.where(live, (np.append(acc, False).astype(np.int64) + 1) * (int(d.max()) + 2) + d + 1, 0)
    cls = refine(cols, cls)[:n]
    out = np.full(n, -1, dtype=np.int64)
    mine = np.flatnonzero(live[:n])
    _, inv = np.unique(cls[mine], return_inverse=True)
    out[mine] = inv.reshape(-1)
    return out


def facts_small(t: np.ndarray, acc: np.ndarray, dist: np.ndarray, col_of: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(own classes, live-byte hashes) of a small block (see `Block`), by plain Python: Moore
    rounds over tuples. Pure."""
    n, k = t.shape
    dl = dist.tolist()
    rows = [[(x if x >= 0 and dl[x] >= 0 else -1) for x in row] for row in t.tolist()]  # void targets: dead
    cls = [(-1 if dl[q] < 0 else (1 + bool(acc[q])) * 100_000 + dl[q]) for q in range(n)]
    num = len(set(cls))
    while True:
        sig: dict[tuple[int, ...], int] = {}
        new = [sig.setdefault((cls[q], *[(cls[x] if x >= 0 else -1) for x in rows[q]]), len(sig)) for q in range(n)]
        if len(sig) == num:
            break
        cls, num = new, len(sig)
    classes = np.asarray(new, dtype=np.int64)
    void = np.asarray(dl, dtype=np.int64) < 0
    if void.any():  # NOTE: states that accept nothing -> -1, the others numbered 0, 1, ...
        _, inv = np.unique(classes[~void], return_inverse=True)
        classes[~void] = inv.reshape(-1)
        classes[void] = -1
    width = _column_weights(col_of, k).tolist()
    live = [sum(width[j] for j, x in enumerate(row) if x >= 0) & MASK for row in rows]
    return classes, np.asarray(live, dtype=np.uint64)


def counted_classes(node: Repeat, size: int, unit: Unit | None) -> np.ndarray:
    """`own_classes` of a counted block (`_counted`), by its structure: state j * n + q (state q
    of the unit after j completed units) has its own language except, when the repeat is
    unbounded, the rows top - 1 and top (top = lo), whose non-start states both complete this
    unit and then read any number of units. Pure."""
    assert unit is not None
    classes = np.arange(size, dtype=np.int64)
    n = len(unit.rows)
    top = node.lo
    if node.hi is None and top >= 1:
        q = np.arange(1, n)  # NOTE: the unit's start is state 0 (`_counted` returns None otherwise)
        classes[top * n + q] = (top - 1) * n + q
        keep = np.ones(size, dtype=bool)
        keep[top * n + q] = False
        classes = (np.cumsum(keep) - 1)[classes]
    return classes


# Moore rounds on the classes whose invariants are equal (`_Builder.classes`)
LOOK_AHEAD = 3


def look_ahead(table: np.ndarray, h0: np.ndarray, states: np.ndarray, rounds: int) -> np.ndarray:
    """Per state of `states`: a hash of `h0` (a per-state invariant of the language) over every
    path of at most `rounds` bytes from it (the rounds of Moore's refinement started from `h0`),
    computed on those states' neighbourhood only. Pure."""
    near = [states]
    seen = np.zeros(table.shape[0], dtype=bool)  # NOTE: marked, not sorted: the same sorted ids as np.unique
    for _ in range(rounds):
        seen[near[-1]] = True
        seen[table[near[-1]].reshape(-1)] = True
        near.append(np.flatnonzero(seen))
    weights = seeded_weights(0x100C, table.shape[1])
    cur = h0.copy()
    for r in range(rounds - 1, -1, -1):
        q = near[r]
        cur[q] = cur[q] * np.uint64(0xFF51AFD7ED558CCD) + np.take(cur, table[q]) @ weights
    return cur[states]
