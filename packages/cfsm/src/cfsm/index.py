"""Token-level `Index`: per DFA state, the allowed tokens (int32 bitmask) and their next states.

Built by walking the vocabulary's byte trie through the DFA: the vocabulary is sorted so every
trie node is a contiguous range; narrow branches descend by binary search, wide ones are walked
for the whole range at once with numpy. Only states reachable at token boundaries are indexed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from cfsm.automaton import Dfa
from cfsm.compressed import CompressedFsm
from cfsm.vocab import TrieTables, Vocabulary

__all__ = ["Index", "build_index"]

# narrow branches (at most this many allowed bytes) descend by binary search
_FEW_BYTES = 6
# ranges at most this long are walked directly
_SMALL_RANGE = 24
# states whose main byte group has at least this many bytes resolve its tokens by a chain lookup
_MIN_GROUP_BYTES = 32
# states whose allowed first bytes start more than this share of the vocabulary walk it whole
_BROAD = 0.15


@dataclass(frozen=True, eq=False)
class Index:
    """Compiled grammar over one vocabulary; shared read-only by every `Guide` made from it.

    - `masks[mask_row[s]]` is the allowed-token bitmask of DFA state `s` (`ceil(V/32)` int32
      words; bit `i % 32` of word `i // 32` is token `i`); states with equal masks share a row.
    - tokens allowed in `s`: `token_ids[indptr[s]:indptr[s + 1]]` (sorted), with next states in
      `next_states` at the same positions. EOS is in the mask of accepting states only.
    """

    vocab: Vocabulary
    dfa: Dfa
    masks: np.ndarray  # (num_rows, ceil(V / 32)) int32
    mask_row: np.ndarray  # (num_states + 1,) int32; -1 for states never reached at a token boundary
    indptr: np.ndarray  # (num_states + 2,) int64
    token_ids: np.ndarray  # (nnz,) int32
    next_states: np.ndarray  # (nnz,) int32
    grammar: str = ""

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

    def next_state(self, state: int, token_id: int) -> int:
        """State after `token_id` from `state`, or `dead` if not allowed (EOS included). Pure."""
        lo, hi = int(self.indptr[state]), int(self.indptr[state + 1])
        if lo == hi:
            return self.dead
        ids = self.token_ids
        k = lo + int(np.searchsorted(ids[lo:hi], token_id))
        if k < hi and ids[k] == token_id:
            return int(self.next_states[k])
        return self.dead

    def allowed_token_ids(self, state: int) -> np.ndarray:
        """Sorted non-EOS token ids allowed in `state` (a view; do not mutate)."""
        return self.token_ids[self.indptr[state] : self.indptr[state + 1]]

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

    @property
    def memory_bytes(self) -> int:
        return int(sum(a.nbytes for a in (self.masks, self.mask_row, self.indptr, self.token_ids, self.next_states)))


def _walk_vectorized(idx: np.ndarray, cur: np.ndarray, j: int, columns: np.ndarray, tflat: np.ndarray,
                     dead: int, out_pos: list[np.ndarray], out_next: list[np.ndarray]) -> None:
    """Walk the tokens at sorted positions `idx` (in states `cur`, `j` bytes read) to their ends."""
    while idx.size:
        b = columns[j, idx]
        end = b < 0
        if end.any():
            out_pos.append(idx[end])
            out_next.append(cur[end])
            keep = ~end
            idx, cur, b = idx[keep], cur[keep], b[keep]
        cur = tflat[cur * 256 + b]
        keep = cur != dead
        idx, cur = idx[keep], cur[keep]
        j += 1


def _walk_all(q: int, stay_flat: np.ndarray, dead: int, tables: TrieTables) -> tuple[np.ndarray, np.ndarray]:
    """Walk every token at once (no compaction): contiguous slices of the length-sorted table."""
    n = len(tables.order)
    cur = np.full(n, q, dtype=np.int32)
    cols = tables.length_columns
    for d, m in enumerate(tables.length_counts.tolist()):
        head = cur[:m]
        head *= 257
        head += cols[d, :m]
        cur[:m] = stay_flat[head]
    alive = np.flatnonzero(cur != dead)
    return tables.by_length[alive].astype(np.int64), cur[alive]


def _walk_state(q: int, dfa: Dfa, tflat: np.ndarray, allowed: list[np.ndarray], chains: list[tuple[np.ndarray, np.ndarray] | None],
                tables: TrieTables, stay_flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted positions, next states) of every token whose bytes survive from state `q`."""
    dead = dfa.dead
    trans = dfa.transitions
    columns = tables.columns
    n = columns.shape[1]
    out_pos: list[np.ndarray] = []
    out_next: list[np.ndarray] = []
    broad = int(tables.first_byte_counts[allowed[q]].sum()) > _BROAD * n
    chain_info = chains[q]
    if chain_info is not None and broad:
        # NOTE: tokens made only of bytes of the state's main byte group P follow a known chain of
        # states (one state per length): one byte-set test and a lookup, no walk.
        outside, chain = chain_info
        bs = tables.byte_sets
        inside = ((bs[0] & outside[0]) | (bs[1] & outside[1]) | (bs[2] & outside[2]) | (bs[3] & outside[3])) == 0
        pos_in = np.flatnonzero(inside)
        lens = tables.lengths[pos_in]
        known = lens < len(chain)
        nxt = chain[lens[known]]
        alive = nxt != dead
        out_pos.append(pos_in[known][alive])
        out_next.append(nxt[alive])
        rest = np.concatenate([np.flatnonzero(~inside), pos_in[~known]])
        _walk_vectorized(rest, np.full(len(rest), q, dtype=np.int32), 0, columns, tflat, dead, out_pos, out_next)
        return np.concatenate(out_pos), np.concatenate(out_next)
    if broad:
        return _walk_all(q, stay_flat, dead, tables)
    stack = [(q, 0, n, 0)]
    while stack:
        q, lo, hi, d = stack.pop()
        col = columns[d, lo:hi]
        if d > 0:
            e = int(np.searchsorted(col, 0))
            if e:
                out_pos.append(np.arange(lo, lo + e, dtype=np.int64))
                out_next.append(np.full(e, q, dtype=np.int32))
                lo += e
                col = col[e:]
                if lo >= hi:
                    continue
        ab = allowed[q]
        if len(ab) == 0:
            continue
        lefts = np.searchsorted(col, ab, "left")
        rights = np.searchsorted(col, ab, "right")
        if len(ab) <= _FEW_BYTES and hi - lo > _SMALL_RANGE:
            for b, left, right in zip(ab.tolist(), lefts.tolist(), rights.tolist(), strict=True):
                if right > left:
                    stack.append((int(trans[q, b]), lo + left, lo + right, d + 1))
            continue
        sizes = rights - lefts
        nz = sizes > 0
        total = int(sizes.sum())
        if total == 0:
            continue
        if total == hi - lo:
            idx = np.arange(lo, hi, dtype=np.int64)
        else:
            # concatenated sub-ranges of the allowed next bytes
            starts, lens = lefts[nz] + lo, sizes[nz]
            offsets = np.cumsum(lens) - lens
            idx = np.repeat(starts - offsets, lens) + np.arange(total, dtype=np.int64)
        _walk_vectorized(idx, np.full(total, q, dtype=np.int32), d, columns, tflat, dead, out_pos, out_next)
    if not out_pos:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    return np.concatenate(out_pos), np.concatenate(out_next)


def _chains(dfa: Dfa, max_len: int) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Per broad state q: (complement of its main byte group P as 4 uint64 words, chain).

    P is the largest set of bytes leading from q to one state; `chain[k]` is the state after any
    k bytes of P, for every k < len(chain) (the chain stops where P's bytes stop agreeing).
    """
    trans = dfa.transitions
    dead = dfa.dead
    out: list[tuple[np.ndarray, np.ndarray] | None] = []
    for q in range(trans.shape[0]):
        row = trans[q]
        if q == dead:
            out.append(None)
            continue
        counts = np.bincount(row, minlength=trans.shape[0])
        counts[dead] = 0
        main = int(counts.argmax())
        if counts[main] < _MIN_GROUP_BYTES:
            out.append(None)
            continue
        group = np.flatnonzero(row == main)
        chain = [q, main]
        while len(chain) <= max_len:
            cur = chain[-1]
            if cur == dead:
                chain.extend([dead] * (max_len + 1 - len(chain)))
                break
            nxt = trans[cur, group]
            if not (nxt == nxt[0]).all():
                break
            if int(nxt[0]) == cur:  # a self-loop: the chain stays here
                chain.extend([cur] * (max_len + 1 - len(chain)))
                break
            chain.append(int(nxt[0]))
        member = np.zeros(256, dtype=bool)
        member[group] = True
        words = np.packbits(~member, bitorder="little").view("<u8").astype(np.uint64)
        out.append((words, np.asarray(chain, dtype=np.int32)))
    return out


def build_index(dfa: Dfa, vocab: Vocabulary, grammar: str = "") -> Index:
    """Compile `dfa` against `vocab` into an `Index`. Mutates nothing (caches vocab tables)."""
    tables = vocab.trie_tables
    num_states = dfa.num_states
    trans = dfa.transitions
    tflat = trans.reshape(-1)
    dead = dfa.dead
    live = trans != dead
    allowed = [np.flatnonzero(live[s]).astype(np.int16) for s in range(num_states + 1)]
    chains = _chains(dfa, int(tables.lengths.max()) if len(tables.lengths) else 0)
    # a 257th column: "past the end of the token" keeps the state
    stay_flat = np.hstack([trans, np.arange(num_states + 1, dtype=np.int32)[:, None]]).reshape(-1)
    by_token = np.full(vocab.size, -1, dtype=np.int32)
    words = vocab.mask_words
    eos = np.asarray(vocab.eos_token_ids, dtype=np.int64)

    per_state: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    queue = [dfa.start]
    seen = np.zeros(num_states + 1, dtype=bool)
    seen[dfa.start] = True
    seen[dead] = True
    while queue:
        s = queue.pop()
        pos, nxt = _walk_state(s, dfa, tflat, allowed, chains, tables, stay_flat)
        tids = tables.order[pos]
        if len(tids) > 2048:
            by_token[tids] = nxt
            tids = np.flatnonzero(by_token >= 0).astype(np.int32)
            nxt = by_token[tids]
            by_token[tids] = -1
        else:
            order = np.argsort(tids, kind="stable")
            tids, nxt = tids[order], nxt[order]
        per_state[s] = (tids, nxt)
        fresh = nxt[~seen[nxt]]
        if len(fresh):
            fresh = np.unique(fresh)
            seen[fresh] = True
            queue.extend(fresh.tolist())

    mask_row = np.full(num_states + 1, -1, dtype=np.int32)
    rows: dict[bytes, int] = {}
    row_list: list[np.ndarray] = []
    indptr = np.zeros(num_states + 2, dtype=np.int64)
    counts = np.zeros(num_states + 1, dtype=np.int64)
    bits = np.zeros(words * 32, dtype=bool)
    for s, (tids, _) in per_state.items():
        counts[s] = len(tids)
        # equal (token set, accepting) means equal masks: key on the token ids, pack once per row
        key = tids.tobytes() + (b"A" if dfa.accepting[s] else b"N")
        r = rows.get(key)
        if r is None:
            bits[:] = False
            bits[tids] = True
            if dfa.accepting[s]:
                bits[eos] = True
            r = rows[key] = len(row_list)
            row_list.append(np.packbits(bits, bitorder="little").view("<i4").astype(np.int32))
        mask_row[s] = r
    indptr[1:] = np.cumsum(counts)
    token_ids = np.empty(int(indptr[-1]), dtype=np.int32)
    next_states = np.empty(int(indptr[-1]), dtype=np.int32)
    for s, (tids, nxt) in per_state.items():
        token_ids[indptr[s] : indptr[s + 1]] = tids
        next_states[indptr[s] : indptr[s + 1]] = nxt
    masks = np.stack(row_list) if row_list else np.zeros((0, words), dtype=np.int32)
    return Index(vocab=vocab, dfa=dfa, masks=masks, mask_row=mask_row, indptr=indptr,
                 token_ids=token_ids, next_states=next_states, grammar=grammar)
