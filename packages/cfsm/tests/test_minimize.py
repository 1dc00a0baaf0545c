"""Byte classes, trimming and minimization of random DFA tables against brute-force oracles."""

from __future__ import annotations

import gc
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cfsm
import cfsm.automata.automaton
from cfsm.automata.automaton import (
    _byte_classes,
    _disjoint,
    _minimize_small,
    _runs,
    _runs_small,
    accept_distance,
    byte_segments,
    minimize,
    seeded_weights,
    unique_rows,
)
from cfsm.testing import tiny_vocab

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# the random tables use these bytes; every other byte goes to the dead state
_BYTES = (0, 1, 2, 97, 98, 200, 255)


@st.composite
def _tables(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    """A complete table (last row dead) with runs of equal columns, acceptance and a start."""
    n = draw(st.integers(1, 9))
    table = np.full((n + 1, 256), n, dtype=np.int32)
    for q in range(n):
        for b in _BYTES:
            table[q, b] = draw(st.integers(0, n))
        if draw(st.booleans()):  # a range of equal columns
            lo = draw(st.integers(3, 90))
            table[q, lo : lo + draw(st.integers(1, 5))] = draw(st.integers(0, n))
    accepting = np.array([draw(st.booleans()) for _ in range(n)] + [False])
    return table, accepting, draw(st.integers(0, n - 1))


def _language_classes(table: np.ndarray, accepting: np.ndarray) -> list[int]:
    """Plain Moore refinement over all 256 bytes: the language-equivalence class of each state."""
    n = table.shape[0]
    live = accepting.copy()
    while True:  # trimming: states that reach acceptance
        grown = live | live[table].any(axis=1)
        if (grown == live).all():
            break
        live = grown
    cls = [int(accepting[q]) if live[q] else -1 for q in range(n)]
    while True:
        sig = {q: (cls[q], tuple(cls[t] for t in table[q].tolist())) for q in range(n)}
        ids: dict[tuple[int, tuple[int, ...]], int] = {}
        new = [-1 if cls[q] == -1 else ids.setdefault(sig[q], len(ids)) for q in range(n)]
        if len(set(new)) == len(set(cls)):
            return new
        cls = new


@_SETTINGS
@given(_tables())
def test_byte_classes_group_exactly_the_equal_columns(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    full, _, _ = case
    # 256 byte columns (runs merged first) and a narrower table of the used bytes (hashed as is)
    for table in (full, np.ascontiguousarray(full[:, list(_BYTES) + list(range(3, 40))])):
        rep, cls = _byte_classes(table)
        assert len(cls) == table.shape[1] and len(set(rep.tolist())) == len(rep)
        equal_columns = (table[:, :, None] == table[:, None, :]).all(axis=0)
        assert (equal_columns == (cls[:, None] == cls[None, :])).all()
        assert (table[:, rep[cls]] == table).all()


@_SETTINGS
@given(_tables())
def test_minimize_gives_the_minimal_trimmed_dfa(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    table, accepting, start = case
    dfa = minimize(table, accepting, start)
    oracle = _language_classes(table, accepting)
    # every state maps to a minimal state accepting the same language: compare on all strings
    # of up to 4 of the used bytes
    for k in range(5):
        for word in itertools.product(_BYTES[:4], repeat=k):
            a, b = start, dfa.start
            for byte in word:
                a, b = int(table[a, byte]), int(dfa.transitions[b, byte])
            assert bool(accepting[a]) == bool(dfa.accepting[b])
            assert (oracle[a] == -1) == (b == dfa.dead)  # dead exactly where nothing is accepted
    assert dfa.num_states == len({oracle[q] for q in range(table.shape[0]) if oracle[q] != -1})
    # the byte classes cached by the minimization are those of the minimal table
    rep, cls = dfa.byte_classes
    _, exact = _byte_classes(dfa.transitions)
    assert (np.equal.outer(cls, cls) == np.equal.outer(exact, exact)).all()
    assert (cls[rep] == np.arange(len(rep))).all()
    # the class table cached by the minimization is the table's column of each class's byte
    assert np.array_equal(dfa.class_table, np.take(dfa.transitions, rep, axis=1))
    # also through a narrow table (one column per byte group), as the constructions hand it over
    used = np.unique(np.concatenate([[0], np.flatnonzero((table[:, 1:] != table[:, :-1]).any(axis=0)) + 1]))
    byte_map = np.searchsorted(used, np.arange(256), side="right") - 1
    narrow = minimize(np.ascontiguousarray(table[:, used]), accepting, start, byte_map)
    assert np.array_equal(narrow.transitions, dfa.transitions) and narrow.start == dfa.start
    assert np.array_equal(narrow.class_table, np.take(narrow.transitions, narrow.byte_classes[0], axis=1))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=_tables(), narrow=st.booleans())
def test_the_plain_python_minimization_is_the_same_dfa(case: tuple[np.ndarray, np.ndarray, int], narrow: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`_minimize_small` (small tables) gives the numpy path's `Dfa`: numbering, table, byte classes and
    their ids, dtypes."""
    table, accepting, start = case
    byte_map = None
    if narrow:  # one column per byte interval, as the subset construction hands it over
        used = np.unique(np.concatenate([[0], np.flatnonzero((table[:, 1:] != table[:, :-1]).any(axis=0)) + 1]))
        byte_map = np.searchsorted(used, np.arange(256), side="right") - 1
        table = np.ascontiguousarray(table[:, used])
    small = _minimize_small(table, accepting, start, byte_map)
    monkeypatch.setattr(cfsm.automata.automaton, "_SMALL_MINIMIZE", -1)  # the numpy path
    full = minimize(table, accepting, start, byte_map)
    assert small is not None and small.start == full.start
    assert small.known_classes is not None and full.known_classes is not None
    for a, b in ((small.transitions, full.transitions), (small.accepting, full.accepting),
                 (small.known_classes.reps, full.known_classes.reps),
                 (small.known_classes.of_byte, full.known_classes.of_byte),
                 (small.known_classes.table, full.known_classes.table)):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@_SETTINGS
@given(_tables())
def test_accept_distance_is_the_shortest_accepted_length(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    table, accepting, _ = case
    n = table.shape[0]
    dead = n - 1
    rep, _ = _byte_classes(table)
    dist = accept_distance(np.take(table, rep, axis=1), accepting, dead)
    # oracle: Bellman-Ford style relaxation over all 256 bytes, edges into dead left out as there
    best = [0 if accepting[q] else -1 for q in range(n)]
    for _ in range(n):
        for q in range(n):
            for t in set(table[q].tolist()):
                if t != dead and best[t] >= 0 and (best[q] < 0 or best[t] + 1 < best[q]):
                    best[q] = best[t] + 1
    assert dist.tolist() == best


@_SETTINGS
@given(st.lists(st.integers(0, 11), min_size=12, max_size=12), st.lists(st.booleans(), min_size=12, max_size=12))
def test_runs_count_the_live_steps_along_one_byte(step: list[int], live: list[bool]) -> None:
    n = len(step)
    runs = _runs(np.asarray(step, dtype=np.int32), np.asarray(live))
    assert _runs_small(step, live) == runs.tolist()
    for q in range(n):
        count, cur = 0, q
        while count < n and live[step[cur]]:  # a cycle of live states: capped at n
            cur = step[cur]
            count += 1
        assert runs[q] == count


@_SETTINGS
@given(st.lists(st.lists(st.integers(-3, 3), min_size=3, max_size=3), max_size=12),
       st.sampled_from([np.int64, np.uint8, np.uint64]))
def test_unique_rows_groups_exactly_the_equal_rows(rows: list[list[int]], dtype: type) -> None:
    a = np.asarray(rows, dtype=np.int64).reshape(-1, 3).astype(dtype)
    first, inverse = unique_rows(a)
    assert len(inverse) == len(a) and len(set(first.tolist())) == len(first)
    assert (inverse[first] == np.arange(len(first))).all()
    for i in range(len(a)):
        for j in range(len(a)):
            assert (inverse[i] == inverse[j]) == bool((a[i] == a[j]).all())


def test_compiles_leave_the_garbage_collector_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # a library compile must never switch off the collector of the process it runs in (a
    # server's engine loop shares that process)
    def refuse() -> None:
        raise AssertionError("cfsm called gc.disable()")

    monkeypatch.setattr(gc, "disable", refuse)
    vocab = tiny_vocab()
    cfsm.compile_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, vocab)
    cfsm.compile_regex(r"[a-z]{2,5}", vocab)
    cfsm.compile_json_object(vocab)
    assert gc.isenabled()


@_SETTINGS
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=6), st.sampled_from([0xB17E, 0x100C, 7]))
def test_seeded_weights_equal_a_fresh_draw(sizes: list[int], seed: int) -> None:
    """The per-process weights (grown on demand, sliced) are exactly a fresh draw of that size."""
    for n in sizes:
        w = seeded_weights(seed, n)
        assert not w.flags.writeable
        fresh = np.random.default_rng(seed).integers(1, 2**63, size=n, dtype=np.uint64)
        assert np.array_equal(w, fresh)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.lists(st.tuples(st.integers(0, 255), st.integers(0, 40), st.integers(0, 5)), min_size=1, max_size=12))
def test_byte_segments_split_the_ranges_by_target_set(raw: list[tuple[int, int, int]],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each segment holds exactly the targets of the ranges over its bytes, by a sweep or (few
    ranges) directly; every byte of a range is in one segment."""
    trs = sorted((lo, min(255, lo + width), t) for lo, width, t in raw)
    segments = byte_segments(trs)
    by_byte = {b: frozenset(t for lo, hi, t in trs if lo <= b <= hi) for b in range(256)}
    covered = [b for lo, hi, _ in segments for b in range(lo, hi + 1)]
    assert covered == sorted(b for b, ts in by_byte.items() if ts)  # in order, each byte once
    assert all(by_byte[b] == ts for lo, hi, ts in segments for b in range(lo, hi + 1))
    assert _disjoint(trs) == all(sum(lo <= b <= hi for lo, hi, _ in trs) <= 1 for b in range(256))
    monkeypatch.setattr(cfsm.automata.automaton, "_FEW_RANGES", 0)  # the sweep always
    assert byte_segments(trs) == segments
