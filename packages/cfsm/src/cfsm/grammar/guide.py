"""`GrammarGuide`: the per-request cursor over a shared `GrammarIndex` (the `cfsm.Guide` interface)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cfsm.compressed import JumpPlan, utf8_prefix
from cfsm.errors import RejectedTokenError
from cfsm.grammar.index import GrammarIndex
from cfsm.guide import Guide

__all__ = ["GrammarGuide"]


class GrammarGuide(Guide):
    """Tracks one generation through a `GrammarIndex`; same methods as `cfsm.Guide`.

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

    @property
    def state(self) -> int:
        return self._state

    @property
    def eos_accepted(self) -> bool:
        return self._finished

    @property
    def num_tokens(self) -> int:
        return len(self._history)

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

    def advance(self, token_id: int) -> None:
        """Accept `token_id`; raises `RejectedTokenError` (state unchanged) if it is not allowed."""
        idx = self.index
        if self._finished:
            raise RejectedTokenError(token_id, self._state, "the guide is finished (EOS was accepted)")
        if token_id in idx.vocab.eos_token_ids:
            if not idx.can_end(self._state):
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
        """Accept tokens in order; on a rejected token, earlier ones stay accepted."""
        for t in token_ids:
            self.advance(int(t))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._history)} accepted")
        for _ in range(num_tokens):
            self._state = self._history.pop()
            self._finished = False

    def is_finished(self) -> bool:
        """True after EOS, or when the grammar is complete and no token can follow."""
        if self._finished:
            return True
        return self.index.can_end(self._state) and not self.index.has_tokens(self._state)

    def can_stop(self) -> bool:
        """True when the text so far is a complete match (EOS is allowed)."""
        return self._finished or self.index.can_end(self._state)

    def has_tokens(self) -> bool:
        """Whether some non-EOS token may follow. Pure (fills the index's caches)."""
        return not self._finished and self.index.has_tokens(self._state)

    def copy(self) -> GrammarGuide:
        g = GrammarGuide(self.index)
        g._state = self._state
        g._history = list(self._history)
        g._finished = self._finished
        return g

    def jump_forward(self) -> str | None:
        """The string forced from the current configuration (complete UTF-8 characters, across
        rule boundaries), or None."""
        if self._finished:
            return None
        forced = self.index.forced_bytes(self._state)
        text = utf8_prefix(forced) if forced else ""
        return text or None

    def apply_jump(self, plan: JumpPlan) -> None:
        """Roll back and append the tokens of a `plan_jump_forward` plan. Mutates state."""
        self.rollback(plan.num_rollback)
        self.advance_many(plan.token_ids)
