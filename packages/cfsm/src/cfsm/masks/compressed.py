"""Compressed FSM: chains of singular transitions merged into forced strings (jump-forward).

A DFA state is *singular* when it is not accepting and exactly one byte leads on; from it the
output is forced until a state with a choice (or an accepting one). `plan_jump_forward`
retokenizes "text so far + forced string" so token boundaries match what the tokenizer would
produce (SGLang paper, appendix B.1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cfsm.automata.automaton import Dfa
from cfsm.masks.vocab import Vocabulary

__all__ = ["CompressedFsm", "JumpPlan", "plan_jump_forward", "utf8_prefix"]


class CompressedFsm:
    """Forced strings of a DFA, computed lazily per state and memoized (the only mutation)."""

    def __init__(self, dfa: Dfa) -> None:
        self.dfa = dfa
        live = dfa.transitions != dfa.dead
        counts = live.sum(axis=1)
        single = (counts == 1) & ~dfa.accepting
        single[dfa.dead] = False
        self._single_byte = np.where(single, live.argmax(axis=1), -1).astype(np.int32)
        self._memo: dict[int, tuple[bytes, int]] = {}

    def singular_byte(self, state: int) -> int:
        """The one byte allowed in `state`, or -1 if the state has a choice or may stop."""
        return int(self._single_byte[state])

    def edge(self, state: int) -> tuple[bytes, int]:
        """(forced bytes, state after them) from `state`; (b"", state) if nothing is forced."""
        hit = self._memo.get(state)
        if hit is not None:
            return hit
        chain: list[tuple[int, int]] = []
        s = state
        trans = self.dfa.transitions
        limit = self.dfa.num_states + 1
        while len(chain) < limit:
            b = int(self._single_byte[s])
            if b < 0 or s in self._memo:
                break
            chain.append((s, b))
            s = int(trans[s, b])
        tail, end = self._memo.get(s, (b"", s))
        for st, b in reversed(chain):
            tail = bytes([b]) + tail
            self._memo[st] = (tail, end)
        self._memo.setdefault(state, (tail, end))
        return self._memo[state]

    def edges(self) -> dict[int, tuple[bytes, int]]:
        """Every compressed edge: chain head state -> (forced bytes, end state)."""
        heads = np.flatnonzero(self._single_byte >= 0)
        return {int(s): self.edge(int(s)) for s in heads}


def utf8_prefix(data: bytes) -> str:
    """The longest prefix of `data` that is complete UTF-8, decoded."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return data[: exc.start].decode("utf-8")


@dataclass(frozen=True)
class JumpPlan:
    """Roll back `num_rollback` tokens, then append `token_ids` (the forced text retokenized)."""

    num_rollback: int
    token_ids: tuple[int, ...]


def _greedy_tokens(data: bytes, vocab: Vocabulary) -> list[int]:
    """Longest-match tokenization of `data` over the vocabulary's byte strings (fallback)."""
    table: dict[bytes, int] = {}
    for i, t in enumerate(vocab.tokens):
        if t and i not in vocab.special_token_ids:
            table.setdefault(t, i)
    max_len = max((len(t) for t in table), default=1)
    out: list[int] = []
    i = 0
    while i < len(data):
        for k in range(min(max_len, len(data) - i), 0, -1):
            tid = table.get(data[i : i + k])
            if tid is not None:
                out.append(tid)
                i += k
                break
        else:
            raise ValueError(f"byte {data[i]:#x} has no token in the vocabulary")
    return out


def plan_jump_forward(token_ids: Sequence[int], forced: str, vocab: Vocabulary,
                      encode: Callable[[str], list[int]], window: int = 6) -> JumpPlan:
    """Retokenize the last `window` tokens plus `forced`. Mutates nothing.

    `encode` must tokenize text without special tokens and without adding a prefix space
    (`cfsm.hf.make_encoder`). The returned tokens spell exactly the bytes of the rolled-back
    tokens followed by `forced`; if the tokenizer cannot reproduce them (for example a
    sentencepiece prefix space), fewer tokens are rolled back, down to a plain append. Raises
    ValueError when `forced` has a byte no token of the vocabulary spells.
    """
    forced_bytes = forced.encode("utf-8")
    for k in range(min(window, len(token_ids)), -1, -1):
        tail = list(token_ids[len(token_ids) - k :]) if k else []
        tail_bytes = vocab.decode(tail)
        try:
            text = (tail_bytes + forced_bytes).decode("utf-8")
        except UnicodeDecodeError:
            continue
        new = encode(text)
        if vocab.decode(new) != tail_bytes + forced_bytes:
            continue
        common = 0
        while common < min(len(tail), len(new)) and tail[common] == new[common]:
            common += 1
        return JumpPlan(num_rollback=k - common, token_ids=tuple(new[common:]))
    return JumpPlan(num_rollback=0, token_ids=tuple(_greedy_tokens(forced_bytes, vocab)))
