"""`GrammarGuide`: the per-request cursor over a shared `GrammarIndex` (the `cfsm.Guide` interface)."""

from __future__ import annotations

import numpy as np

from cfsm.compressed import utf8_prefix
from cfsm.grammar.index import GrammarIndex
from cfsm.guide import Guide

__all__ = ["GrammarGuide"]


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
