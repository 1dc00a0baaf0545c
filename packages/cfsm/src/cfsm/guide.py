"""`Guide`: the per-request cursor over a shared `Index` (mask, advance, rollback, jump-forward);
`GrammarGuide`: the same cursor over a pushdown `GrammarIndex` (`Guide(index)` makes one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cfsm.errors import RejectedTokenError
from cfsm.grammar.index import GrammarIndex
from cfsm.masks.compressed import JumpPlan, utf8_prefix
from cfsm.masks.index import Index

__all__ = ["GrammarGuide", "Guide", "fill_next_token_bitmasks"]


class Guide:
    """Tracks one generation through an `Index`. Cheap to create and copy; not thread-safe.

    `Guide(grammar_index)` for a `cfsm.GrammarIndex` (a context-free grammar) makes a
    `cfsm.GrammarGuide`, a subclass with the same methods.

    The state is the DFA state after every accepted token; `rollback` restores earlier states.
    After an EOS token is accepted the guide is finished and only EOS stays allowed.
    """

    __slots__ = ("index", "_state", "_history", "_finished")

    def __new__(cls, index: Index | GrammarIndex | None = None, *args: Any) -> Guide:
        # NOTE: a context-free grammar's index gets its pushdown guide (same methods), so every
        # caller of Guide(index) takes both kinds of compiled grammar (no index: copy / pickle)
        if cls is Guide and index is not None and not isinstance(index, Index):
            return object.__new__(GrammarGuide)
        return object.__new__(cls)

    index: Index

    def __init__(self, index: Index | GrammarIndex) -> None:
        assert isinstance(index, Index)  # NOTE: a GrammarIndex makes a GrammarGuide (`__new__`)
        self.index = index
        self._state = index.start
        self._history: list[int] = []
        self._finished = False

    @property
    def state(self) -> int:
        return self._state

    @property
    def eos_accepted(self) -> bool:
        """True once EOS was accepted (the mask is then the EOS mask); a rollback clears it."""
        return self._finished

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far (EOS included)."""
        return len(self._history)

    def fill_mask(self, out: np.ndarray, row: int = 0) -> None:
        """Write the allowed-token bitmask into `out[row]` (int32, ceil(V/32) words). Mutates `out`."""
        idx = self.index
        if self._finished:
            out[row] = idx.eos_mask
        else:
            out[row] = idx.masks[idx.mask_row[self._state]]

    def allowed_token_ids(self) -> np.ndarray:
        """Allowed token ids (EOS included where the grammar may stop), sorted. Pure."""
        idx = self.index
        eos = np.asarray(idx.vocab.eos_token_ids, dtype=np.int32)
        if self._finished:
            return eos
        ids = idx.allowed_token_ids(self._state)
        if idx.is_accepting(self._state):
            ids = np.union1d(ids, eos).astype(np.int32)
        return ids

    def advance(self, token_id: int) -> None:
        """Accept `token_id`; raises `RejectedTokenError` (state unchanged) if it is not allowed.

        Mutates the guide's state and history.
        """
        idx = self.index
        if self._finished:
            raise RejectedTokenError(token_id, self._state, "the guide is finished (EOS was accepted)")
        if token_id in idx.vocab.eos_token_ids:
            if not idx.is_accepting(self._state):
                raise RejectedTokenError(token_id, self._state, "EOS before the grammar is complete")
            self._history.append(self._state)
            self._finished = True
            return
        nxt = idx.next_state(self._state, token_id)
        if nxt == idx.dead:
            raise RejectedTokenError(token_id, self._state)
        self._history.append(self._state)
        self._state = nxt

    def advance_many(self, token_ids: Sequence[int]) -> None:
        """Accept tokens in order; on a rejected token, earlier ones stay accepted. Mutates state."""
        for t in token_ids:
            self.advance(int(t))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens. Mutates state and history."""
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._history)} accepted")
        for _ in range(num_tokens):
            self._state = self._history.pop()
            self._finished = False

    def is_finished(self) -> bool:
        """True after EOS, or when the grammar is complete and nothing can follow."""
        if self._finished:
            return True
        s = self._state
        return self.index.is_accepting(s) and not self.index.has_tokens(s)

    def can_stop(self) -> bool:
        """True when the text so far is a complete match (EOS is allowed)."""
        return self._finished or self.index.is_accepting(self._state)

    def has_tokens(self) -> bool:
        """Whether some non-EOS token may follow (False once EOS was accepted). Pure."""
        idx = self.index
        return not self._finished and int(idx.mask_row[self._state]) >= 0 and idx.has_tokens(self._state)

    def copy(self, history: bool = True) -> Guide:
        """An independent guide at the same state, sharing the read-only `Index`; without `history` it cannot roll
        back past this state (a copy in O(1): e.g. one per row of a speculative verify step)."""
        g = Guide(self.index)
        g._state = self._state
        g._history = list(self._history) if history else []
        g._finished = self._finished
        return g

    def jump_forward(self) -> str | None:
        """The string forced from the current state (complete UTF-8 characters), or None. Pure."""
        if self._finished:
            return None
        forced, _ = self.index.compressed.edge(self._state)
        text = utf8_prefix(forced) if forced else ""
        return text or None

    def apply_jump(self, plan: JumpPlan) -> None:
        """Roll back and append the tokens of a `plan_jump_forward` plan. Mutates state."""
        self.rollback(plan.num_rollback)
        self.advance_many(plan.token_ids)


def fill_next_token_bitmasks(guides: Sequence[Guide], out: np.ndarray,
                             rows: Sequence[int] | None = None) -> None:
    """Fill `out[rows[i]]` from `guides[i]` (rows default to 0..n-1). Mutates `out`.

    `Guide`s over the same `Index` are filled with one gather.
    """
    rows = list(range(len(guides))) if rows is None else list(rows)
    if not guides:
        return
    first = guides[0].index
    if isinstance(first, Index) and all(g.index is first and not g._finished for g in guides):
        out[rows] = first.masks[first.mask_row[[g.state for g in guides]]]
        return
    for g, r in zip(guides, rows, strict=True):
        g.fill_mask(out, r)


class GrammarGuide(Guide):
    """Tracks one generation through a `GrammarIndex`; same methods as `cfsm.Guide` (the state
    machinery, advance, rollback and stop checks are Guide's, over the index's `is_accepting`);
    masks, `has_tokens` and jump-forward are the pushdown index's.

    `state` is the parser configuration id after every accepted token (equal ids: equal masks);
    `rollback` restores earlier ones. After EOS only EOS stays allowed. Not thread-safe.
    """

    __slots__ = ()
    index: GrammarIndex  # type: ignore[assignment]

    def __init__(self, index: GrammarIndex) -> None:  # type: ignore[override]
        self.index = index
        self._state = index.start
        self._history: list[int] = []
        self._finished = False

    def fill_mask(self, out: np.ndarray, row: int = 0) -> None:
        """Write the allowed-token bitmask into `out[row]` (int32, ceil(V/32) words). Mutates `out`."""
        out[row] = self._eos_mask() if self._finished else self.index.mask(self._state)

    def _eos_mask(self) -> np.ndarray:
        vocab = self.index.vocab
        row = np.zeros(vocab.mask_words, dtype=np.uint32)
        for e in vocab.eos_token_ids:
            row[e >> 5] |= np.uint32(1 << (e & 31))
        return row.view(np.int32)

    def allowed_token_ids(self) -> np.ndarray:
        """Allowed token ids (EOS included where the grammar may stop), sorted. Pure."""
        vocab = self.index.vocab
        if self._finished:
            return np.asarray(vocab.eos_token_ids, dtype=np.int32)
        bits = np.unpackbits(self.index.mask(self._state).view(np.uint8), bitorder="little")[: vocab.size]
        return np.flatnonzero(bits).astype(np.int32)

    def has_tokens(self) -> bool:
        """Whether some non-EOS token may follow. Pure (fills the index's caches)."""
        return not self._finished and self.index.has_tokens(self._state)

    def jump_forward(self) -> str | None:
        """The string forced from the current configuration (complete UTF-8 characters, across
        rule boundaries), or None."""
        if self._finished:
            return None
        forced = self.index.forced_bytes(self._state)
        text = utf8_prefix(forced) if forced else ""
        return text or None
