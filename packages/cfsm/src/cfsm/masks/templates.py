"""JSON string states resolved from per-vocabulary tables (built once per `Vocabulary`).

The text of a JSON string (`JSON_CHAR` repeated, then the closing `"`) is the same small
automaton T in every schema; only its counter bounds (`minLength`/`maxLength`) and what follows
the closing quote differ. Per vocabulary, every token is walked through T once from each T
state: it dies, stays inside the string (after k completed characters, maybe inside a pending
escape or multi-byte character), or leaves it at a closing quote after k characters with a
suffix. Per compile, DFA states that behave exactly like T state s with `rem` characters still
allowed, `need` still required and continuation state c are recognized (`match_string_states`,
checked transition by transition), and their masks are a precomputed row (stays with at most
`rem` characters) plus the few leaving tokens whose k fits and whose suffix lives from c.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cfsm.automata.automaton import Dfa, small_unique, unique_rows
from cfsm.automata.json_automata import INF, build_t_automaton, joint_reps
from cfsm.config import IndexTuning
from cfsm.masks.rows import or_bits, pack_rows
from cfsm.masks.trie import TrieTables

__all__ = ["StringTables", "StringMatch", "build_string_tables", "match_string_states", "string_rows",
           "live_suffixes", "suffix_order", "suffix_table", "walk_t", "SuffixOrder"]

# `StringTables.stay_keys`: room for a value up to INF (rem) under each T state's key
_KEY_STRIDE = INF << 1
# verification passes (each drops the states whose successors were dropped by the previous
# one): `IndexTuning.string_passes`; past them, every proposed state is left to the generic walks
# `_verify` first checks all proposed states at once (`_all_pass`) when they times the byte
# classes are at most this many (a bound on its memory; its `one_check_max` default)
ONE_CHECK_MAX = 200_000


# a suffix table by decreasing length (`suffix_order`): per depth d the bytes at d of the suffixes
# longer than d, and each suffix's place in that order
SuffixOrder = tuple[tuple[np.ndarray, ...], np.ndarray]


@dataclass(frozen=True, eq=False)
class StringTables:
    """Per-vocabulary walks of every token through T (see the module docstring).

    Per T state s: `stay_values[s]` the sorted distinct values v = k + (1 if the token ends
    inside a character) of the tokens that stay inside, and `stay_rows[s][i]` the mask row
    (uint32 words) of those with v <= stay_values[s][i]; `exit_ids[s]`, `exit_chars[s]`,
    `exit_suffix[s]`: token id, characters before the closing quote and suffix id of the tokens
    that leave. `suffix_columns[d, j]` is byte d of suffix j (-1 past its end).
    """

    code: np.ndarray  # (num_t, 256) int64: T state, EXIT or DEAD
    text: int
    stay_values: tuple[np.ndarray, ...]
    stay_rows: tuple[np.ndarray, ...]  # (len(stay_values[s]), words) uint32 each
    exit_ids: tuple[np.ndarray, ...]
    exit_chars: tuple[np.ndarray, ...]
    exit_suffix: tuple[np.ndarray, ...]
    suffix_columns: np.ndarray  # (max suffix length + 1, num suffixes) int16

    @property
    def num_t(self) -> int:
        return int(self.code.shape[0])

    @functools.cached_property
    def suffixes_by_length(self) -> SuffixOrder:
        """`suffix_order(suffix_columns)`, kept with these tables (`live_suffixes`)."""
        return suffix_order(self.suffix_columns)

    @functools.cached_property
    def byte_class(self) -> np.ndarray:
        """T's own byte classes (bytes with equal columns in `code`), int64 per byte."""
        return unique_rows(self.code.T)[1].astype(np.int64)

    @functools.cached_property
    def inner_edges(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per T state s: (s2, the first byte from s to s2) for every T state s2 != text."""
        out = []
        for s in range(self.num_t):
            row = self.code[s]
            out.append(tuple((s2, int(np.flatnonzero(row == s2)[0])) for s2 in range(self.num_t)
                             if s2 != self.text and (row == s2).any()))
        return tuple(out)

    @functools.cached_property
    def num_classes(self) -> int:
        return int(self.byte_class.max()) + 1

    @functools.cached_property
    def target_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`_target_columns` of T's code table with one column per T class (in class order)."""
        _, first = np.unique(self.byte_class, return_index=True)
        return _target_columns(self.code[:, first], self.num_t)

    @functools.cached_property
    def stay_keys(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every T state's stay values as one sorted array of keys s * `_KEY_STRIDE` + value, the
        offset of each T state's first key, and whether each T state has exit tokens."""
        keys = np.concatenate([s * _KEY_STRIDE + v for s, v in enumerate(self.stay_values)]).astype(np.int64)
        sizes = np.array([len(v) for v in self.stay_values], dtype=np.int64)
        has_exit = np.array([len(e) > 0 for e in self.exit_ids], dtype=bool)
        return keys, np.cumsum(sizes) - sizes, has_exit

    @functools.cached_property
    def text_bytes(self) -> tuple[np.ndarray, int, np.ndarray]:
        """(the bytes that keep the text state in itself, the closing quote, 6 of those bytes
        spread over them: `match_string_states`' probe)."""
        group = np.flatnonzero(self.code[self.text] == self.text)
        quote = int(np.flatnonzero(self.code[self.text] == self.num_t)[0])
        sample = group[np.linspace(0, len(group) - 1, 6).astype(np.int64)] if len(group) else group
        return group, quote, sample

    @property
    def nbytes(self) -> int:
        return int(sum(r.nbytes for r in self.stay_rows) + self.suffix_columns.nbytes)


def walk_t(code: np.ndarray, text: int, s: int, tables: TrieTables
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every token from T state s: (positions that stay, their v), (positions that leave, their
    characters before the quote, the byte index of the quote)."""
    num_t = code.shape[0]
    exit_code = num_t
    n = len(tables.order)
    idx = np.arange(n, dtype=np.int64)
    cur = np.full(n, s, dtype=np.int64)
    k = np.zeros(n, dtype=np.int64)
    stay_pos, stay_v, exit_pos, exit_k, exit_at = [], [], [], [], []
    d = 0
    while idx.size:
        b = tables.columns[d].take(idx)
        end = b < 0
        if end.any():
            stay_pos.append(idx[end])
            stay_v.append(k[end] + (cur[end] != text))
            keep = ~end
            idx, cur, k, b = idx[keep], cur[keep], k[keep], b[keep]
        nxt = code[cur, b]
        out = nxt == exit_code
        if out.any():
            exit_pos.append(idx[out])
            exit_k.append(k[out])
            exit_at.append(np.full(int(out.sum()), d, dtype=np.int64))
        keep = nxt < exit_code
        idx, cur, k = idx[keep], nxt[keep], k[keep] + (nxt[keep] == text)
        d += 1

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    return cat(stay_pos), cat(stay_v), cat(exit_pos), cat(exit_k), cat(exit_at)


def build_string_tables(tables: TrieTables, words: int) -> StringTables:
    """Walk the vocabulary through T from every T state (once per vocabulary)."""
    code, text = build_t_automaton()
    suffix_id: dict[bytes, int] = {}
    stay_values, stay_rows, exit_ids, exit_chars, exit_suffix = [], [], [], [], []
    for s in range(code.shape[0]):
        pos, v, epos, ek, eat = walk_t(code, text, s, tables)
        order = np.argsort(v, kind="stable")
        pos, v = pos[order], v[order]
        values, starts = np.unique(v, return_index=True)
        rows = np.zeros((len(values), words), dtype=np.uint32)
        row = np.zeros(words, dtype=np.uint32)
        bounds = np.append(starts, len(v))
        for i in range(len(values)):
            tids = tables.order[pos[bounds[i] : bounds[i + 1]]]
            or_bits(row, tids)
            rows[i] = row
        stay_values.append(values.astype(np.int64))
        stay_rows.append(rows)
        sufs = [tables.sorted_tokens[p][a + 1 :] for p, a in zip(epos.tolist(), eat.tolist(), strict=True)]
        exit_ids.append(tables.order[epos].astype(np.int64))
        exit_chars.append(ek.astype(np.int64))
        exit_suffix.append(np.array([suffix_id.setdefault(x, len(suffix_id)) for x in sufs], dtype=np.int64))
    return StringTables(code=code, text=text, stay_values=tuple(stay_values), stay_rows=tuple(stay_rows),
                        exit_ids=tuple(exit_ids), exit_chars=tuple(exit_chars),
                        exit_suffix=tuple(exit_suffix), suffix_columns=suffix_table(list(suffix_id)))


def suffix_table(suffixes: list[bytes]) -> np.ndarray:
    """Suffixes as byte columns: `cols[d, j]` is byte d of suffix j (-1 past its end)."""
    max_len = max((len(x) for x in suffixes), default=0)
    cols = np.full((max_len + 1, len(suffixes)), -1, dtype=np.int16)
    for j, x in enumerate(suffixes):
        cols[: len(x), j] = np.frombuffer(x, dtype=np.uint8)
    return cols


def suffix_order(cols: np.ndarray) -> SuffixOrder:
    """The suffixes of `cols` by decreasing length (stable): per depth d, the bytes at d of the
    suffixes longer than d (a prefix of that order, int64), and each suffix's place in the order.
    Pure: the per-vocabulary tables keep theirs (`StringTables.suffixes_by_length`,
    `FragmentTable.suffixes_by_length`)."""
    lengths = (cols >= 0).sum(axis=0)
    order = np.argsort(-lengths, kind="stable")
    by_depth = tuple(cols[d, order[: int((lengths > d).sum())]].astype(np.int64) for d in range(cols.shape[0]))
    place = np.empty(len(order), dtype=np.int64)
    place[order] = np.arange(len(order))
    return by_depth, place


def live_suffixes(dfa: Dfa, conts: np.ndarray, cols: np.ndarray, by_length: SuffixOrder | None = None) -> np.ndarray:
    """(len(conts), num suffixes) bool: whether suffix j (`suffix_table` columns) walked from
    state conts[i] stays alive; all (continuation, suffix) pairs walked as one 2-D array, a
    column frozen once its suffix has ended (-1 bytes are only past a suffix's end).
    `by_length`: `suffix_order(cols)` (the per-vocabulary tables keep theirs; computed when None).

    # NOTE: the suffixes walked by decreasing length, so the ones still going at each depth are
    # a leading slice of the columns (no gather and scatter per byte)
    """
    num_suf = cols.shape[1]
    if not num_suf or not len(conts):
        return np.zeros((len(conts), num_suf), dtype=bool)
    by_depth, place = by_length if by_length is not None else suffix_order(cols)
    cur = np.repeat(conts.astype(np.int64)[:, None], num_suf, axis=1)
    tflat = dfa.transitions.reshape(-1)
    for b in by_depth:
        m = len(b)
        if not m:
            break
        head = cur[:, :m]
        head *= 256
        head += b
        cur[:, :m] = tflat.take(head)
    return np.take(cur != dfa.dead, place, axis=1)


@dataclass(frozen=True, eq=False)
class StringMatch:
    """DFA states recognized as T states: per DFA state (num_states + 1 entries) the T state
    (-1: not one), `rem` (characters still allowed, `INF` if unbounded), `need` (still
    required) and `cont` (the state after the closing quote)."""

    t: np.ndarray
    rem: np.ndarray
    need: np.ndarray
    cont: np.ndarray


def _chain_ends(a: np.ndarray, terminal: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each i: the first terminal index on i, a[i], a[a[i]], ... (-1 if none, or if the chain
    reaches len(a), "not a candidate"), and the steps to it. Pointer jumping: log2 rounds."""
    m = len(a)
    term = np.append(terminal, True)
    jump = np.where(term, np.arange(m + 1), np.append(a, m))
    dist = np.where(term, 0, 1).astype(np.int64)
    for _ in range(int(m).bit_length() + 1):
        dist = dist + dist[jump]
        jump = jump[jump]
    end = np.where(term[jump] & (jump < m), jump, -1)
    return end[:m], dist[:m]


def match_string_states(dfa: Dfa, st: StringTables, max_passes: int = IndexTuning.string_passes) -> StringMatch:
    """Recognize the DFA states that behave exactly like a T state (pure); `max_passes`:
    verification passes (`IndexTuning.string_passes`).

    Proposes (T state, rem, need, cont) from the text states' chains, then drops every state
    whose transitions do not all agree with T until the rest is closed: so each kept state's
    language is exactly T's from its T state, with those bounds, followed by cont's language.
    """
    trans = dfa.transitions
    n = dfa.num_states
    dead = dfa.dead
    text = st.text
    group, quote, sample = st.text_bytes
    t = np.full(n + 1, -1, dtype=np.int64)
    rem = np.zeros(n + 1, dtype=np.int64)
    need = np.zeros(n + 1, dtype=np.int64)
    cont = np.full(n + 1, dead, dtype=np.int64)
    if n == 0 or not len(group):
        return StringMatch(t, rem, need, cont)
    g0 = trans[:n, group[0]].astype(np.int64)
    # NOTE: without a state that reads a character of the group (all alike) there is no string
    # text with a character left, so nothing worth the tables (a state allowing only a closing
    # quote is left to the generic walks): a few group bytes tell most grammars apart at once
    live = g0 != dead
    probe = np.flatnonzero(live)
    probe = probe[(np.take(trans[probe], sample, axis=1) == g0[probe, None]).all(axis=1)]
    if not len(probe):
        return StringMatch(t, rem, need, cont)
    # only the probed states and those whose group is dead (at most length: rem = 0) can qualify
    rows = ~live
    rows[probe] = True
    # NOTE: states the DFA's construction proved to be string text come with their match
    # (`direct`); where no other state is a candidate, that is the whole match (the proposal
    # below would give them the same values and mark nothing else)
    proven_text = None if dfa.facts is None else dfa.facts.string_text
    if proven_text is not None:
        proven, values = proven_text
        others = _candidates(dfa, g0, group, rows & ~proven[:n])
        # NOTE: a candidate that reads the closing quote and nothing else is T's text state with
        # nothing left (rem = need = 0), followed by the quote's target: the chains and the checks
        # below say just that
        live_count = (trans[others] != dead).sum(axis=1)
        after = trans[others, quote].astype(np.int64)
        closing = (live_count == 1) & (after != dead)
        if closing.all():
            mine = np.flatnonzero(proven)
            t[mine], rem[mine], need[mine], cont[mine] = values[:, mine]
            t[others], rem[others], need[others], cont[others] = text, 0, 0, after
            return StringMatch(t, rem, need, cont)
    qs = _candidates(dfa, g0, group, rows)
    if not len(qs):
        return StringMatch(t, rem, need, cont)
    # chains among the candidates: a[i] is the index (in qs) of the state after one character
    pos_of = np.full(n + 1, len(qs), dtype=np.int64)
    pos_of[qs] = np.arange(len(qs))
    nxt = g0[qs]
    a = pos_of[nxt]
    x = trans[qs, quote].astype(np.int64)
    # rem: characters until the group leads to the dead state (INF at a self-loop)
    dead_next, loop = nxt == dead, nxt == qs
    end, dist = _chain_ends(a, dead_next | loop)
    r = np.where(end >= 0, np.where(loop[end], INF, np.minimum(dist, INF)), -1)
    # need: characters until the closing quote is open; cont: the quote's target there
    end, dist = _chain_ends(a, x != dead)
    nd = np.where(end >= 0, dist, -1)
    c = np.where(end >= 0, x[end], -1)
    ok = (r >= 0) & (nd >= 0) & (c >= 0)
    qs, r, nd, c = qs[ok], r[ok], nd[ok], c[ok]
    t[qs], rem[qs], need[qs], cont[qs] = text, r, nd, c
    # pending characters: follow T's edges between non-text states from the text states
    frontier = [(text, qs[r >= 1])]
    edges = st.inner_edges
    while frontier:
        s, src = frontier.pop()
        if not len(src):
            continue
        for s2, b in edges[s]:
            dst = trans[src, b].astype(np.int64)
            live = (dst != dead) & (t[dst] < 0)
            src2, dst = src[live], dst[live]
            t[dst], rem[dst], need[dst], cont[dst] = s2, rem[src2], need[src2], cont[src2]
            frontier.append((s2, dst))
    _verify(dfa, st, t, rem, need, cont, max_passes)
    return StringMatch(t, rem, need, cont)


def _candidates(dfa: Dfa, g0: np.ndarray, group: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The states of `rows` (a bool mask) whose group bytes (`group`: T's text bytes, all alike)
    all lead to one state, `g0` (the first's target), and that do not accept. Pure."""
    _, byte_class = dfa.byte_classes  # bytes of one class step alike: one column per class
    at = np.flatnonzero(rows)
    cand = np.zeros(dfa.num_states, dtype=bool)
    classes = np.zeros(dfa.class_table.shape[1], dtype=bool)  # the group's classes, ascending (np.unique without a sort)
    classes[byte_class[group]] = True
    cand[at] = (np.take(dfa.class_table[at], np.flatnonzero(classes), axis=1) == g0[at, None]).all(axis=1)
    cand &= ~dfa.accepting[: dfa.num_states]
    return np.flatnonzero(cand)


def _verify(dfa: Dfa, st: StringTables, t: np.ndarray, rem: np.ndarray, need: np.ndarray, cont: np.ndarray,
            max_passes: int = IndexTuning.string_passes, one_check_max: int = ONE_CHECK_MAX) -> None:
    """Unmark (t = -1) proposed states until every marked one steps exactly like its T state."""
    dead = dfa.dead
    code, text, num_t = st.code, st.text, st.num_t
    exit_code, dead_code = num_t, num_t + 1
    # bytes that step alike in the DFA and in T: one representative each
    _, byte_class = dfa.byte_classes
    reps = joint_reps(byte_class, st.byte_class)
    tcode = code[:, reps]  # (num_t, r)
    t[dead] = -1
    # NOTE: states the DFA's construction proved to be string text (`direct`: a JSON string body
    # followed by its closing quote; their proposed bounds follow from that) are not checked;
    # they still serve as the targets of the others' checks
    proven = None if dfa.facts is None or dfa.facts.string_text is None else dfa.facts.string_text[0]
    check = t >= 0 if proven is None else (t >= 0) & ~proven
    # (n + 1, r): one byte per class; only the rows of the states to check are read
    if proven is None:
        table = np.take(dfa.class_table, byte_class[reps], axis=1)
    else:
        rows = np.flatnonzero(check)
        table = np.zeros((dfa.num_states + 1, len(reps)), dtype=dfa.class_table.dtype)
        table[rows] = np.take(dfa.class_table[rows], byte_class[reps], axis=1)
    # NOTE: usually every proposed state passes: one check of all of them at once says so (the
    # passes below would then unmark nothing; they cost a few numpy calls per T state, which
    # dominate for few states); otherwise they run as they always did
    if max_passes and int(check.sum()) * tcode.shape[1] <= one_check_max and _all_pass(
            dfa, st, tcode, table, t, rem, need, cont, st.byte_class[reps], check):
        return
    for _ in range(max_passes):
        bad_any = False
        for s in range(num_t):
            q = np.flatnonzero((t == s) if proven is None else (t == s) & ~proven)
            if not len(q):
                continue
            row = tcode[s]
            tgt = table[q].astype(np.int64)  # (m, r)
            nd, c = need[q][:, None], cont[q][:, None]
            bad = dfa.accepting[q] | (rem[q] < (0 if s == text else 1))
            dead_b = row == dead_code
            bad |= (tgt[:, dead_b] != dead).any(axis=1)
            ex = row == exit_code
            if ex.any():
                want = np.where(nd == 0, c, dead)
                bad |= (tgt[:, ex] != want).any(axis=1) | ((nd[:, 0] == 0) & (c[:, 0] == dead))
            closed = rem[q] == 0  # no character may start or complete
            r1, nd1, c1 = rem[q], need[q], cont[q]
            for s2 in np.unique(row[row < num_t]).tolist():
                # NOTE: the columns of one T target must all step to one DFA state: compare them
                # with the first, then check that state alone
                sub = tgt[:, row == s2]
                tg = sub[:, 0]
                if sub.shape[1] > 1:
                    bad |= (sub != tg[:, None]).any(axis=1)
                if s2 == text:
                    r2, n2 = np.where(r1 >= INF, INF, r1 - 1), np.maximum(nd1 - 1, 0)
                else:
                    r2, n2 = r1, nd1
                ok = (t[tg] == s2) & (rem[tg] == r2) & (need[tg] == n2) & (cont[tg] == c1)
                bad |= ~np.where(closed, tg == dead, ok)
            if bad.any():
                t[q[bad]] = -1
                bad_any = True
        if not bad_any:
            return
    t[:] = -1


def _all_pass(dfa: Dfa, st: StringTables, tcode: np.ndarray, table: np.ndarray, t: np.ndarray, rem: np.ndarray,
              need: np.ndarray, cont: np.ndarray, tclass: np.ndarray, check: np.ndarray) -> bool:
    """Whether every marked state of `check` passes `_verify`'s checks (all T states at once). Pure.

    `tclass[j]` is T's byte class of column j. Every check asks the columns of one T class to step
    to one DFA state (T steps alike on them): that is checked first for all columns, then the
    checks run on one column per T class.
    """
    dead = dfa.dead
    text, num_t = st.text, st.num_t
    exit_code, dead_code = num_t, num_t + 1
    q = np.flatnonzero(check)
    if not len(q):
        return True
    tgt = table[q]  # (m, r)
    _, first_of, back = np.unique(tclass, return_index=True, return_inverse=True)
    if not np.array_equal(tgt, np.take(tgt, first_of[back.reshape(-1)], axis=1)):
        return False
    tgt = np.take(tgt, first_of, axis=1)  # (m, r'): one column per T class
    tcode = tcode[:, first_of]
    r_all = tcode.shape[1]
    s = t[q]
    r1, nd1, c1 = rem[q], need[q], cont[q]
    if (dfa.accepting[q] | (r1 < np.where(s == text, 0, 1))).any():
        return False
    row = tcode[s]  # (m, r')
    if ((row == dead_code) & (tgt != dead)).any():
        return False
    ex = row == exit_code
    want = np.where(nd1 == 0, c1, dead)
    if (ex & (tgt != want[:, None])).any() or (ex.any(axis=1) & (nd1 == 0) & (c1 == dead)).any():
        return False
    # NOTE: with every T class present (JSON grammars) the tables are the vocabulary's, prepared
    if r_all == st.num_classes:
        inner, first_col, col_k, s2_k = st.target_columns
    else:
        inner, first_col, col_k, s2_k = _target_columns(tcode, num_t)
    base = (np.arange(len(q)) * r_all)[:, None]
    flat = tgt.reshape(-1)
    if (inner[s] & (tgt != flat.take(base + first_col[s]))).any():
        return False
    tg = flat.take(base + col_k[s]).astype(np.int64)  # (m, k)
    s2 = s2_k[s]
    is_text = s2 == text
    r2 = np.where(is_text, np.where(r1 >= INF, INF, r1 - 1)[:, None], r1[:, None])
    n2 = np.where(is_text, np.maximum(nd1 - 1, 0)[:, None], nd1[:, None])
    ok = (t[tg] == s2) & (rem[tg] == r2) & (need[tg] == n2) & (cont[tg] == c1[:, None])
    closed = (r1 == 0)[:, None]
    return not ((s2 >= 0) & ~np.where(closed, tg == dead, ok)).any()


def _target_columns(tcode: np.ndarray, num_t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For `_all_pass`, per T state of the code table `tcode` (one column per T class present):
    which columns lead to a T state, the first column of each column's target, and for each
    target one column and the target (K per T state, padded with a repeat of the last). Pure."""
    r_all = tcode.shape[1]
    inner = tcode < num_t
    first_col = np.tile(np.arange(r_all), (num_t, 1))
    pairs: list[list[tuple[int, int]]] = []
    for x in range(num_t):
        seen: dict[int, int] = {}
        for j in np.flatnonzero(inner[x]).tolist():
            first_col[x, j] = seen.setdefault(int(tcode[x, j]), j)
        pairs.append(list(seen.items()))
    k = max(1, max(len(p) for p in pairs))
    col_k = np.zeros((num_t, k), dtype=np.int64)
    s2_k = np.full((num_t, k), -1, dtype=np.int64)
    for x, p in enumerate(pairs):
        for i in range(k):
            if p:
                s2, j = p[min(i, len(p) - 1)]
                col_k[x, i], s2_k[x, i] = j, s2
    return inner, first_col, col_k, s2_k


def _by_state_and_cut(s_all: np.ndarray, cut_all: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`unique_rows` of the rows (T state as 8 big-endian bytes, cut as 8 native bytes): the
    groups in that byte order (T state, then cut's bytes from the lowest; -1 last), each group's
    first state and every state's group.

    # NOTE: for cuts below 2^16 (all practical ones) as one int64 key per state, whose numeric order
    # is that byte order (a plain sort instead of one of byte strings); otherwise the byte rows
    """
    if len(cut_all) and int(cut_all.max()) < 1 << 16 and np.little_endian:
        c = cut_all.astype(np.int64)
        low = np.where(c < 0, 1 << 16, ((c & 0xFF) << 8) | (c >> 8))
        first, inverse = np.unique((s_all.astype(np.int64) << 17) | low, return_index=True, return_inverse=True)[1:]
        return first, inverse.reshape(-1)
    key = np.hstack([s_all.astype(">i8")[:, None].view(np.uint8), cut_all.astype(np.int64)[:, None].view(np.uint8)])
    return unique_rows(key)


def string_rows(dfa: Dfa, st: StringTables, m: StringMatch, intern: Callable[[np.ndarray], int],
                mask_row: np.ndarray) -> None:
    """Mask rows of the matched states (written into `mask_row`); equal rows interned once."""
    cont = m.cont
    states = np.flatnonzero(m.t[: dfa.num_states] >= 0)
    if not len(states):
        return
    # which suffixes live from each continuation: one walk of all (continuation, suffix) pairs
    conts, c_idx = small_unique(cont[states])  # sorted distinct continuations, each state's index into them
    live = live_suffixes(dfa, conts, st.suffix_columns, st.suffixes_by_length)
    ts = m.t[states]
    words = st.stay_rows[0].shape[1]
    zero = np.zeros(words, dtype=np.uint32)
    # each state's stay row: the longest prefix of its T state's values within rem (-1: none),
    # found for all states at once in the concatenated (T state, value) keys
    keys, offsets, has_exit = st.stay_keys
    at = np.searchsorted(keys, ts * _KEY_STRIDE + np.minimum(m.rem[states], INF), side="right") - 1
    cut = np.where(at >= offsets[ts], at - offsets[ts], -1)
    # T states without exit tokens: the row is the stay row, one per distinct (T state, cut),
    # interned in T state order around those with exit tokens (as one walk over T states would)
    plain = ~has_exit[ts]
    exits = np.unique(ts[~plain])
    seg = np.searchsorted(exits, ts)  # plain states: how many exit T states come before
    for g in range(len(exits) + 1):
        sel = np.flatnonzero(plain & (seg == g)) if len(exits) else np.flatnonzero(plain)
        if len(sel):
            s_all, cut_all = ts[sel], cut[sel]
            first, inverse = _by_state_and_cut(s_all, cut_all)
            rows = np.array([intern(st.stay_rows[x][k] if k >= 0 else zero)
                             for x, k in zip(s_all[first].tolist(), cut_all[first].tolist(), strict=True)], dtype=np.int32)
            mask_row[states[sel]] = rows[inverse]
        if g == len(exits):
            break
        x = int(exits[g])
        sel = np.flatnonzero(ts == x)
        qs = states[sel]
        rem, need = m.rem[qs], m.need[qs]
        eids, ek, esuf = st.exit_ids[x], st.exit_chars[x], st.exit_suffix[x]
        allowed = (ek[None, :] >= need[:, None]) & (ek[None, :] <= rem[:, None]) & live[c_idx[sel][:, None], esuf[None, :]]
        key = np.hstack([cut[sel].astype(np.int64)[:, None].view(np.uint8), np.packbits(allowed, axis=1)])
        first, inverse = unique_rows(key)
        # each group's row: its stay row (zero without one) plus its allowed exit tokens
        pair_g, pair_e = np.nonzero(allowed[first])
        rows = pack_rows(len(first), pair_g, eids[pair_e].astype(np.int64), words, intern, st.stay_rows[x],
                         cut[sel][first])
        mask_row[qs] = rows[inverse]
