"""Hugging Face transformers adapters: `vocabulary_from_hf` and `LogitsProcessor` for `generate`.

Imports torch and transformers (install with ``pip install "cfsm[hf]"``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:
    import torch
    import transformers
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('cfsm.hf needs torch and transformers: pip install "cfsm[hf]"') from exc

from cfsm.errors import VocabularyError
from cfsm.grammar import GrammarIndex
from cfsm.guide import Guide, fill_next_token_bitmasks
from cfsm.masks.index import Index
from cfsm.masks.vocab import Vocabulary
from cfsm.torch import apply_token_bitmask_

__all__ = ["vocabulary_from_hf", "make_encoder", "LogitsProcessor"]


# NOTE: pure memoization of a constant (no inputs)
@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-printable-unicode map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoder = backend.decoder
        if decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder):
            return True
        if decoder is not None and ("ByteFallback" in repr(decoder) or "Metaspace" in repr(decoder)):
            return False
    vocab = tokenizer.get_vocab()
    return "Ġ" in "".join(list(vocab)[:5000]) and "▁" not in "".join(list(vocab)[:5000])


def vocabulary_from_hf(tokenizer: Any, *, size: int | None = None,
                       eos_token_ids: Sequence[int] | None = None) -> Vocabulary:
    """Build a `Vocabulary` from a transformers tokenizer. Mutates nothing.

    Handles byte-level BPE (GPT-2 style byte map) and sentencepiece (``▁`` for space,
    ``<0xNN>`` byte-fallback tokens). Special tokens map to ``b""`` and are never allowed;
    added non-special tokens map to their UTF-8 text. `eos_token_ids` defaults to the
    tokenizer's EOS; `size` defaults to the tokenizer length (pass the model's logits width if
    it is larger).
    """
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    special = set(int(i) for i in tokenizer.all_special_ids)
    added = {int(i): tok for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    for i, tok in added.items():
        if getattr(tok, "special", False):
            special.add(i)
    byte_level = _is_byte_level(tokenizer)
    dec = _byte_decoder()
    tokens: list[bytes] = []
    for i, piece in enumerate(pieces):
        if piece is None or i in special:
            tokens.append(b"")
            continue
        if i in added:
            tokens.append(str(added[i]).encode("utf-8"))
            continue
        if byte_level:
            try:
                tokens.append(bytes(dec[c] for c in piece))
            except KeyError:
                tokens.append(piece.encode("utf-8"))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            tokens.append(bytes([int(piece[3:5], 16)]))
        else:
            tokens.append(piece.replace("▁", " ").encode("utf-8"))
    if eos_token_ids is None:
        if tokenizer.eos_token_id is None:
            raise VocabularyError("the tokenizer has no eos_token_id; pass eos_token_ids=[...]")
        eos_token_ids = [int(tokenizer.eos_token_id)]
    return Vocabulary(tokens, eos_token_ids, size=size, special_token_ids=sorted(special))


def make_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """A `str -> token ids` callable without special tokens, for `plan_jump_forward`."""

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    return encode


class LogitsProcessor(transformers.LogitsProcessor):  # type: ignore[misc]
    """Constrains `model.generate` to an `Index` or `GrammarIndex`: one guide per batch row.

    The first call records the prompt length; each later call advances every row's guide with
    the token generated since, then masks disallowed logits to -inf in place. Rows whose guide
    is finished may only produce EOS. A call that does not continue the previous one (a new
    `generate`) starts over. Mutates `scores` and its own guides.
    """

    def __init__(self, index: Index | GrammarIndex) -> None:
        self.index = index
        self.guides: list[Guide] = []
        self._prompt_len = -1
        self._steps = 0
        self._mask: Any = None

    def reset(self) -> None:
        """Forget the guides (the next call starts a new generation). Mutates the processor."""
        self.guides = []
        self._prompt_len = -1

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch = input_ids.shape[0]
        if self._prompt_len >= 0 and (batch != len(self.guides)
                                      or input_ids.shape[1] != self._prompt_len + self._steps + 1):
            self.reset()  # a new generate() call reuses this processor
        if self._prompt_len < 0:
            self._steps = 0
            self._prompt_len = int(input_ids.shape[1])
            self.guides = [Guide(self.index) for _ in range(batch)]
            self._mask = np.zeros((batch, self.index.vocab.mask_words), dtype=np.int32)
        else:
            self._steps += 1
            last = input_ids[:, -1].tolist()
            for guide, tok in zip(self.guides, last, strict=True):
                if not guide.is_finished():
                    guide.advance(int(tok))
        fill_next_token_bitmasks(self.guides, self._mask)
        apply_token_bitmask_(scores, torch.from_numpy(self._mask).to(scores.device))
        return scores
