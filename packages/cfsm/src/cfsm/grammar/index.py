"""`GrammarIndex`: token masks of a `Pda` over one vocabulary, with caches of what needs no context.

A parser configuration is a set of stacks (tuples of states, top last) closed under calls and
returns (`_close`); configurations are interned as ids (0: the empty, dead one) and stepped by
bytes through a lazily filled table `(id, byte) -> id`, so advancing a token is a few lookups.

Masks follow xgrammar's split. The tokens allowed by a stack depend only on its top few frames:
for a key (the top m frames of a stack), a walk of the vocabulary (vectorized over the sorted
tokens, one byte column per step) from the key's configuration sorts tokens into accepted
(consumed without returning below the key), rejected, and uncertain (they return below the key
with bytes left). Keys of one frame are walked at compile time over the whole vocabulary; an
uncertain token is settled by the key one frame deeper, which walks only the tokens still
uncertain (few: a closing quote and what may follow it), on first use. A stack's mask is the
row of its shortest key with nothing uncertain (at the bottom of the stack, uncertain tokens are
rejected: nothing follows the start rule). A configuration's mask is the union of its stacks'
rows, plus EOS where the start rule may end; it is cached per configuration id.

States of the network that no byte string tells apart (`walk_representatives`: same bytes to
states alike, same calls with returns alike, same end and FOLLOW set) walk the vocabulary alike
from any stack: their one-frame keys and their settlements are one walk.

Not thread-safe: guides fill the caches as they go (one engine thread).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cfsm.errors import Approximation, GrammarError
from cfsm.grammar.pda import Pda
from cfsm.masks.state_classes import refine_classes
from cfsm.masks.vocab import Vocabulary

__all__ = ["GrammarIndex", "MAX_FORCED_BYTES", "MAX_SETTLEMENTS", "MAX_STACKS"]

MAX_FORCED_BYTES = 256  # longest forced string one jump-forward looks at
_SCALAR_WALK = 64  # token walks of at most this many tokens go one token at a time
_CHAIN_DERIVE = True  # counted-chain keys derived without walks where `_chain_escapes` allows (tests switch it off)
_LOOP_CUT = True  # trie walks accept a subtree whole where its bytes all loop the configuration (tests switch it off)
_TAIL_NODES = 16  # trie walks with at most this many prefixes left go on node by node (tests change it)
# escapes before the first byte of more than 1/_FIRST_BY_COLUMN of the vocabulary are read off
# the first byte column (`_first_escapes`), fewer sorted (tests change it to take either path)
_FIRST_BY_COLUMN = 16
_FEW_BYTES = 24  # configurations stepped by at most this many bytes at once are grouped in Python
_FEW_BITS = 8  # rows of at most this many tokens are set in Python (`_bits`)
_COARSEST_STATES = 128  # networks of at most this many states: walk representatives by whole Moore rounds
_WHOLE_ROW = 0.75  # keys of a batched walk that accept at least this share of the tokens: rows from their gaps
_BOOL_ROWS = 1 << 20  # batched key rows of at most this many words are set as bools, then packed
# escape sets settled at compile time, at most (and at most twice the one-frame keys that have
# escapes, plus 256: grammars whose escape sets keep shifting settle the rest on first use)
MAX_SETTLEMENTS = 4096
MAX_STACKS = 4096  # parses alive at once in one configuration (ambiguous grammars multiply them)
_UNKNOWN = -2
_HASH_WEIGHTS = np.random.default_rng(0x5EED).integers(1, 2**63, size=MAX_STACKS + 1, dtype=np.uint64) | np.uint64(1)
Stack = tuple[int, ...]


class _TooAmbiguous(Exception):
    """A configuration passed `MAX_STACKS` stacks (internal)."""


@dataclass(frozen=True, eq=False)
class _KeyInfo:
    row: np.ndarray  # (words,) uint32: tokens accepted by the key (and by every shorter one)
    uncertain: np.ndarray  # sorted token ranks (indices into `TrieTables.by_length`) still uncertain
    late: np.ndarray  # (len(uncertain),) bool: it returned below the key after reading a byte
    # the escapes of the uncertain tokens, sorted by (rank, offset): token `esc_rank[i]` may
    # return below the key before its byte `esc_at[i]` (every such offset is listed)
    esc_rank: np.ndarray
    esc_at: np.ndarray
    digest: bytes  # of the escape pairs (equal pairs: equal settlement by any frame below)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


_NO_RANKS = _frozen(np.zeros(0, dtype=np.int64))
_NO_OFFSETS = _frozen(np.zeros(0, dtype=np.int32))
_NO_FLAGS = _frozen(np.zeros(0, dtype=bool))


def _digest(esc_rank: np.ndarray, esc_at: np.ndarray) -> bytes:
    """16 bytes of SHA-256 over the rank bytes, "|", the offset bytes (contiguous int64 / int32
    arrays: hashed in place; 1024 pairs or more as int32 and uint16 with "#" where they fit). NOTE:
    SHA-256 runs on the CPU's SHA instructions here, about twice as fast as BLAKE2b over the ~32k
    escape pairs of a key that a space may leave; few pairs are joined first (one update: less
    call overhead). Equal pairs, equal digest (one encoding per length and value range)."""
    if len(esc_rank) < 1024:
        return hashlib.sha256(esc_rank.tobytes() + b"|" + esc_at.tobytes()).digest()[:16]
    if int(esc_rank.max()) < 1 << 31 and int(esc_at.max()) < 1 << 16:
        # NOTE: many pairs (~32k below a number's end): hashed as int32 ranks and uint16 offsets
        # (half the bytes; "#" apart from the wide form, which arrays of other values take)
        h = hashlib.sha256(esc_rank.astype(np.int32).data)
        h.update(b"#")
        h.update(esc_at.astype(np.uint16).data)
        return h.digest()[:16]
    h = hashlib.sha256(esc_rank.data)
    h.update(b"|")
    h.update(esc_at.data)
    return h.digest()[:16]


_NO_ESCAPES = _digest(_NO_RANKS, _NO_OFFSETS)


def _sorted_pairs(esc_rank: np.ndarray, esc_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Escape pairs sorted by (rank, offset): (int64 ranks, int32 offsets). Pure.

    NOTE: one sort of rank * 2**16 + offset (offsets are byte positions inside a token), several
    times faster than a lexsort of the two columns."""
    if len(esc_at) and int(esc_at.max()) >= 1 << 16:  # NOTE: never for real tokens; kept exact anyway
        order = np.lexsort((esc_at, esc_rank))
        return (np.ascontiguousarray(esc_rank[order], dtype=np.int64),
                np.ascontiguousarray(esc_at[order], dtype=np.int32))
    pairs = np.sort(esc_rank.astype(np.int64) << 16 | esc_at.astype(np.int64))
    return pairs >> 16, (pairs & 0xFFFF).astype(np.int32)


def _info(row: np.ndarray, esc_rank: np.ndarray, esc_at: np.ndarray, presorted: bool = False) -> _KeyInfo:
    """A key's info from its row and escape pairs (sorted here unless `presorted`: by (rank,
    offset), int64 ranks and int32 offsets); uncertain and late follow."""
    if not len(esc_rank):
        return _KeyInfo(row, _NO_RANKS, _NO_FLAGS, _NO_RANKS, _NO_OFFSETS, _NO_ESCAPES)
    if presorted:
        esc_rank = np.ascontiguousarray(esc_rank, dtype=np.int64)
        esc_at = np.ascontiguousarray(esc_at, dtype=np.int32)
    else:
        esc_rank, esc_at = _sorted_pairs(esc_rank, esc_at)
    new = np.empty(len(esc_rank), dtype=bool)
    new[0] = True
    np.not_equal(esc_rank[1:], esc_rank[:-1], out=new[1:])
    first = np.flatnonzero(new)
    uncertain = esc_rank[first]
    # NOTE: offsets are sorted per token: its last pair has its largest offset
    last = np.empty(len(first), dtype=np.int64)
    last[:-1] = first[1:] - 1
    last[-1] = len(esc_rank) - 1
    late = esc_at.take(last) > 0
    return _KeyInfo(row, uncertain, late, esc_rank, esc_at, _digest(esc_rank, esc_at))


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Per value: whether it is in `sorted_set` (ascending). Pure."""
    if not len(sorted_set) or not len(values):
        return np.zeros(len(values), dtype=bool)
    at = np.searchsorted(sorted_set, values)
    at[at == len(sorted_set)] = 0
    return sorted_set.take(at) == values  # type: ignore[no-any-return]


def _sorted_distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values of an ascending array. Pure."""
    if len(values) < 2:
        return values
    keep = np.empty(len(values), dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


class GrammarIndex:
    """A compiled context-free grammar over one vocabulary; shared by every `GrammarGuide` made
    from it (read-only contract to users; its caches fill as guides use it).

    `start` is the initial configuration id; `dead` (0) the empty one.
    """

    dead = 0

    def __init__(self, pda: Pda, vocab: Vocabulary, grammar: str = "",
                 approximations: tuple[Approximation, ...] = (), *, precompute: bool = True,
                 reps: np.ndarray | None = None) -> None:
        self.pda = pda
        self.vocab = vocab
        self.grammar = grammar
        self.approximations = approximations
        self._acc: list[bool] = pda.accepting.tolist()
        self._has_bytes: list[bool] = pda.has_bytes.tolist()
        self._states: list[frozenset[Stack]] = [frozenset()]
        self._ids: dict[frozenset[Stack], int] = {frozenset(): 0}
        self._table = np.full((64, 256), _UNKNOWN, dtype=np.int32)  # (capacity, 256)
        self._table[0] = 0
        self._end = np.zeros(64, dtype=bool)  # (capacity,) a stack of one frame may end its rule
        # (capacity, 256) the bytes that may follow those rule ends (their rules' FOLLOW sets)
        self._after_end = np.zeros((64, 256), dtype=bool)
        # (capacity,) per configuration: its loop bytes are known (`_loop_flags`), it has some;
        # (capacity, 4) uint64 the bytes that step it to itself with no escape, as 256 bits
        self._loop_known = np.zeros(64, dtype=bool)
        self._has_loop = np.zeros(64, dtype=bool)
        self._loop = np.zeros((64, 4), dtype=np.uint64)
        try:
            self._follow = _follow_sets(pda, self._close)
        except _TooAmbiguous:
            raise GrammarError(f"the grammar is too ambiguous: a rule's start expands to more than {MAX_STACKS} "
                               "parses") from None
        # state -> the state whose walks it shares (`walk_representatives`)
        if reps is None:
            # NOTE: where `_byte_lead` (a cached property) keeps its table, computed once for both
            leads = self.__dict__["_byte_lead"] = _byte_leads(pda.trans)
            reps = walk_representatives(pda, self._follow, leads)
        self._rep: list[int] = reps.tolist()
        self._keys: dict[Stack, _KeyInfo] = {}
        # (return state, digest of escape pairs) -> the settlement of those escapes by that frame
        self._settled: dict[tuple[int, bytes], _KeyInfo] = {}
        self._rows: list[np.ndarray] = []
        self._row_ids: dict[bytes, int] = {}
        self._state_row: dict[int, int] = {}
        self._forced: dict[int, bytes] = {}
        self._runs: dict[bytes, np.ndarray] = {}
        self._runs_sorted: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._trans_rows: dict[int, list[int]] = {}  # state -> its row of `pda.trans` (`_trans_row`)
        self._closed: dict[tuple[Stack, ...], int] = {}  # stacks -> the id of their closure (`_config_of`)
        # id of a rank array -> (that array, its `_bits`): rows of the escapes before a first byte
        # (`_first_escapes`), which settlements of those escapes read again (`_settle_many`)
        self._rank_rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.start = self._intern(self._close([pda.start_stack]))
        self.num_overflows = 0  # configurations refused for passing MAX_STACKS (after the compile)
        self._compiling = False
        self.max_settlements = MAX_SETTLEMENTS
        if precompute:
            self.precompute()

    # --- configurations ----------------------------------------------------------------------------
    def _close(self, stacks: Any) -> frozenset[Stack]:
        """The stacks reachable by calls and returns without reading a byte, keeping those whose
        top reads a byte or ends the start rule."""
        calls, starts, acc, has_bytes = self.pda.calls, self.pda.rule_start, self._acc, self._has_bytes
        seen = set(stacks)
        work = list(seen)
        out = []
        while work:
            if len(seen) > MAX_STACKS:
                raise _TooAmbiguous
            st = work.pop()
            top = st[-1]
            if has_bytes[top] or (len(st) == 1 and acc[top]):
                out.append(st)
            for rule, ret in calls[top]:
                nst = (*st[:-1], ret, starts[rule])
                if nst not in seen:
                    seen.add(nst)
                    work.append(nst)
            if acc[top] and len(st) > 1:
                nst = st[:-1]
                if nst not in seen:
                    seen.add(nst)
                    work.append(nst)
        return frozenset(out)

    def _intern(self, config: frozenset[Stack]) -> int:
        sid = self._ids.get(config)
        if sid is not None:
            return sid
        sid = len(self._states)
        self._ids[config] = sid
        self._states.append(config)
        if sid >= len(self._end):
            grow = len(self._end)
            self._table = np.concatenate([self._table, np.full((grow, 256), _UNKNOWN, dtype=np.int32)])
            self._end = np.concatenate([self._end, np.zeros(grow, dtype=bool)])
            self._after_end = np.concatenate([self._after_end, np.zeros((grow, 256), dtype=bool)])
            self._loop_known = np.concatenate([self._loop_known, np.zeros(grow, dtype=bool)])
            self._has_loop = np.concatenate([self._has_loop, np.zeros(grow, dtype=bool)])
            self._loop = np.concatenate([self._loop, np.zeros((grow, 4), dtype=np.uint64)])
        acc = self._acc
        ends = {int(self.pda.state_rule[st[-1]]) for st in config if len(st) == 1 and acc[st[-1]]}
        self._end[sid] = bool(ends)
        for rule in ends:
            self._after_end[sid] |= self._follow[rule]
        return sid

    def _config_of(self, stacks: tuple[Stack, ...]) -> int:
        """The id of the closure of `stacks` (`_close`, interned; cached by `stacks`: the steps of
        different configurations and bytes often move to the same stacks). Fills caches only."""
        sid = self._closed.get(stacks)
        if sid is None:
            sid = self._closed[stacks] = self._intern(self._close(stacks))
        return sid

    def _step(self, sid: int, byte: int) -> int:
        nxt = int(self._table[sid, byte])
        if nxt != _UNKNOWN:
            return nxt
        trans = self.pda.trans
        moved = []
        for st in self._states[sid]:
            t = int(trans[st[-1], byte])
            if t >= 0:
                moved.append((*st[:-1], t))
        try:
            nxt = self._config_of(tuple(moved)) if moved else 0
        except _TooAmbiguous:
            if self._compiling:
                raise GrammarError(f"the grammar is too ambiguous: more than {MAX_STACKS} parses are alive at once "
                                   f"(rules {', '.join(self.pda.rule_names)}); make alternatives and repetitions "
                                   "of nullable rules start differently") from None
            # NOTE: past the bound a text is refused (the request then stops as stuck) rather than
            # slowing every step; compiles refuse grammars that get there within one token
            self.num_overflows += 1
            nxt = 0
        self._table[sid, byte] = nxt
        return nxt

    def _next(self, flat: np.ndarray) -> np.ndarray:
        """The table entries `flat` (sid * 256 + byte), unknown ones filled first (`_resolve`)."""
        nxt = self._table.ravel().take(flat)
        miss = nxt == _UNKNOWN
        if miss.any():
            self._resolve(flat[miss])
            nxt = self._table.ravel().take(flat)  # NOTE: `_resolve` may have grown the tables
        return nxt  # type: ignore[no-any-return]

    def _resolve(self, flat: np.ndarray) -> None:
        """Fill the table entries `flat` (sid * 256 + byte, unknown ones), every configuration's
        bytes at once (`_fill_pairs`), then any entry left to `_step`. Fills caches only.

        NOTE: a step reads only the network's column of its byte: each configuration is stepped
        once per class of bytes with equal columns (`_byte_lead`: a level-0 walk of free JSON,
        235 first bytes, reads ~40 classes), the other bytes of the class copy its entry."""
        wanted = _distinct(flat)
        lead = (wanted & ~255) | self._byte_lead.take(wanted & 255)
        table = self._table.ravel()
        if not np.array_equal(lead, wanted):
            todo = _distinct(lead)
            todo = todo[table.take(todo) == _UNKNOWN]
            if len(todo):
                self._fill_pairs(todo)
                table = self._table.ravel()  # NOTE: `_fill_pairs` may have grown the tables
            table[wanted] = table.take(lead)
        else:
            self._fill_pairs(wanted)
            table = self._table.ravel()
        for p in wanted[table.take(wanted) == _UNKNOWN].tolist():
            self._step(p >> 8, p & 255)

    @functools.cached_property
    def _byte_lead(self) -> np.ndarray:
        """(256,) int64: per byte, the first byte of its class in the network (`_byte_leads`)."""
        return _byte_leads(self.pda.trans)

    def _fill_pairs(self, wanted: np.ndarray) -> None:
        """Step each configuration of `wanted` (sid * 256 + byte, distinct, ascending) by its bytes,
        every pair at once: pairs no stack reads go to 0 with no closure, the pairs of one
        configuration that move every stack alike share one closure. A closure that passes
        `MAX_STACKS` is left unknown (for `_step`, which refuses it as before). Fills caches only.

        NOTE: the network's targets of every (pair, stack) in one flat array (a configuration's
        stacks in one fixed order); pairs grouped by (sid, a random 64-bit hash of their targets),
        checked exactly (a collision falls back to one closure per pair)."""
        sids = wanted >> 8
        starts = np.flatnonzero(_run_starts(sids))
        uniq = sids.take(starts).tolist()
        if len(wanted) <= _FEW_BYTES and all(len(self._states[s]) <= _FEW_BYTES for s in uniq):
            # NOTE: few pairs (the deep levels of a walk): grouped in Python, no array work
            ends = [*starts[1:].tolist(), len(wanted)]
            for s, lo, hi in zip(uniq, starts.tolist(), ends, strict=True):
                self._fill_few(s, list(self._states[s]), (wanted[lo:hi] & 255).tolist())
            return
        stacks_of = [list(self._states[s]) for s in uniq]
        sizes = np.fromiter((len(x) for x in stacks_of), dtype=np.int64, count=len(uniq))
        offsets = sizes.cumsum() - sizes
        tops = np.fromiter((st[-1] for x in stacks_of for st in x), dtype=np.int64, count=int(sizes.sum()))
        counts = np.empty(len(starts), dtype=np.int64)
        counts[:-1] = starts[1:] - starts[:-1]
        counts[-1] = len(wanted) - starts[-1]
        owner = np.repeat(np.arange(len(uniq)), counts)  # pair -> its config's index
        per = sizes.take(owner)  # stacks per pair
        first = per.cumsum() - per  # the pair's first (pair, stack) entry
        stack = _expand(offsets.take(owner), per)  # (pair, stack) -> index into `tops`
        targets = self.pda.trans.ravel().take(tops.take(stack) * 256 + (wanted & 255).repeat(per))
        live = np.maximum.reduceat(targets, first) >= 0
        table = self._table.ravel()
        table[wanted[~live]] = 0
        if not live.any():
            return
        # per live pair: a hash of its targets (weights by the stack's place in its configuration)
        place = np.arange(len(stack)) - first.repeat(per)
        h = np.add.reduceat(_HASH_WEIGHTS.take(place) * (targets.astype(np.uint64) + np.uint64(1)), first)
        pairs = live.nonzero()[0]
        order = np.lexsort((h.take(pairs), owner.take(pairs)))
        pairs = pairs.take(order)
        po, ph = owner.take(pairs), h.take(pairs)
        new = _run_starts(po) | _run_starts(ph)
        group = new.cumsum() - 1
        lead = pairs[new]  # each group's first pair
        # NOTE: exact check: every pair's targets equal its group's first pair's
        count = per.take(pairs)
        same = targets.take(_expand(first.take(pairs), count)) == targets.take(_expand(first.take(lead.take(group)),
                                                                                         count))
        if not same.all():
            bad = np.zeros(len(pairs), dtype=bool)
            bad[np.repeat(np.arange(len(pairs)), count)[~same]] = True
            # NOTE: a hash collision: those pairs one closure each (their groups of one)
            group = np.where(bad, len(lead) + np.arange(len(pairs)), group)
            lead = np.r_[lead, pairs]
        group_sid = np.full(len(lead), _UNKNOWN, dtype=np.int32)  # NOTE: a closure past MAX_STACKS stays unknown
        used = np.zeros(len(lead), dtype=bool)
        used[group] = True
        trans_targets = targets.tolist()
        config_of = self._config_of  # NOTE: groups of different configurations often move to one stack
        used_groups = np.flatnonzero(used)
        leads = lead.take(used_groups)
        closed = self._closed
        for g, f, o, n in zip(used_groups.tolist(), first.take(leads).tolist(), owner.take(leads).tolist(),
                              per.take(leads).tolist(), strict=True):
            moved: tuple[Stack, ...]
            if n == 1:  # NOTE: one stack (most configurations), live: its target is a state
                moved = (stacks_of[o][0][:-1] + (trans_targets[f],),)
            else:
                moved = tuple((*st[:-1], t) for st, t in zip(stacks_of[o], trans_targets[f:f + n], strict=True)
                              if t >= 0)
            sid = closed.get(moved)
            if sid is None:
                try:
                    sid = config_of(moved)
                except _TooAmbiguous:
                    continue
            group_sid[g] = sid
        # NOTE: `self._table` read after `_intern`, which may grow it
        self._table.ravel()[wanted.take(pairs)] = group_sid.take(group)

    def _fill_few(self, sid: int, stacks: list[Stack], byte_ids: list[int]) -> None:
        """`_fill_pairs` of few bytes from few stacks, in Python over the rows of the network
        (`_trans_row`: no array work per byte). Fills caches only."""
        rows = [self._trans_row(st[-1]) for st in stacks]
        by_col: dict[tuple[int, ...], list[int]] = {}
        for b in byte_ids:
            col = tuple(row[b] for row in rows)
            if max(col) < 0:
                self._table[sid, b] = 0
            else:
                by_col.setdefault(col, []).append(b)
        for col, bs in by_col.items():
            try:
                nxt = self._config_of(tuple((*st[:-1], t) for st, t in zip(stacks, col, strict=True) if t >= 0))
            except _TooAmbiguous:
                continue
            # NOTE: `self._table` read after `_intern`, which may grow it
            self._table[sid, bs] = nxt

    def _trans_row(self, state: int) -> list[int]:
        """Row `state` of the network's byte table as a list (cached)."""
        row = self._trans_rows.get(state)
        if row is None:
            row = self._trans_rows[state] = self.pda.trans[state].tolist()
        return row

    @functools.cached_property
    def _state_loops(self) -> np.ndarray:
        """(num_states, 4) uint64: per state of the network, the bytes that step it to itself."""
        return np.ascontiguousarray(np.packbits(self._state_loop_bytes, axis=1, bitorder="little").view("<u8"))

    def _loop_flags(self, sids: np.ndarray) -> np.ndarray:
        """Per configuration of `sids` (int64, none dead): whether some byte steps it to itself (its
        bytes in `_loop`, filled here on first sight). Fills caches only.

        NOTE: a loop byte steps every stack's top to itself (then the moved stacks are the
        configuration's own, and their closure is the configuration again), or steps some tops to
        themselves and kills the others where the closure of the survivors gives the whole
        configuration back (a run of spaces between values: the whitespace loops, the value's
        start dies and comes back through the call). Bytes that reach the same configuration some
        other way are left out: a loop byte is exact, the set need not be complete."""
        known = self._loop_known.take(sids)
        if not known.all():
            new = _distinct(sids[~known])
            tops: list[int] = []
            sizes: list[int] = []
            states = self._states
            for sid in new.tolist():
                ts = {st[-1] for st in states[sid]}
                tops.extend(ts)
                sizes.append(len(ts))
            starts = np.cumsum([0, *sizes[:-1]])
            top_loops = self._state_loops.take(tops, axis=0)
            loop = np.bitwise_and.reduceat(top_loops, starts, axis=0)
            # NOTE: candidates of `_survivor_loops`: bytes that some tops loop on and every other top dies on
            cand = (np.bitwise_or.reduceat(top_loops, starts, axis=0)
                    & np.bitwise_and.reduceat(top_loops | self._state_dead.take(tops, axis=0), starts, axis=0) & ~loop)
            for k in np.flatnonzero(cand.any(axis=1)).tolist():
                lo = int(starts[k])
                extra = self._survivor_loops(int(new[k]), tops[lo:lo + sizes[k]], cand[k])
                if extra is not None:
                    loop[k] |= extra
            self._loop[new] = loop
            self._has_loop[new] = loop.any(axis=1)
            self._loop_known[new] = True
        return self._has_loop.take(sids)  # type: ignore[no-any-return]

    def _survivor_loops(self, sid: int, tops: list[int], cand: np.ndarray) -> np.ndarray | None:
        """(4,) uint64: the bytes of `cand` ((4,) uint64: bytes on which some tops of configuration
        `sid` step to themselves and the others die) whose survivors close back to the
        configuration (`_loop_flags`), with those table entries filled (`sid`); None where there
        are none. Fills caches only."""
        bits = np.unpackbits(cand.view(np.uint8), bitorder="little").astype(bool)
        looping = self._state_loop_bytes.take(tops, axis=0)[:, bits]  # (tops, candidate bytes)
        byte_ids = np.flatnonzero(bits)
        config = self._states[sid]
        out = np.zeros(256, dtype=bool)
        groups: dict[tuple[bool, ...], list[int]] = {}
        for b, col in zip(byte_ids.tolist(), looping.T.tolist(), strict=True):
            groups.setdefault(tuple(col), []).append(b)
        for col, bs in groups.items():
            kept = {t for t, keep in zip(tops, col, strict=True) if keep}
            try:
                back = self._close([st for st in config if st[-1] in kept])
            except _TooAmbiguous:
                continue
            if back == config:
                out[bs] = True
                self._table[sid, bs] = sid
        if not out.any():
            return None
        return np.packbits(out, bitorder="little").view("<u8")

    @functools.cached_property
    def _state_loop_bytes(self) -> np.ndarray:
        """(num_states, 256) bool: per state of the network, the bytes that step it to itself."""
        trans = self.pda.trans
        return trans == np.arange(len(trans), dtype=trans.dtype)[:, None]  # type: ignore[no-any-return]

    @functools.cached_property
    def _state_dead(self) -> np.ndarray:
        """(num_states, 4) uint64: per state of the network, the bytes it reads no edge on."""
        return np.ascontiguousarray(np.packbits(self.pda.trans < 0, axis=1, bitorder="little").view("<u8"))

    def walk(self, sid: int, data: bytes) -> int:
        """The configuration after reading `data` from `sid` (0 if rejected). Fills caches only."""
        for b in data:
            sid = self._step(sid, b)
            if sid == 0:
                return 0
        return sid

    def can_end(self, sid: int) -> bool:
        """Whether the start rule may end in configuration `sid` (EOS is allowed)."""
        return bool(self._end[sid])

    def is_accepting(self, sid: int) -> bool:
        """`can_end` under `cfsm.Index`'s name (what `cfsm.Guide` asks)."""
        return bool(self._end[sid])

    def stacks(self, sid: int) -> frozenset[Stack]:
        """The stacks of configuration `sid` (read-only)."""
        return self._states[sid]

    @property
    def num_configurations(self) -> int:
        return len(self._states) - 1

    # --- token masks -------------------------------------------------------------------------------
    @functools.cached_property
    def _chains(self) -> dict[int, tuple[int, int, bytes]]:
        """State -> (head, steps left, byte class) of counted chains (`_counted_chains`), found
        on the first key walk."""
        return _counted_chains(self.pda)

    def _walk_tokens(self, sid: int, ranks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Walk the tokens at `ranks` (sorted indices into `by_length` order; None: all, over the
        vocabulary's trie: `_walk_trie`) from `sid` as a key's configuration, where a stack of one frame at its rule's end returns below the
        key. Returns (accepted ranks, sorted; escape pairs (rank, offset) of the tokens not
        accepted: the token may return below the key before its byte at that offset). Fills
        caches only.

        NOTE: tokens are in decreasing length order, so the ones still reading at step d are a
        prefix of the walked ones: steps take whole prefixes (no index arrays) until few tokens
        stay alive, then only the live ones."""
        if ranks is None:
            return self._walk_trie(sid)
        tables = self.vocab.trie_tables
        cols, counts = tables.length_columns, tables.length_counts
        # NOTE: a token whose first byte neither steps nor leaves the key is rejected: walk only
        # the others (most states take a few first bytes: digits, a quote, a keyword's letter)
        first = np.zeros(257, dtype=bool)
        first[:256] = self._first_bytes(sid)
        ranks = ranks[first.take(cols[0].take(ranks))]
        if len(ranks) <= _SCALAR_WALK:
            return self._walk_scalar(sid, ranks, np.zeros(len(ranks), dtype=np.int32))
        r = ranks
        m = len(r)
        cur = np.full(m, sid, dtype=np.int32)
        esc_where: list[np.ndarray] = []
        esc_d: list[int] = []
        live: np.ndarray | None = None  # local indices of the live tokens (None: every one of the prefix)
        for d in range(len(counts)):
            nd = int(np.searchsorted(r, counts[d]))
            if live is not None:
                live = live[live < nd]
                if not len(live):
                    break
                st = cur[live]
                b = cols[d, r[live]]
            else:
                if nd == 0:
                    break
                st = cur[:nd]
                b = cols[d, r[:nd]]
            flat = st.astype(np.int64) * 256 + b
            nxt = self._next(flat)
            # NOTE: returning below the key needs the next byte in the FOLLOW set of the rule left
            esc = self._end.take(st)
            if esc.any():
                esc &= self._after_end.ravel().take(flat)
                where = np.flatnonzero(esc) if live is None else live[esc]
                if len(where):
                    esc_where.append(where)
                    esc_d.append(d)
            if live is None:
                cur[:nd] = nxt
                if np.count_nonzero(nxt) * 4 < nd:
                    live = np.flatnonzero(nxt)
            else:
                cur[live] = nxt
                live = live[nxt != 0]
        ok = cur != 0
        if not esc_where:
            return r[ok], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        where = np.concatenate(esc_where)
        at = np.repeat(np.array(esc_d, dtype=np.int32), [len(w) for w in esc_where])
        keep = ~ok[where]
        return r[ok], r[where[keep]].astype(np.int64), at[keep]

    def _walk_trie(self, sid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`_walk_tokens` of the whole vocabulary from `sid` (`_walk_trie_many` of one key):
        (accepted ranks, distinct; escape pairs (rank, offset) of the tokens not accepted)."""
        acc_key, acc_pos, esc_key, esc_pos, esc_at = self._walk_trie_many([sid])
        rank = self.vocab.trie_levels.rank
        accepted = np.zeros(len(rank), dtype=bool)
        accepted[acc_pos] = True
        keep = ~accepted.take(esc_pos)
        return rank.take(acc_pos), rank.take(esc_pos[keep]), esc_at[keep]

    def _walk_trie_many(self, sids: list[int]
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`_walk_trie_split` with the escapes before a token's first byte listed per token, first
        (as the other escapes: (key, sorted position, offset 0))."""
        r_key, r_lo, r_cnt, e_key, e_pos, e_at, f_key, f_node, _ = self._walk_trie_split(sids)
        a_key, a_pos = np.repeat(r_key, r_cnt), _expand(r_lo, r_cnt)
        if not len(f_key):
            return a_key, a_pos, e_key, e_pos, e_at
        levels = self.vocab.trie_levels
        lo = levels.tok_lo[0].take(f_node)
        cnt = levels.tok_hi[0].take(f_node) - lo
        return (a_key, a_pos, np.concatenate([np.repeat(f_key, cnt), e_key]), np.concatenate([_expand(lo, cnt), e_pos]),
                np.concatenate([np.zeros(int(cnt.sum()), dtype=np.int32), e_at]))

    def _walk_trie_split(self, sids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                         np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Walk the whole vocabulary from every configuration of `sids` (one key each) at once,
        over its trie (`Vocabulary.trie_levels`): each distinct prefix is stepped once per key,
        a prefix that dies drops its subtree, and one whose tokens read on only bytes that loop
        its configuration accepts them whole (`_LOOP_CUT`). Returns (key, first sorted position, count)
        of the accepted tokens' ranges of sorted positions (each token once: the subtrees accepted
        whole are one range each), and (key, sorted position, offset) of every escape of a token
        not accepted (a token under a prefix whose last byte leaves the key there; some accepted
        ones may be listed too) past a token's first byte, and (key, level-0 node) where every
        token under the node may escape before its first byte (a rule end that its first byte may
        follow: often a third of the vocabulary, the tokens that start with a space; listed per
        node, not per token), and per key how many of its accepted tokens are in subtrees accepted
        whole by the level walk (float64). Fills caches only.

        NOTE: children expand in their parents' order, so every level's arrays stay sorted by key."""
        levels = self.vocab.trie_levels
        n0 = len(levels.byte[0]) if levels.byte else 0
        key = np.repeat(np.arange(len(sids), dtype=np.int64), n0)
        nodes = np.tile(np.arange(n0, dtype=np.int64), len(sids))
        st = np.repeat(np.asarray(sids, dtype=np.int64), n0)
        acc_key: list[np.ndarray] = []
        acc_lo: list[np.ndarray] = []
        acc_cnt: list[np.ndarray] = []
        esc_key: list[np.ndarray] = []
        esc_lo: list[np.ndarray] = []
        esc_cnt: list[np.ndarray] = []
        esc_d: list[int] = []
        f_key = f_node = np.zeros(0, dtype=np.int64)
        in_whole = np.zeros(len(sids))
        for d in range(len(levels.byte)):
            if not len(nodes):
                break
            if d and len(nodes) <= _TAIL_NODES:
                # NOTE: few prefixes left (SmolLM2: runs of UTF-8 dashes inside a string, ~20 levels of
                # 2-10 nodes): walked node by node in Python, no array work per level
                acc: list[tuple[int, int, int]] = []
                escs: list[tuple[int, int, int, int]] = []
                self._walk_tail(d, nodes.tolist(), key.tolist(), st.tolist(), acc, escs)
                if acc:
                    k, lo, cnt = (np.array(x, dtype=np.int64) for x in zip(*acc, strict=True))
                    acc_key.append(k)
                    acc_lo.append(lo)
                    acc_cnt.append(cnt)
                for k_, lo_, cnt_, d_ in escs:
                    esc_key.append(np.array([k_], dtype=np.int64))
                    esc_lo.append(np.array([lo_], dtype=np.int64))
                    esc_cnt.append(np.array([cnt_], dtype=np.int64))
                    esc_d.append(d_)
                break
            flat = st * 256 + levels.byte[d].take(nodes)
            nxt = self._next(flat)
            # NOTE: returning below the key needs the next byte in the FOLLOW set of the rule left
            esc = self._end.take(st)
            if esc.any():
                esc &= self._after_end.ravel().take(flat)
                if esc.any():
                    where = nodes[esc]
                    if d == 0:
                        f_key, f_node = key[esc], where
                    else:
                        lo = levels.tok_lo[d].take(where)
                        esc_key.append(key[esc])
                        esc_lo.append(lo)
                        esc_cnt.append(levels.tok_hi[d].take(where) - lo)
                        esc_d.append(d)
            alive = nxt != 0
            nodes, key, st = nodes[alive], key[alive], nxt[alive].astype(np.int64)
            if _LOOP_CUT and len(st):
                # NOTE: a node whose tokens read on only bytes that loop its configuration (a string
                # body: every byte but the quote and the backslash) accepts them all: its subtree is
                # not walked (nor its escapes listed: those of accepted tokens count for nothing)
                loops = self._loop_flags(st)
                if loops.any():
                    cand = loops.nonzero()[0]
                    rest = levels.below[d].take(nodes.take(cand), axis=0) & ~self._loop.take(st.take(cand), axis=0)
                    whole = cand[~rest.any(axis=1)]
                    if len(whole):
                        lo = levels.tok_lo[d].take(nodes.take(whole))
                        cnt = levels.tok_hi[d].take(nodes.take(whole)) - lo
                        acc_key.append(key.take(whole))
                        acc_lo.append(lo)
                        acc_cnt.append(cnt)
                        in_whole += np.bincount(key.take(whole), weights=cnt, minlength=len(sids))
                        keep = np.ones(len(nodes), dtype=bool)
                        keep[whole] = False
                        nodes, key, st = nodes[keep], key[keep], st[keep]
            cnt = levels.end_count[d].take(nodes)
            has = cnt > 0
            if has.any():
                acc_key.append(key[has])
                acc_lo.append(levels.tok_lo[d].take(nodes[has]))
                acc_cnt.append(cnt[has])
            if d + 1 == len(levels.byte):
                break
            lo = levels.child_lo[d].take(nodes)
            cnt = levels.child_hi[d].take(nodes) - lo
            nodes = _expand(lo, cnt)
            key = key.repeat(cnt)
            st = st.repeat(cnt)
        empty = np.zeros(0, dtype=np.int64)
        r_key = np.concatenate(acc_key) if acc_key else empty
        r_lo = np.concatenate(acc_lo) if acc_lo else empty
        r_cnt = np.concatenate(acc_cnt) if acc_cnt else empty
        if not esc_d:
            return r_key, r_lo, r_cnt, empty, empty, np.zeros(0, dtype=np.int32), f_key, f_node, in_whole
        cnt = np.concatenate(esc_cnt)
        e_key = np.repeat(np.concatenate(esc_key), cnt)
        e_pos = _expand(np.concatenate(esc_lo), cnt)
        e_at = np.repeat(np.repeat(np.array(esc_d, dtype=np.int32), [len(x) for x in esc_lo]), cnt)
        return r_key, r_lo, r_cnt, e_key, e_pos, e_at, f_key, f_node, in_whole

    def _walk_tail(self, d: int, nodes: list[int], keys: list[int], sids: list[int], acc: list[tuple[int, int, int]],
                   escs: list[tuple[int, int, int, int]]) -> None:
        """`_walk_trie_split` from level `d` on for the few (node, key, configuration before the
        node's byte) left, node by node: appends (key, first sorted position, count) of the accepted
        tokens to `acc` and (key, first sorted position, count, offset) of the escapes to `escs`
        (as the level-by-level walk lists them). Fills caches only."""
        levels = self.vocab.trie_levels
        depth = len(levels.byte)
        work = [(d, n, k, s) for n, k, s in zip(nodes, keys, sids, strict=True)]
        while work:
            d, node, k, s = work.pop()
            b = int(levels.byte[d][node])
            lo, hi = int(levels.tok_lo[d][node]), int(levels.tok_hi[d][node])
            if self._end[s] and self._after_end[s, b]:
                escs.append((k, lo, hi - lo, d))
            nxt = int(self._table[s, b])
            if nxt == _UNKNOWN:
                nxt = self._step(s, b)
            if nxt == 0:
                continue
            if _LOOP_CUT:
                if not self._loop_known[nxt]:
                    self._loop_flags(np.array([nxt], dtype=np.int64))
                if self._has_loop[nxt] and not (levels.below[d][node] & ~self._loop[nxt]).any():
                    acc.append((k, lo, hi - lo))  # NOTE: the subtree accepted whole, as in the level walk
                    continue
            cnt = int(levels.end_count[d][node])
            if cnt:
                acc.append((k, lo, cnt))
            if d + 1 < depth:
                work.extend((d + 1, c, k, nxt) for c in range(int(levels.child_lo[d][node]),
                                                              int(levels.child_hi[d][node])))

    def _one_frame_keys(self, states: list[int]) -> None:
        """The one-frame keys of `states` (their own walk representatives, no counted chain
        links) from one batched walk of the vocabulary (`_walk_trie_many`): the same infos
        `_key` gives one at a time. Fills caches only."""
        states = [s for s in states if (s,) not in self._keys]
        if not states:
            return
        sids = [self._config_of(((s,),)) for s in states]
        r_key, r_lo, r_cnt, e_key, e_pos, e_at, f_key, f_node, in_whole = self._walk_trie_split(sids)
        levels, tables = self.vocab.trie_levels, self.vocab.trie_tables
        words = self.vocab.mask_words
        presorted = False
        bits: np.ndarray | None = None
        if len(states) * words <= _BOOL_ROWS:
            # NOTE: one bool per (key, token), packed: fewer passes than the bincount below
            width = words * 32
            bits = np.zeros(len(states) * width, dtype=bool)
            r_key, r_lo, r_cnt = self._whole_rows(bits, width, r_key, r_lo, r_cnt, in_whole)
            a_key, a_pos = np.repeat(r_key, r_cnt), _expand(r_lo, r_cnt)
            bits[a_key * width + tables.order.take(a_pos)] = True
            rows = np.packbits(bits.reshape(len(states), width), axis=1, bitorder="little").view("<u4")
        else:
            a_key, a_pos = np.repeat(r_key, r_cnt), _expand(r_lo, r_cnt)
            ids = tables.order.take(a_pos).astype(np.int64)
            # NOTE: each (key, token) is accepted once: the sum of its distinct bits is their OR
            # (exact in float64 below 2**53)
            rows = np.bincount(a_key * words + (ids >> 5), weights=np.left_shift(1, ids & 31).astype(np.float64),
                               minlength=len(states) * words).astype(np.int64).astype(np.uint32).reshape(len(states),
                                                                                                          words)
        if len(e_key):
            e_ids = tables.order.take(e_pos).astype(np.int64)
            if bits is not None:
                keep = ~bits.take(e_key * (words * 32) + e_ids)
            else:
                keep = (rows.ravel().take(e_key * words + (e_ids >> 5)) >> (e_ids & 31).astype(np.uint32)) & 1 == 0
            e_key, e_rank, e_at = e_key[keep], levels.rank.take(e_pos[keep]), e_at[keep]
            if len(e_at) and int(e_at.max()) < 1 << 16 and len(levels.rank) < 1 << 24:
                # NOTE: one sort by (key, rank, offset) for every key: each key's pairs come out
                # sorted for `_info`
                pairs = np.sort(e_key << 40 | e_rank << 16 | e_at.astype(np.int64))
                e_key, e_rank, e_at = pairs >> 40, pairs >> 16 & ((1 << 24) - 1), (pairs & 0xFFFF).astype(np.int32)
                presorted = True
            else:
                order = np.argsort(e_key, kind="stable")
                e_key, e_rank, e_at = e_key[order], e_rank[order], e_at[order]
            bounds = np.searchsorted(e_key, np.arange(len(states) + 1))
        else:
            e_rank = e_key
            bounds = np.zeros(len(states) + 1, dtype=np.int64)
            presorted = True
        first = self._first_escapes(f_key, f_node, rows, bits)
        only_early: dict[int, _KeyInfo] = {}  # NOTE: keys alike share their escapes' arrays (`_first_escapes`)
        for k, s in enumerate(states):
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            esc_rank, esc_at, ordered = e_rank[lo:hi], e_at[lo:hi], presorted
            early = first.get(k)
            if early is not None:
                if not len(esc_rank):
                    done = only_early.get(id(early))
                    if done is None:
                        # NOTE: `_info` of distinct ascending ranks at offset 0 (one pair per token, none late)
                        ranks, zero = np.ascontiguousarray(early, dtype=np.int64), np.zeros(len(early), dtype=np.int32)
                        done = only_early[id(early)] = _KeyInfo(rows[k], ranks, np.zeros(len(early), dtype=bool), ranks,
                                                                zero, _digest(ranks, zero))
                    self._keys[(s,)] = _KeyInfo(rows[k], done.uncertain, done.late, done.esc_rank, done.esc_at,
                                                done.digest)
                    continue
                elif presorted:
                    # NOTE: a merge of two sorted lists (offset 0 sorts before a token's later offsets)
                    a, b = early << 16, esc_rank << 16 | esc_at.astype(np.int64)
                    pairs = np.insert(a, np.searchsorted(a, b), b)
                    esc_rank, esc_at = pairs >> 16, (pairs & 0xFFFF).astype(np.int32)
                else:
                    esc_rank = np.concatenate([early, esc_rank])
                    esc_at = np.concatenate([np.zeros(len(early), dtype=np.int32), esc_at])
            self._keys[(s,)] = _info(rows[k], esc_rank, esc_at, ordered)

    def _whole_rows(self, bits: np.ndarray, width: int, r_key: np.ndarray, r_lo: np.ndarray, r_cnt: np.ndarray,
                    in_whole: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Set the bits (`bits`: one bool per (key, token id), `width` per key) of the keys of a
        batched walk whose subtrees accepted whole (`in_whole`, per key) hold at least
        `_WHOLE_ROW` of the vocabulary (a string body: nearly every token), from their ranges of
        sorted positions (`_walk_trie_split`'s); returns the other keys' ranges (all of them where
        those keys have more than one range per 16 tokens). Fills `bits` only.

        NOTE: such a key's row is every token of the trie but those in the gaps between its
        ranges (few): a copy of the trie's row and a scatter of the gaps instead of a scatter of
        ~49k bits per key (SmolLM2: two keys of free JSON); all such keys' gaps at once."""
        order = self.vocab.trie_tables.order
        n = len(order)
        is_big = in_whole >= _WHOLE_ROW * n
        if not is_big.any():
            return r_key, r_lo, r_cnt
        sel = is_big.take(r_key)
        key, lo = r_key[sel], r_lo[sel]
        if len(key) * 16 > int(in_whole[is_big].sum()):
            return r_key, r_lo, r_cnt  # NOTE: many small ranges: sorting them costs more than their bits
        hi = lo + r_cnt[sel]
        by = np.lexsort((lo, key))
        key, lo, hi = key.take(by), lo.take(by), hi.take(by)
        # NOTE: a key's ranges are disjoint: its gaps are before each range (from the end of the
        # one before it, or 0) and after its last one
        first = _run_starts(key)
        last = np.empty(len(key), dtype=bool)
        last[:-1] = first[1:]
        last[-1] = True
        before = np.concatenate(([0], hi[:-1]))
        before[first] = 0
        gap_key = np.concatenate((key, key[last]))
        gap_lo = np.concatenate((before, hi[last]))
        gap_cnt = np.concatenate((lo - before, n - hi[last]))
        in_trie = np.zeros(width, dtype=bool)
        in_trie[self._rank_ids] = True
        bits.reshape(-1, width)[np.flatnonzero(is_big)] = in_trie
        bits[np.repeat(gap_key, gap_cnt) * width + order.take(_expand(gap_lo, gap_cnt))] = False
        return r_key[~sel], r_lo[~sel], r_cnt[~sel]

    def _first_escapes(self, f_key: np.ndarray, f_node: np.ndarray, rows: np.ndarray, bits: np.ndarray | None
                       ) -> dict[int, np.ndarray]:
        """Per key of a batched walk (`_walk_trie_split`'s (key, level-0 node) pairs), the ranks
        of the tokens that may escape it before their first byte and that it does not accept
        (ascending; `rows`, or `bits` where set, are the keys' accepted tokens). Pure.

        NOTE: many tokens (those under a space, say): the tokens whose first byte is one of the
        nodes' bytes, read off the first column in rank order (no sort); few: their ranks sorted."""
        out: dict[int, np.ndarray] = {}
        if not len(f_key):
            return out
        levels, tables = self.vocab.trie_levels, self.vocab.trie_tables
        cols0 = tables.length_columns[0]
        words = self.vocab.mask_words
        lo_all = levels.tok_lo[0].take(f_node)
        cnt_all = levels.tok_hi[0].take(f_node) - lo_all
        starts = np.flatnonzero(_run_starts(f_key)).tolist()
        # NOTE: keys alike (the end states of a number: the same first bytes escape, and none of
        # them accepts a token that starts with one) share the tokens' arrays and the result
        by_nodes: dict[bytes, tuple[np.ndarray, list[np.ndarray], np.ndarray]] = {}
        for a, b in zip(starts, [*starts[1:], len(f_key)], strict=True):
            k = int(f_key[a])
            nodes = f_node[a:b]
            hit = by_nodes.get(nodes.tobytes())
            if hit is None:
                if int(cnt_all[a:b].sum()) * _FIRST_BY_COLUMN > len(cols0):
                    member = np.zeros(257, dtype=bool)
                    member[levels.byte[0].take(nodes)] = True
                    ranks = np.flatnonzero(member.take(cols0))
                else:
                    ranks = np.sort(levels.rank.take(_expand(lo_all[a:b], cnt_all[a:b])))
                hit = by_nodes[nodes.tobytes()] = (ranks, [], self._bits(ranks))
                self._rank_rows[id(ranks)] = (ranks, hit[2])
            ranks, made, row = hit
            if not (rows[k] & row).any():
                out[k] = ranks  # NOTE: the key accepts none of them (one word pass, no pass over the tokens)
                continue
            ids = self._rank_ids.take(ranks)
            if bits is not None:
                keep = ~bits.take(k * (words * 32) + ids)
            else:
                keep = (rows[k].take(ids >> 5) >> (ids & 31).astype(np.uint32)) & 1 == 0
            got = ranks[keep].astype(np.int64)
            out[k] = next((m for m in made if np.array_equal(m, got)), got)
            if out[k] is got:
                made.append(got)
        return out

    def _walk_scalar(self, sid: int, ranks: np.ndarray, offsets: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`_walk_tokens` / `_walk_pairs` for a few (token, offset) pairs, one at a time (no
        per-step array work). Returns (accepted ranks, sorted and distinct; escape pairs of the
        tokens no pair accepted)."""
        tokens = self.vocab.tokens
        ids = self._rank_ids.take(ranks).tolist()
        acc: set[int] = set()
        esc: list[tuple[int, int]] = []
        for rank, tid, start in zip(ranks.tolist(), ids, offsets.tolist(), strict=True):
            cur = sid
            data = tokens[tid]
            for d in range(start, len(data)):
                b = data[d]
                # NOTE: the tables grow in `_step`: read them through self
                if self._end[cur] and self._after_end[cur, b]:
                    esc.append((rank, d))
                nxt = int(self._table[cur, b])
                cur = self._step(cur, b) if nxt == _UNKNOWN else nxt
                if cur == 0:
                    break
            if cur:
                acc.add(rank)
        esc = [e for e in esc if e[0] not in acc]
        return (np.array(sorted(acc), dtype=np.int64), np.array([e[0] for e in esc], dtype=np.int64),
                np.array([e[1] for e in esc], dtype=np.int32))

    def _walk_pairs(self, sid: int, ranks: np.ndarray, offsets: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Walk token `ranks[i]` from its byte `offsets[i]` on, from configuration `sid` (the
        escapes of a key continued in the frame below it). Returns what `_walk_scalar` does."""
        if len(ranks) <= _SCALAR_WALK:
            return self._walk_scalar(sid, ranks, offsets)
        ok, esc_i, esc_o = self._walk_pairs_many(np.full(len(ranks), sid, dtype=np.int32), ranks, offsets)
        acc = _sorted_distinct(ranks[ok])  # NOTE: `ranks` ascending (a key's escape pairs)
        if not len(esc_i):
            return acc, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        er = ranks.take(esc_i).astype(np.int64)
        keep = ~_member(er, acc)
        return acc, er[keep], esc_o[keep]

    def _walk_pairs_many(self, cur: np.ndarray, ranks: np.ndarray, offsets: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Walk token `ranks[i]` from its byte `offsets[i]` on, from configuration `cur[i]` (int32;
        overwritten), every pair at once. Returns (per pair: it read its token to the end;
        escapes: pair index, offset). Fills caches only."""
        cols = self.vocab.trie_tables.length_columns
        lengths = self._lengths
        pos = offsets.astype(np.int64)
        ends = lengths.take(ranks)
        live = np.arange(len(ranks))
        ok = np.zeros(len(ranks), dtype=bool)
        esc_i: list[np.ndarray] = []
        esc_o: list[np.ndarray] = []
        while len(live):
            done = pos.take(live) >= ends.take(live)
            if done.any():
                ok[live[done]] = True
                live = live[~done]
                if not len(live):
                    break
            st = cur.take(live)
            p = pos.take(live)
            b = cols[p, ranks.take(live)]
            flat = st.astype(np.int64) * 256 + b
            nxt = self._next(flat)
            esc = self._end.take(st)
            if esc.any():
                esc &= self._after_end.ravel().take(flat)
                if esc.any():
                    esc_i.append(live[esc])
                    esc_o.append(p[esc])
            cur[live] = nxt
            pos[live] = p + 1
            live = live[nxt != 0]
        if not esc_i:
            return ok, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        return ok, np.concatenate(esc_i).astype(np.int64), np.concatenate(esc_o).astype(np.int32)

    @property
    def _lengths(self) -> np.ndarray:
        """Token length per rank (`TrieTables.by_length` order; the vocabulary's table)."""
        return self.vocab.trie_tables.rank_lengths

    @property
    def _rank_ids(self) -> np.ndarray:
        """Token id per rank (`TrieTables.by_length` order, int64; the vocabulary's table)."""
        return self.vocab.trie_tables.rank_ids

    def _first_bytes(self, sid: int) -> np.ndarray:
        """(256,) bool: the bytes that step from `sid` or leave it at a rule end (FOLLOW)."""
        tops = sorted({st[-1] for st in self._states[sid]})
        out = np.zeros(256, dtype=bool)
        if tops:
            np.any(self.pda.trans[tops] >= 0, axis=0, out=out)
        if self._end[sid]:
            out |= self._after_end[sid]
        return out

    def _bits(self, ranks: np.ndarray) -> np.ndarray:
        """(mask_words,) uint32: the bits of the tokens at `ranks` (distinct). Pure."""
        if len(ranks) <= _FEW_BITS:
            # NOTE: none or a few (most settlements): set in Python, no array pass over the words
            row = np.zeros(self.vocab.mask_words, dtype=np.uint32)
            for i in self._rank_ids.take(ranks).tolist():
                row[i >> 5] |= 1 << (i & 31)
            return row
        if len(ranks) <= 2048:  # NOTE: few tokens (escapes, settlements): set their bits, no full-size pack
            # NOTE: distinct tokens: the sum of a word's distinct bits is their OR (exact in float64)
            ids = self._rank_ids.take(ranks)
            return np.bincount(ids >> 5, weights=np.left_shift(1, ids & 31).astype(np.float64),
                               minlength=self.vocab.mask_words).astype(np.uint32)
        bits = np.zeros(self.vocab.mask_words * 32, dtype=bool)
        bits[self._rank_ids.take(ranks)] = True
        return np.packbits(bits, bitorder="little").view("<u4").copy()

    def _key(self, key: Stack) -> _KeyInfo:
        info = self._keys.get(key)
        if info is not None:
            return info
        if len(key) == 1:
            rep = self._rep[key[0]]
            if rep != key[0]:
                info = self._keys[key] = self._key((rep,))
                return info
            link = self._chains.get(key[0])
            sid = self._config_of((key,))
            if link is not None:
                info = self._chain_key(sid, *link)
            else:
                acc, esc_rank, esc_at = self._walk_tokens(sid, None)
                info = _info(self._bits(acc), esc_rank, esc_at)
        else:
            prev = self._key(key[1:])
            below = self._settle(key[0], prev)
            info = _KeyInfo(prev.row | below.row, below.uncertain, below.late, below.esc_rank, below.esc_at,
                            below.digest)
        self._keys[key] = info
        return info

    def _settle(self, ret: int, prev: _KeyInfo) -> _KeyInfo:
        """The escapes of `prev` continued in the frame `ret` below it: the tokens they accept
        (`row`) and the escapes below `ret` of the others. Cached per (ret, escape pairs), so a new
        deep stack costs lookups once its escapes were seen under any other stack.

        NOTE: a token that escapes only before its first byte goes as from the one-frame key of
        `ret` (accepted, rejected or escaping alike): no walk."""
        return self._settle_many([ret], prev)[0]

    def _settle_many(self, rets: list[int], prev: _KeyInfo) -> list[_KeyInfo]:
        """`_settle` of `prev` below each of `rets`, the walks of the returns not cached yet in
        one batch (the same (token, offset) pairs from each return's configuration)."""
        reps = [self._rep[r] for r in rets]
        todo = sorted({r for r in reps if (r, prev.digest) not in self._settled})
        if todo:
            # NOTE: pair i belongs to uncertain token (new tokens up to i) - 1 (`esc_rank` ascending)
            er = prev.esc_rank
            if prev.late.any():
                late = prev.late[np.cumsum(_run_starts(er)) - 1]
                ranks, offsets = prev.esc_rank[late], prev.esc_at[late]
            else:  # NOTE: every escape before a first byte (a number's end): nothing to walk
                ranks, offsets = _NO_RANKS, _NO_OFFSETS
            m = len(ranks)
            if not m:
                walks = [(_NO_RANKS, _NO_RANKS, _NO_OFFSETS)] * len(todo)  # NOTE: nothing to walk
            elif len(todo) == 1 or m * len(todo) <= _SCALAR_WALK:
                walks = [self._walk_pairs(self._config_of(((r,),)), ranks, offsets) for r in todo]
            else:
                sids = [self._config_of(((r,),)) for r in todo]
                ok, esc_i, esc_o = self._walk_pairs_many(np.repeat(np.asarray(sids, dtype=np.int32), m),
                                                         np.tile(ranks, len(todo)), np.tile(offsets, len(todo)))
                owner = esc_i // max(m, 1)
                walks = []
                for k in range(len(todo)):
                    acc = _sorted_distinct(ranks[ok[k * m:(k + 1) * m]])
                    sel = owner == k
                    er = ranks.take(esc_i[sel] - k * m).astype(np.int64)
                    keep = ~_member(er, acc)
                    walks.append((acc, er[keep], esc_o[sel][keep]))
            early = prev.uncertain[~prev.late] if m else prev.uncertain
            # NOTE: the early tokens a return's key accepts: its row and theirs (one bit pass; a
            # number's end: the ~32k tokens after a space, their row made by `_first_escapes`)
            known = self._rank_rows.get(id(early))
            early_row = known[1] if known is not None and known[0] is early else self._bits(early)
            for r, (acc, esc_rank, esc_at) in zip(todo, walks, strict=True):
                base = self._key((r,))
                in_base = _member(base.esc_rank, early)
                row = self._bits(acc) | (base.row & early_row)
                if len(esc_rank):
                    info = _info(row, np.concatenate([esc_rank, base.esc_rank[in_base]]),
                                 np.concatenate([esc_at, base.esc_at[in_base]]))
                elif in_base.all():
                    # NOTE: base's escapes whole (a number's end below a value: ~32k tokens that
                    # start with a space on SmolLM2): its arrays and what `_info` derives from them
                    info = _KeyInfo(row, base.uncertain, base.late, base.esc_rank, base.esc_at, base.digest)
                else:
                    info = _info(row, base.esc_rank[in_base], base.esc_at[in_base], presorted=True)  # NOTE: a subsequence
                self._settled[(r, prev.digest)] = info
        return [self._settled[(r, prev.digest)] for r in reps]

    def _chain_key(self, sid: int, head: int, remaining: int, run_class: bytes) -> _KeyInfo:
        """The one-frame key of a state `remaining` steps before the end of a counted chain
        (`_counted_chains`) from the key of the chain's head: a token whose leading run of the
        chain's bytes fits in `remaining` behaves the same from both (same escapes too); the
        others are walked."""
        base = self._key((head,))
        runs = self._leading_runs(run_class)
        long = np.flatnonzero(runs > remaining)
        if not len(long):
            return base  # NOTE: every token goes as from the head (same row, same escapes)
        acc, esc_rank, esc_at = self._walk_tokens(sid, long)
        keep = ~_member(base.esc_rank, long)
        row = base.row & ~self._bits(long) | self._bits(acc)
        return _info(row, np.concatenate([base.esc_rank[keep], esc_rank]), np.concatenate([base.esc_at[keep], esc_at]))

    def _chain_keys(self, states: list[int]) -> None:
        """The one-frame keys of counted-chain states (`_chain_key`), their long tokens walked
        in one batch (`_walk_pairs_many`). Fills caches only."""
        states = [s for s in states if (s,) not in self._keys]
        if not states:
            return
        links = [self._chains[s] for s in states]
        bases = [self._key((head,)) for head, _, _ in links]
        cols0 = self.vocab.trie_tables.length_columns[0]
        longs: list[np.ndarray] = []
        walked: list[np.ndarray] = []
        sids: list[int] = []
        derived: dict[tuple[int, bytes], np.ndarray | None] = {}  # (head, class) -> `_chain_escapes`
        for s, (head, remaining, run_class) in zip(states, links, strict=True):
            starting, order, neg_runs = self._runs_order(run_class)
            if remaining:
                long = order[:int(np.searchsorted(neg_runs, -remaining, side="left"))]
            else:
                long = starting
            longs.append(long)
            if _CHAIN_DERIVE and len(long):
                if (head, run_class) not in derived:
                    derived[(head, run_class)] = self._chain_escapes(head, run_class)
                if derived[(head, run_class)] is not None:
                    sids.append(0)  # NOTE: no walk, no configuration (see `_chain_escapes`)
                    walked.append(long[:0])
                    continue
            sid = self._config_of(((s,),)) if len(long) else 0
            sids.append(sid)
            if remaining or not len(long):
                # NOTE: a long token starts with a byte of the class, which steps every link but the last
                walked.append(long)
                continue
            first = np.zeros(257, dtype=bool)
            first[:256] = self._first_bytes(sid)
            if not first[list(run_class)].any():
                walked.append(long[:0])
            else:
                walked.append(long[first.take(cols0.take(long))])
        counts = [len(w) for w in walked]
        ranks = np.concatenate(walked) if walked else np.zeros(0, dtype=np.int64)
        cur = np.repeat(np.asarray(sids, dtype=np.int32), counts)
        ok, esc_i, esc_o = self._walk_pairs_many(cur, ranks, np.zeros(len(ranks), dtype=np.int32))
        owner = np.repeat(np.arange(len(states)), counts)
        e_owner = owner.take(esc_i)
        keep = ~ok.take(esc_i)
        e_owner, e_rank, e_at = e_owner[keep], ranks.take(esc_i[keep]), esc_o[keep]
        order = np.argsort(e_owner, kind="stable")
        e_owner, e_rank, e_at = e_owner[order], e_rank[order], e_at[order]
        e_bounds = np.searchsorted(e_owner, np.arange(len(states) + 1))
        bounds = np.concatenate([[0], np.cumsum(counts)])
        cleared: dict[tuple[bytes, int], np.ndarray] = {}  # NOTE: chains of one class share their long sets
        base_runs: dict[tuple[int, bytes], tuple[np.ndarray, int]] = {}  # (head, class): runs of its escapes, max
        for k, s in enumerate(states):
            base, long = bases[k], longs[k]
            if not len(long):
                self._keys[(s,)] = base  # NOTE: every token goes as from the head (same row, same escapes)
                continue
            head, remaining, run_class = links[k]
            mask = cleared.get((run_class, remaining))
            if mask is None:
                mask = cleared[(run_class, remaining)] = ~self._bits(long)
            runs = base_runs.get((head, run_class))
            if runs is None:
                esc_runs = self._leading_runs(run_class).take(base.esc_rank)
                runs = base_runs[(head, run_class)] = (esc_runs, int(esc_runs.max(initial=0)))
            escapes = derived.get((head, run_class)) if _CHAIN_DERIVE else None
            if escapes is not None:
                # NOTE: every long token dies at the chain's end; it escapes where the head's
                # configuration does on the bytes it read (`_chain_escapes`)
                row = base.row & mask
                new_rank, new_at = self._chain_long_escapes(long, remaining, escapes)
            else:
                lo, hi = int(bounds[k]), int(bounds[k + 1])
                row = base.row & mask | self._bits(ranks[lo:hi][ok[lo:hi]])
                elo, ehi = int(e_bounds[k]), int(e_bounds[k + 1])
                new_rank, new_at = e_rank[elo:ehi], e_at[elo:ehi]
            if not len(new_rank) and runs[1] <= remaining:
                # NOTE: the head's escape pairs, every one kept, none added: its sorted arrays and digest as they are
                self._keys[(s,)] = _KeyInfo(row, base.uncertain, base.late, base.esc_rank, base.esc_at, base.digest)
                continue
            keep_base = runs[0] <= remaining
            self._keys[(s,)] = _info(row, np.concatenate([base.esc_rank[keep_base], new_rank]),
                                     np.concatenate([base.esc_at[keep_base], new_at]))

    def _chain_escapes(self, head: int, run_class: bytes) -> np.ndarray | None:
        """(257,) bool: the bytes of `run_class` on which the head's configuration returns below
        its key, when the keys of the chain's states may be derived without a walk; else None.
        Fills caches only.

        NOTE: the configuration of a chain state s_k is (s_k,) plus the stacks Y its calls open
        (the calls of s_0 and s_k are the same, a one-frame stack never returns: Y is the same
        for every k). Where no top of Y reads a byte of the class, a byte of the class steps
        (s_k,) to (s_k+1,) and drops Y, and the closure gives Y back: a token whose leading run
        passes the chain's end goes through the chain states to s_n, which reads no byte of the
        class, and dies there; at each of those bytes it escapes where the head's configuration
        does (the same one-frame stacks end: (s_k,) alike to (s_0,), Y's alike)."""
        pda = self.pda
        seeds = [(ret, int(pda.rule_start[rule])) for rule, ret in pda.calls[head]]
        try:
            rest = self._close(seeds) if seeds else frozenset()
        except _TooAmbiguous:
            return None
        cls = list(run_class)
        tops = sorted({st[-1] for st in rest})
        if tops and (pda.trans[np.asarray(tops)][:, cls] >= 0).any():
            return None
        sid = self._config_of(((head,),))
        out = np.zeros(257, dtype=bool)
        if self._end[sid]:
            out[cls] = self._after_end[sid, cls]
        return out

    def _chain_long_escapes(self, long: np.ndarray, remaining: int, escapes: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray]:
        """The escape pairs (rank, offset) of the long tokens `long` of a chain state `remaining`
        steps before its end (`_chain_escapes`): offsets 0..remaining where the token's byte is
        one of `escapes`. Pure."""
        if not len(long) or not escapes.any():
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        cols = self.vocab.trie_tables.length_columns
        hit = escapes.take(cols[:remaining + 1].take(long, axis=1))  # (remaining + 1, tokens)
        at, which = np.nonzero(hit)
        return long.take(which).astype(np.int64), at.astype(np.int32)

    def _runs_order(self, run_class: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ranks of the tokens that start with a `run_class` byte (ascending), those with a
        leading run of at least two such bytes by decreasing run, and their runs negated
        (ascending, for `searchsorted`). Cached."""
        hit = self._runs_sorted.get(run_class)
        if hit is None:
            runs = self._leading_runs(run_class)
            two = np.flatnonzero(runs >= 2)
            order = two[np.argsort(-runs.take(two), kind="stable")]
            hit = self._runs_sorted[run_class] = (np.flatnonzero(runs), order, -runs.take(order).astype(np.int64))
        return hit

    def _leading_runs(self, run_class: bytes) -> np.ndarray:
        """Per token (by rank), how many of its first bytes are in `run_class`. Cached."""
        hit = self._runs.get(run_class)
        if hit is not None:
            return hit
        tables = self.vocab.trie_tables
        member = np.zeros(257, dtype=bool)
        member[list(run_class)] = True
        cols = tables.length_columns
        runs = np.zeros(len(tables.by_length), dtype=np.int32)
        live = np.flatnonzero(member.take(cols[0]))  # NOTE: only tokens that start in the class
        for d in range(1, cols.shape[0] + 1):
            if not len(live):
                break
            if len(live) <= _SCALAR_WALK:
                # NOTE: the few long runs (SmolLM2: spaces up to 80 bytes) by `bytes.lstrip`, not a step per byte
                toks = tables.sorted_tokens
                order = tables.by_length.take(live).tolist()
                runs[live] = [len(toks[i]) - len(toks[i].lstrip(run_class)) for i in order]
                break
            runs[live] += 1
            if d < cols.shape[0]:
                live = live[member.take(cols[d].take(live))]
        self._runs[run_class] = runs
        return runs

    def _stack_row(self, st: Stack) -> np.ndarray:
        m = 1
        while True:
            info = self._key(st[-m:])
            if not len(info.uncertain) or m == len(st):
                return info.row
            m += 1

    def _row_of(self, sid: int) -> int:
        r = self._state_row.get(sid)
        if r is not None:
            return r
        row = np.zeros(self.vocab.mask_words, dtype=np.uint32)
        for st in self._states[sid]:
            row |= self._stack_row(st)
        if self._end[sid]:
            for e in self.vocab.eos_token_ids:
                row[e >> 5] |= np.uint32(1 << (e & 31))
        key = row.tobytes()
        r = self._row_ids.get(key)
        if r is None:
            r = self._row_ids[key] = len(self._rows)
            self._rows.append(row.view(np.int32))
        self._state_row[sid] = r
        return r

    def mask(self, sid: int) -> np.ndarray:
        """The allowed-token bitmask of configuration `sid` (int32, ceil(V/32) words, EOS included
        where the grammar may end). A view: do not mutate."""
        return self._rows[self._row_of(sid)]

    def is_allowed(self, sid: int, token_id: int) -> bool:
        """Whether the mask of `sid` has `token_id`."""
        if not 0 <= token_id < self.vocab.size:
            return False
        return bool((int(self.mask(sid)[token_id >> 5]) >> (token_id & 31)) & 1)

    def has_tokens(self, sid: int) -> bool:
        """Whether some non-EOS token is allowed in `sid`."""
        row = self.mask(sid).view(np.uint32).copy()
        for e in self.vocab.eos_token_ids:
            row[e >> 5] &= np.uint32(~(1 << (e & 31)) & 0xFFFFFFFF)
        return bool(row.any())

    def next_state(self, sid: int, token_id: int) -> int:
        """Configuration after non-EOS `token_id` (0 if not allowed). Fills caches only."""
        vocab = self.vocab
        if sid == 0 or token_id in vocab.special_token_ids or not 0 <= token_id < len(vocab.tokens):
            return 0
        data = vocab.tokens[token_id]
        return self.walk(sid, data) if data else 0

    def forced_bytes(self, sid: int) -> bytes:
        """The bytes every continuation of `sid` starts with (stops where EOS or a choice is
        possible; at most `MAX_FORCED_BYTES`). Crosses rule boundaries. Cached per configuration."""
        hit = self._forced.get(sid)
        if hit is not None:
            return hit
        out = bytearray()
        s = sid
        trans = self.pda.trans
        while s and len(out) < MAX_FORCED_BYTES and not self._end[s]:
            tops = sorted({st[-1] for st in self._states[s]})
            live = np.flatnonzero((trans[tops] >= 0).any(axis=0))
            if len(live) != 1:
                break
            b = int(live[0])
            out.append(b)
            s = self._step(s, b)
        forced = self._forced[sid] = bytes(out)
        return forced

    def precompute(self) -> None:
        """Walk the vocabulary from every state that can be on top of a stack, and the tokens
        they leave uncertain from every return state below (the costly part of a compile, done
        once). Fills caches only."""
        self._compiling = True
        try:
            self._precompute()
        finally:
            self._compiling = False

    def _precompute(self) -> None:
        pda = self.pda
        returns: dict[int, set[int]] = {}
        for calls in pda.calls:
            for rule, ret in calls:
                returns.setdefault(rule, set()).add(ret)
        # the escapes of every one-frame key settled by every frame that may lie below it, then
        # what those leave uncertain by the frames below them, and so on, until no new escape set
        # shows up (or the budget of `MAX_SETTLEMENTS`): a first-use mask of a deep stack is then lookups only
        work: list[tuple[_KeyInfo, int]] = []
        queued: set[tuple[bytes, int]] = set()  # NOTE: a settlement depends on (escapes, frame) only
        uncertain = 0
        positions = np.flatnonzero(pda.has_bytes).tolist()
        chains = self._chains
        # NOTE: the return states too (settlements start from their keys): one batched walk
        rep = self._rep
        keyed = sorted({rep[s] for s in positions} | {rep[ret] for ret_set in returns.values() for ret in ret_set})
        # NOTE: a chain of one link (free JSON's exponent sign) costs more to derive (`_chain_keys`:
        # the vocabulary's leading runs of its bytes) than its state adds to the batched walk
        longer = {head for head, remaining, _ in chains.values() if remaining}
        derived = {s for s in keyed if s in chains and (chains[s][1] or chains[s][0] in longer)}
        self._one_frame_keys([s for s in keyed if s not in derived])
        self._chain_keys([s for s in keyed if s in derived])
        for s in positions:
            info = self._key((s,))
            if len(info.uncertain):
                uncertain += 1
                rule = int(pda.state_rule[s])
                if (info.digest, rule) not in queued:
                    queued.add((info.digest, rule))
                    work.append((info, rule))
        rets = {rule: sorted(r) for rule, r in returns.items()}
        budget = min(self.max_settlements, 2 * uncertain + 256)
        while work and len(self._settled) < budget:
            info, rule = work.pop()
            below_rets = rets.get(rule, [])
            for ret, below in zip(below_rets, self._settle_many(below_rets, info), strict=True):
                # NOTE: returns that share walks share the settlement (a lookup), but what it
                # leaves uncertain goes on below each return's own rule
                below_rule = int(pda.state_rule[ret])
                if len(below.uncertain) and (below.digest, below_rule) not in queued:
                    queued.add((below.digest, below_rule))
                    work.append((below, below_rule))
        self._row_of(self.start)

    # --- transport ---------------------------------------------------------------------------------
    def copy(self) -> GrammarIndex:
        """An independent index in this one's state: what it compiled and cached so far (the
        network, walks and key infos shared: never mutated; the configuration table and the
        caches copied, so guides of the copy fill only the copy's). Pure."""
        new = object.__new__(GrammarIndex)
        new.__dict__.update(self.__dict__)
        new._states = list(self._states)
        new._ids = dict(self._ids)
        new._table = self._table.copy()
        new._end = self._end.copy()
        new._after_end = self._after_end.copy()
        new._loop_known = self._loop_known.copy()
        new._has_loop = self._has_loop.copy()
        new._loop = self._loop.copy()
        for name in ("_keys", "_settled", "_row_ids", "_state_row", "_forced", "_runs", "_runs_sorted", "_trans_rows",
                     "_closed", "_rank_rows"):
            setattr(new, name, dict(getattr(self, name)))
        new._rows = list(self._rows)
        return new

    def payload(self) -> dict[str, Any]:
        """Everything but the vocabulary (plain data and arrays; what a compile worker sends): the
        network, the key walks and settlements computed so far, and the counted chains (which
        `from_payload` would otherwise find again on the first key walk: pure Python, ~0.3 s on
        a 2-core CPU for some real-world schemas). Fills the chains cache only."""
        pda = self.pda
        return {"pda": (pda.trans, pda.calls, pda.accepting, pda.has_bytes, pda.state_rule, pda.rule_start,
                        pda.rule_names, pda.root),
                "grammar": self.grammar, "approximations": tuple(self.approximations),
                "keys": {k: (v.row, v.esc_rank, v.esc_at) for k, v in self._keys.items()},
                "reps": np.asarray(self._rep, dtype=np.int32),
                "settled": {k: (v.row, v.esc_rank, v.esc_at) for k, v in self._settled.items()},
                "chains": self._chains}

    @classmethod
    def from_payload(cls, payload: dict[str, Any], vocab: Vocabulary) -> GrammarIndex:
        """The index of `payload` over `vocab` (the vocabulary it was compiled for)."""
        trans, calls, accepting, has_bytes, state_rule, rule_start, rule_names, root = payload["pda"]
        pda = Pda(trans=trans, calls=calls, accepting=accepting, has_bytes=has_bytes, state_rule=state_rule,
                  rule_start=rule_start, rule_names=rule_names, root=root)
        index = cls(pda, vocab, payload["grammar"], tuple(payload["approximations"]), precompute=False,
                    reps=payload.get("reps"))
        infos: dict[int, _KeyInfo] = {}  # NOTE: keys sharing one walk share one info
        index._keys = {k: infos.setdefault(id(row), _info(row, esc_rank, esc_at, presorted=True))
                       for k, (row, esc_rank, esc_at) in payload["keys"].items()}
        index._settled = {k: _info(row, esc_rank, esc_at, presorted=True)
                          for k, (row, esc_rank, esc_at) in payload.get("settled", {}).items()}
        if "chains" in payload:  # NOTE: where functools.cached_property keeps `_chains`
            index.__dict__["_chains"] = payload["chains"]
        return index

    def warm(self, configurations: Iterable[int] = ()) -> GrammarIndex:
        """Computes now what the first masks derive on first use, so that they are lookups later
        (say, in a process that rebuilt this index with `from_payload`, before its first request):
        the vocabulary's length table, the network's loop and dead bytes, byte classes
        and counted chains (unless the payload carried them), and the masks of `configurations`
        (configuration ids; the walks their keys need where the payload did not carry them). Fills
        caches only; returns self."""
        self._lengths  # noqa: B018
        self._state_loops  # noqa: B018
        self._state_dead  # noqa: B018
        self._byte_lead  # noqa: B018
        self._chains  # noqa: B018
        for sid in configurations:
            self.mask(sid)
        return self

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the network, the configuration table and the cached rows (approximate)."""
        keys = sum(v.row.nbytes + v.uncertain.nbytes + v.late.nbytes + v.esc_rank.nbytes + v.esc_at.nbytes
                   for v in self._keys.values())
        return int(self.pda.trans.nbytes + self._table.nbytes + keys + sum(r.nbytes for r in self._rows))


def _counted_chains(pda: Pda) -> dict[int, tuple[int, int, bytes]]:
    """States s_1..s_n after the head s_0 of a counted repetition of one byte class B (such as
    ``[ \t\n]{0,20}``): s_k steps to s_k+1 on B, to nowhere from s_n, and every s_k has the same
    rule, end flag, calls and other byte edges as s_0. Maps s_k to (s_0, n - k, B).

    NOTE: from s_k a token whose leading run of B bytes has at most n - k bytes goes exactly as
    from s_0 (both stay in the chain through the run, then step alike); `_chain_key` walks only
    the others."""
    trans = pda.trans
    succ = _chain_links(pda)
    targets = {t for t, _ in succ.values()}
    out: dict[int, tuple[int, int, bytes]] = {}
    for head in succ:
        if head in targets:
            continue
        chain, run_class = [head], succ[head][1]
        while chain[-1] in succ and succ[chain[-1]][1] == run_class and len(chain) <= pda.num_states:
            chain.append(succ[chain[-1]][0])
        last = chain[-1]
        if not (trans[last][list(run_class)] < 0).all():
            continue  # NOTE: not a chain that ends: the shared walk would not hold for its last state
        n = len(chain) - 1
        for k in range(1, n + 1):
            out[chain[k]] = (head, n - k, run_class)
    return out


def _chain_links(pda: Pda) -> dict[int, tuple[int, bytes]]:
    """The links of `_counted_chains`, by increasing state s: s -> (t, B), t the least state
    that s steps to on the bytes B only (B = every byte from s to t) in the same rule, with the
    same end flag and calls, whose row equals s's off B and steps every byte of B to one state
    other than t. Pure."""
    trans, acc, calls, rule = pda.trans, pda.accepting, pda.calls, pda.state_rule
    succ: dict[int, tuple[int, bytes]] = {}
    # candidate links (s, t): t a target of s (ascending per s) in the same rule with the same
    # end flag; then, in chunks, t's row equals s's off the bytes s -> t, and those bytes all
    # step t to one other state
    positions = np.flatnonzero(pda.has_bytes)
    n = pda.num_states
    rows = trans[positions]
    pair = np.unique((np.arange(len(positions), dtype=np.int64)[:, None] * (n + 1) + rows)[rows >= 0])
    src, dst = positions[pair // (n + 1)], pair % (n + 1)
    ok = (dst != src) & (rule[dst] == rule[src]) & (acc[dst] == acc[src])
    src, dst = src[ok], dst[ok]
    for lo in range(0, len(src), 4096):
        s_row, t_row, t = trans[src[lo:lo + 4096]], trans[dst[lo:lo + 4096]], dst[lo:lo + 4096, None]
        in_class = s_row == t
        first = t_row[np.arange(len(t)), in_class.argmax(axis=1)]
        link = (((t_row == s_row) | in_class).all(axis=1) & (~in_class | (t_row == first[:, None])).all(axis=1)
                & (first != t[:, 0]))
        for k in np.flatnonzero(link).tolist():
            a, b = int(src[lo + k]), int(dst[lo + k])
            if a not in succ and calls[a] == calls[b]:
                succ[a] = (b, bytes(np.flatnonzero(in_class[k]).tolist()))
    return succ


def _byte_leads(trans: np.ndarray) -> np.ndarray:
    """(256,) int64: per byte, the first byte of its class of bytes whose columns of `trans`
    (n, 256) are equal: bytes grouped by a random projection of their columns (float BLAS over
    row chunks), then each checked against its group's first byte (a byte that differs leads a
    class of its own: finer classes are still exact). Pure."""
    n = trans.shape[0]
    w = np.asarray(np.random.default_rng(0xB17E5).random(size=n), dtype=np.float64) + 1.0
    h = np.zeros(256)
    for lo in range(0, n, 16384):
        h += w[lo:lo + 16384] @ trans[lo:lo + 16384].astype(np.float64)
    _, first, group = np.unique(h, return_index=True, return_inverse=True)
    lead = first[np.asarray(group).reshape(-1)].astype(np.int64)
    same = np.ones(256, dtype=bool)
    for lo in range(0, n, 16384):
        block = trans[lo:lo + 16384]
        same &= (block == block[:, lead]).all(axis=0)
    return np.where(same, lead, np.arange(256))  # type: ignore[no-any-return]


def walk_representatives(pda: Pda, follow: np.ndarray, leads: np.ndarray | None = None) -> np.ndarray:
    """(num_states,) int32: per state of `pda`, the least state that no byte string tells apart
    from it (the coarsest partition where states alike end their rules alike, with the same
    FOLLOW set, step on every byte to states alike and call the same rules with returns alike;
    Moore rounds: `_coarsest`, `state_classes.refine_classes`). Such states walk every token alike from any
    stack: same configurations up to the states' names, same escapes. Pure.

    NOTE: `follow` is `_follow_sets(pda, ...)` (num_rules, 256); `leads`, where given, is
    `_byte_leads(pda.trans)`."""
    n = pda.num_states
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    first = np.flatnonzero((_byte_leads(pda.trans) if leads is None else leads) == np.arange(256))
    num_rules = len(pda.rule_start)
    cols = np.full((n + 1, len(first) + num_rules), n, dtype=np.int64)  # row n: the dead state
    trans = pda.trans[:, first]
    cols[:n, :len(first)] = np.where(trans >= 0, trans, n)
    for s, calls in enumerate(pda.calls):
        for rule, ret in calls:
            cols[s, len(first) + rule] = ret
    # NOTE: the rules' FOLLOW sets numbered by their bytes (a dict: `np.unique(axis=0)` took ~0.5 ms)
    ids: dict[bytes, int] = {}
    follow_id = np.array([ids.setdefault(row, len(ids)) for row in map(bytes, np.packbits(follow, axis=1))],
                         dtype=np.int64)
    init = np.zeros(n + 1, dtype=np.int64)
    acc = np.flatnonzero(pda.accepting)
    init[acc] = 1 + follow_id[pda.state_rule[acc]]
    init[n] = int(init.max()) + 1
    # NOTE: whole rounds for a small network (free JSON: 68 states, half the time); incremental
    # rounds past it (a few hundred states: 2-3x faster than whole ones)
    cls = (_coarsest(cols, init) if n <= _COARSEST_STATES else refine_classes(cols, init, n, n + 1, history=False)[0])[:n]
    order = np.argsort(cls, kind="stable")
    starts = np.flatnonzero(np.r_[True, cls[order][1:] != cls[order][:-1]])
    least = np.minimum.reduceat(order, starts)
    rep = np.empty(n, dtype=np.int32)
    rep[order] = np.repeat(least, np.diff(np.r_[starts, n]))
    return rep


def _coarsest(cols: np.ndarray, init: np.ndarray) -> np.ndarray:
    """(n,) int64: the coarsest partition of the rows of `cols` (n, k) (`cols[p, j]`: p's successor
    on label j) that refines `init` (n,) and puts rows alike whose successors are alike on every
    label (Moore rounds: a row's class and its successors' classes as one byte string, numbered by
    `np.unique`). Pure.

    NOTE: a few dozen rows (a small network's states): whole rounds of a handful of array calls
    beat `state_classes.refine_classes`' incremental rounds, which win from a few hundred rows."""
    n, k = cols.shape
    sig = np.empty((n, k + 1), dtype=np.int64)
    cls = np.asarray(init, dtype=np.int64)
    num = -1
    while True:
        sig[:, 0] = cls
        np.take(cls, cols, out=sig[:, 1:])
        _, first, inverse = np.unique(sig.view(np.dtype((np.void, 8 * (k + 1)))).reshape(-1), return_index=True,
                                      return_inverse=True)
        cls = inverse.reshape(-1).astype(np.int64)
        if len(first) == num:
            return cls
        num = len(first)


def _run_starts(values: np.ndarray) -> np.ndarray:
    """(len(values),) bool: where a run of equal values starts (the first, and each value unlike
    the one before it). Pure. NOTE: `np.r_[True, a[1:] != a[:-1]]` without `np.r_`'s ~4 us."""
    out = np.empty(len(values), dtype=bool)
    if len(values):
        out[0] = True
        np.not_equal(values[1:], values[:-1], out=out[1:])
    return out


def _expand(lo: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """The concatenated ranges [lo[i], lo[i] + cnt[i]) (int64). Pure."""
    total = int(cnt.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    return (lo - cnt.cumsum() + cnt).repeat(cnt) + np.arange(total)  # type: ignore[no-any-return]


def _distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values of a non-negative int64 array, ascending (marked in a bool array over
    their range when it is small, which beats a sort of many repeats, and a count: ~2-6x; a
    sort for a few values)."""
    if len(values) <= 32:
        return np.unique(values)
    lo, hi = int(values.min()), int(values.max())
    if hi - lo <= 16 * len(values) + 65536:
        seen = np.zeros(hi - lo + 1, dtype=bool)
        seen[values - lo] = True
        return np.flatnonzero(seen) + lo  # type: ignore[no-any-return]
    return np.unique(values)


def _follow_sets(pda: Pda, close: Any) -> np.ndarray:
    """(num_rules, 256) bool: the bytes that may come right after each rule ends (fixpoint over
    call sites; the start rule's own end is followed by nothing)."""
    num_rules = len(pda.rule_start)
    first: dict[int, tuple[np.ndarray, bool]] = {}
    sites: list[list[int]] = [[] for _ in range(num_rules)]
    for calls in pda.calls:
        for rule, ret in calls:
            sites[rule].append(ret)
            if ret not in first:
                config = close([(ret,)])
                tops = sorted({st[-1] for st in config})
                bytes_ = np.asarray((pda.trans[tops] >= 0).any(axis=0)) if tops else np.zeros(256, dtype=bool)
                ends = any(len(st) == 1 and pda.accepting[st[-1]] for st in config)
                first[ret] = (bytes_, ends)
    follow = np.zeros((num_rules, 256), dtype=bool)
    changed = True
    while changed:
        changed = False
        for rule in range(num_rules):
            acc = follow[rule].copy()
            for ret in sites[rule]:
                bytes_, ends = first[ret]
                acc |= bytes_
                if ends:
                    acc |= follow[int(pda.state_rule[ret])]
            if (acc != follow[rule]).any():
                follow[rule] = acc
                changed = True
    return follow
