"""Token-level `Index`: per DFA state, the allowed tokens as an int32 bitmask row.

Built by walking the vocabulary through the DFA, never token by state one at a time:
- states share one walk when they allow the same tokens of up to `IndexTuning.share_depth` bytes for
  sure (`state_classes`: they agree on every string as long as their longest candidate); the
  few longer tokens are walked for every state in one batch;
- the vocabulary is sorted by bytes, so every trie node is a contiguous range (`walker`,
  `walks`): states with few candidates are walked together in batches, narrow ones descend by
  binary search, broad ones resolve the tokens made only of their main byte group by a chain
  lookup (string text, counted repeats) as a prefix of a shared length-sorted list and start
  the walks of the others at their first byte outside the group;
- rows are packed once per distinct token set (`mask_rows`) and equal rows are stored once.
  The next state of a token is its bytes walked through the DFA.
A small DFA whose tokens die within a few bytes skips all that: its states walk the trie together
(`tiny`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cfsm.automata.automaton import Dfa, small_unique, unique_rows
from cfsm.automata.json_automata import f_automaton
from cfsm.config import IndexTuning
from cfsm.errors import Approximation
from cfsm.masks.compressed import CompressedFsm
from cfsm.masks.fragments import FragmentMatch, fragment_rows, match_fragment
from cfsm.masks.loops import find_loops
from cfsm.masks.rows import PrefixRows, few_rows, or_bits, pack_rows, token_weights
from cfsm.masks.state_classes import walk_classes
from cfsm.masks.templates import match_string_states, string_rows
from cfsm.masks.tiny import tiny_rows
from cfsm.masks.vocab import Vocabulary
from cfsm.masks.walker import Walker

__all__ = ["Index", "build_index"]

# token sets up to this size are packed by scattering bits (larger ones through a bool array)
_SPARSE_ROW = 2048
# JSON string states take their masks from the vocabulary's string tables (`templates`), states
# of broad `format` strings (email, uri) theirs from its fragment tables (`fragments`), unless
# `IndexTuning` says otherwise; walk classes (Moore rounds over the whole DFA) are computed only
# when at least `IndexTuning.classes_min_broad` of the other states have more candidates than a
# batched walk takes: few-candidate states are walked together in batches anyway, and the rounds
# cost more than they save there


@dataclass(frozen=True, eq=False)
class Index:
    """Compiled grammar over one vocabulary; shared read-only by every `Guide` made from it.

    `masks[mask_row[s]]` is the allowed-token bitmask of DFA state `s` (`ceil(V/32)` int32 words;
    bit `i % 32` of word `i // 32` is token `i`); states with equal masks share a row; EOS is set
    in the masks of accepting states. `mask_row[s]` is -1 for states never reached at a token
    boundary. The next state of an allowed token is its bytes walked through `dfa`.
    """

    vocab: Vocabulary
    dfa: Dfa
    masks: np.ndarray  # (num_rows, ceil(V / 32)) int32
    mask_row: np.ndarray  # (num_states + 1,) int32
    grammar: str = ""
    # what the grammar over-approximates (JSON Schema keywords it cannot enforce exactly)
    approximations: tuple[Approximation, ...] = ()

    @property
    def start(self) -> int:
        return self.dfa.start

    @property
    def dead(self) -> int:
        return self.dfa.dead

    @property
    def num_states(self) -> int:
        """States reached at token boundaries (the ones with a mask)."""
        return int((self.mask_row >= 0).sum())

    def is_accepting(self, state: int) -> bool:
        return bool(self.dfa.accepting[state])

    def is_allowed(self, state: int, token_id: int) -> bool:
        """Whether the mask of `state` has `token_id` (EOS included). Pure."""
        row = int(self.mask_row[state])
        if row < 0 or not 0 <= token_id < self.vocab.size:
            return False
        return bool((int(self.masks[row, token_id >> 5]) >> (token_id & 31)) & 1)

    def next_state(self, state: int, token_id: int) -> int:
        """State after non-EOS `token_id` from `state`, or `dead` if not allowed. Pure."""
        if not self.is_allowed(state, token_id) or token_id in self.vocab.special_token_ids:
            return self.dead
        return self.dfa.walk(state, self.vocab.tokens[token_id])

    def allowed_token_ids(self, state: int) -> np.ndarray:
        """Sorted non-EOS token ids allowed in `state`. Pure."""
        bits = np.unpackbits(self.mask(state).view(np.uint8), bitorder="little")[: self.vocab.size]
        ids = np.flatnonzero(bits).astype(np.int32)
        return ids[~np.isin(ids, self.vocab.eos_token_ids)]

    def has_tokens(self, state: int) -> bool:
        """Whether any non-EOS token is allowed in `state`. Pure."""
        return bool(self._row_has_tokens[int(self.mask_row[state])])

    @functools.cached_property
    def _row_has_tokens(self) -> np.ndarray:
        words = self.masks.view(np.uint32).copy()
        for e in self.vocab.eos_token_ids:
            words[:, e >> 5] &= np.uint32(~(1 << (e & 31)) & 0xFFFFFFFF)
        return (words != 0).any(axis=1)

    def mask(self, state: int) -> np.ndarray:
        """The bitmask row of `state` (a view; do not mutate)."""
        row = int(self.mask_row[state])
        if row < 0:
            raise ValueError(f"state {state} is never reached at a token boundary")
        return self.masks[row]

    @functools.cached_property
    def compressed(self) -> CompressedFsm:
        """Forced strings (jump-forward edges) of the DFA, built on first use."""
        return CompressedFsm(self.dfa)

    @functools.cached_property
    def eos_mask(self) -> np.ndarray:
        """Bitmask allowing EOS only (the mask of a finished guide)."""
        bits = np.zeros(self.vocab.mask_words * 32, dtype=bool)
        bits[list(self.vocab.eos_token_ids)] = True
        return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)

    def warm(self) -> Index:
        """Computes now what this index builds on first use (the forced-string table of
        `compressed`, the per-row token flags of `has_tokens`, `eos_mask`: tens of ms for a DFA of
        30k states), so that a guide's first steps are lookups. Fills caches only; returns self."""
        self.compressed  # noqa: B018
        self._row_has_tokens  # noqa: B018
        self.eos_mask  # noqa: B018
        return self

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the mask rows, the state map and the DFA."""
        return int(self.masks.nbytes + self.mask_row.nbytes + self.dfa.transitions.nbytes)


def _f_code(fmt: str) -> np.ndarray | None:
    """The F table that `direct`'s block maps were proven against (the one of the format's tables)."""
    auto = f_automaton(fmt)
    return None if auto is None else auto[0]


def _long_rows(owner: np.ndarray, ids: np.ndarray, mask_row: np.ndarray, row_list: list[np.ndarray], words: int,
               intern: Callable[[np.ndarray], int], num_ids: int) -> None:
    """Add the long tokens `ids` (grouped by `owner` state) to their states' rows: each distinct
    (row, token set) once (whitespace states share both), the sets told apart by two sums of
    random per-token weights and their size (as `mask_rows.few_rows`; `num_ids` the weights' size)."""
    states, group = small_unique(owner)
    starts = np.flatnonzero(np.diff(group, prepend=-1) != 0)
    w1, w2 = token_weights(num_ids)
    key = np.stack([mask_row[states].astype(np.uint64), np.add.reduceat(w1[ids], starts),
                    np.add.reduceat(w2[ids], starts), np.diff(np.append(starts, len(ids))).astype(np.uint64)], axis=1)
    first, inverse = unique_rows(key)
    # the pairs of each distinct (row, set)'s first state
    sel = np.isin(group, first)
    remap = np.full(len(states), -1, dtype=np.int64)
    remap[first] = np.arange(len(first))
    need, base_idx = np.unique(mask_row[states[first]], return_inverse=True)  # the rows they start from
    base = np.concatenate([row_list[r] for r in need.tolist()]).reshape(len(need), words).view(np.uint32)
    rows = pack_rows(len(first), remap[group[sel]], ids[sel], words, intern, base, base_idx.reshape(-1))
    mask_row[states] = rows[inverse]


def build_index(dfa: Dfa, vocab: Vocabulary, grammar: str = "", tuning: IndexTuning | None = None) -> Index:
    """Compile `dfa` against `vocab` into an `Index`. Mutates nothing (caches vocab tables).

    States that agree on every string of at most `tuning.share_depth` bytes share one walk for
    the tokens of that length; the few longer tokens are walked for every state in one batch.
    Every live state gets a mask row. `tuning` (`IndexTuning`) picks the paths, not the masks.
    """
    tuning = tuning or IndexTuning()
    if 0 < dfa.num_states <= tuning.tiny_states:
        tiny = tiny_rows(dfa, vocab, tuning.tiny_pairs)
        if tiny is not None:
            return Index(vocab=vocab, dfa=dfa, masks=tiny[0], mask_row=tiny[1], grammar=grammar)
    share_depth = tuning.share_depth
    tables = vocab.trie_tables
    num_states = dfa.num_states
    walker = Walker(dfa, tables, tuning)
    words = vocab.mask_words
    eos = np.asarray(vocab.eos_token_ids, dtype=np.int64)
    if tuning.string_tables:
        match = match_string_states(dfa, vocab.string_tables, tuning.string_passes)
        generic = match.t[:num_states] < 0
    else:
        generic = np.ones(num_states, dtype=bool)
    fragments: list[tuple[int, FragmentMatch, np.ndarray]] = []
    if tuning.fragment_tables:
        # NOTE: a DFA of the direct construction knows its format states (`direct`: copies of a
        # format's block, proven to step like F); states it does not name are walked (exact too)
        proven = None if dfa.facts is None else dfa.facts.fragment_states
        for k, ft in enumerate(vocab.fragment_tables):
            if proven is None or ft.code is not _f_code(ft.name):
                fm = match_fragment(dfa, ft)
            elif ft.name in proven:
                fm = FragmentMatch(*proven[ft.name])
            else:
                continue
            mine = np.flatnonzero(generic & (fm.f[:num_states] >= 0))
            if len(mine):
                generic[mine] = False
                fragments.append((k, fm, mine))
    others = np.flatnonzero(generic)
    num_cands = walker.num_candidates(others)
    # NOTE: states looping on whitespace walk only the tokens whose first byte past it they allow
    loops = find_loops(dfa, tables, others, tuning.loop_min_tokens)
    if loops is not None:
        num_cands[np.searchsorted(others, loops.states)] = loops.candidates(np.arange(len(loops.states)))
    shared = walker.num_broad(others, num_cands) >= tuning.classes_min_broad
    if shared:
        classes = walk_classes(dfa, tables, share_depth)
        _, first, class_of = np.unique(classes[others], return_index=True, return_inverse=True)
        reps, rep_cands = others[first], num_cands[first]
    else:  # every state its own walk
        reps, class_of, rep_cands = others, np.arange(len(others)), num_cands
    is_long = tables.longer_than(share_depth)
    eos32 = eos.astype(np.int32)
    small_rows: dict[bytes, int] = {}
    row_list: list[np.ndarray] = []
    bits = np.zeros(0, dtype=bool)  # the broad rows' bool array, made on first use
    rows: dict[bytes, int] = {}

    def intern(row: np.ndarray) -> int:
        key = row.tobytes()
        r = rows.get(key)
        if r is None:
            r = rows[key] = len(row_list)
            row_list.append(row.view(np.int32))
        return r

    def sparse_row(tids: np.ndarray) -> np.ndarray:
        row = np.zeros(words, dtype=np.uint32)
        or_bits(row, tids)
        return row

    # one row per class (acceptance, hence EOS, is the same in the whole class)
    class_row = np.empty(len(reps), dtype=np.int32)
    few, owner, pos = walker.walk_few(reps.astype(np.int64), rep_cands, loops)
    only_done = None  # loop states whose rows hold every token made only of loop bytes
    if few.any():
        base = None
        if loops is not None:  # the loop states' tokens made only of loop bytes: one row per loop set
            at = loops.row[reps]
            # NOTE: without shared walks a row is its state's alone: the long ones too
            base = (np.where(at >= 0, loops.group[np.maximum(at, 0)], -1),
                    loops.only_ids(is_long if shared else None, tables.order))
            if not shared:
                only_done = np.zeros(len(loops.states), dtype=bool)
                only_done[at[few & (at >= 0)]] = True
        few_rows(few, owner, pos, reps, dfa.accepting, tables.order, is_long, eos32, class_row, intern, words,
                  tables.max_id, base)
    prefix_rows = PrefixRows(tables.order, is_long, words)
    for k in np.flatnonzero(~few).tolist():
        rep = int(reps[k])
        prefix, pos = walker.walk(rep)
        tids = tables.order[pos[~is_long[pos]]]
        if dfa.accepting[rep]:
            tids = np.concatenate([tids, eos32])
        if prefix is not None:
            row = prefix_rows.row(prefix).copy()
            or_bits(row, tids)
            r = intern(row)
        elif len(tids) <= _SPARSE_ROW:  # keyed by the sorted ids: equal sets are packed once
            key = np.sort(tids).tobytes()
            hit = small_rows.get(key)
            r = small_rows[key] = intern(sparse_row(tids)) if hit is None else hit
        else:
            if len(bits):
                bits[:] = False
            else:
                bits = np.zeros(words * 32, dtype=bool)
            bits[tids] = True
            r = intern(np.packbits(bits, bitorder="little").view("<u4").copy())
        class_row[k] = r
    mask_row = np.full(num_states + 1, -1, dtype=np.int32)
    mask_row[others] = class_row[class_of.reshape(-1)]
    # the few tokens longer than `share_depth` bytes, walked for every state in one batch
    l_owner, l_ids = walker.walk_long(share_depth, generic, loops, only_done)
    if len(l_owner):
        _long_rows(l_owner, l_ids, mask_row, row_list, words, intern, max(tables.max_id, int(eos.max())) + 1)
    if tuning.string_tables:
        string_rows(dfa, vocab.string_tables, match, intern, mask_row)
    for k, fm, mine in fragments:
        fragment_rows(dfa, vocab.fragment_tables[k], fm, mine, intern, mask_row)
    # NOTE: one concatenation of the 1-D rows (np.stack pays a reshape per row)
    masks = np.concatenate(row_list).reshape(len(row_list), words) if row_list else np.zeros((0, words), np.int32)
    return Index(vocab=vocab, dfa=dfa, masks=masks, mask_row=mask_row, grammar=grammar)
