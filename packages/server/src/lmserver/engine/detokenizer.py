"""Incremental detokenization and stop-string handling.

`IncrementalDetokenizer` emits only text that is final: it decodes a short window of tokens and
holds back output ending in an incomplete UTF-8 sequence ("\\ufffd"), so for byte-level BPE the
concatenated stream equals `tokenizer.decode(all_ids)`.

`OutputText` adds the stop logic on top: stop strings found across token boundaries (the text
is trimmed at the match), `stop_regex`, and a hold-back of any suffix that could still become a
stop string, so no emitted character is ever taken back.
"""

from __future__ import annotations

import re
from typing import Any

# prompt tokens decoded in front of the output, so tokenizers that drop a leading space at the
# start of a decode (SentencePiece) produce the same text as a full decode
_SURROUND = 5


def backend_decoder(tokenizer: Any) -> Any | None:
    """The Rust `tokenizers.Tokenizer` behind a transformers fast tokenizer when decoding through it
    gives exactly `tokenizer.decode(ids, skip_special_tokens=...)`: no clean-up of tokenization
    spaces (which transformers applies on top). None otherwise (slow tokenizers, other objects).

    Decoding through it skips transformers' per-call conversions (`to_py_obj` walks the id list):
    3.6x less host time per generated token, 5.6 -> 1.6 us on the 2-core dev CPU
    (benchmarks/serving/bench_detokenizer.py)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    # only transformers' own decode / _decode of fast tokenizers (a subclass may post-process)
    if _defining_module(tokenizer, "decode") != "transformers.tokenization_utils_base" or _defining_module(
            tokenizer, "_decode") not in _FAST_DECODE_MODULES:
        return None
    return backend


_FAST_DECODE_MODULES = ("transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast")


def _defining_module(obj: Any, name: str) -> str | None:
    for cls in type(obj).__mro__:
        if name in cls.__dict__:
            return cls.__module__
    return None


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-_SURROUND:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.kwargs: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self.kwargs["spaces_between_special_tokens"] = False
        # NOTE: fast tokenizers ignore spaces_between_special_tokens, so the backend path is exact for them
        self._backend = backend_decoder(tokenizer)
        self._skip = skip_special_tokens

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=self._skip))
        return str(self.tokenizer.decode(ids, **self.kwargs))

    def add(self, token_id: int) -> str:
        """Appends one token; returns the newly final text (maybe ""). Mutates self."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Returns the held-back text (an incomplete UTF-8 tail decodes to "\\ufffd"). Mutates self."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""


class OutputText:
    """The output text of one request with stop strings / stop regexes; tracks what was sent."""

    def __init__(self, stop: list[str], stop_regex: list[str], no_stop_trim: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.stop_regex = [re.compile(p) for p in stop_regex]
        self.no_stop_trim = no_stop_trim
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.sent = 0
        self.stopped: str | None = None  # the matched stop string or regex pattern

    def append(self, piece: str, check_stop: bool = True) -> str | None:
        """Adds final text; returns the matched stop string / pattern when one now matches.

        On a match the text is cut at the match start (or its end with `no_stop_trim`), never
        before what was already sent. Mutates self.
        """
        if not piece:
            return None
        start = max(len(self.text) - self.max_stop_len + 1, 0)
        self.text += piece
        if not check_stop or self.stopped is not None:
            return None
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            pos = self.text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, pos + len(s), s)
        for pattern in self.stop_regex:
            m = pattern.search(self.text)
            if m and (best is None or m.start() < best[0]):
                best = (m.start(), m.end(), pattern.pattern)
        if best is None:
            return None
        cut = best[1] if self.no_stop_trim else best[0]
        self.text = self.text[: max(cut, self.sent)]
        self.stopped = best[2]
        return best[2]

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        for k in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def take(self, final: bool = False) -> str:
        """Text not sent yet that can be sent now (everything when `final`). Mutates `sent`."""
        end = len(self.text) if final or self.stopped is not None else len(self.text) - self._holdback()
        end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out
