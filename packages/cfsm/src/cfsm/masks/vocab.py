"""`Vocabulary`: the byte string of every token id, plus EOS and special ids."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from cfsm.automata.automaton import seeded_weights
from cfsm.automata.blocks import prepare_blocks
from cfsm.config import IndexTuning
from cfsm.errors import VocabularyError
from cfsm.masks.fragments import FragmentTable, build_fragment_tables
from cfsm.masks.rows import token_weights
from cfsm.masks.templates import StringTables, build_string_tables
from cfsm.masks.trie import TrieLevels, TrieTables, build_trie_levels
from cfsm.regex.formats import FORMAT_REGEXES
from cfsm.regex.json_values import format_node

# TrieLevels, TrieTables and build_trie_levels: defined in `cfsm.masks.trie`, named here too
__all__ = ["TrieLevels", "TrieTables", "Vocabulary", "build_trie_levels"]

T = TypeVar("T")


def _num_chars(data: bytes) -> int:
    """Characters of `data` if it is complete, valid UTF-8 (strict), else -1."""
    try:
        return len(data.decode("utf-8"))
    except UnicodeDecodeError:
        return -1


class Vocabulary:
    """Token id -> bytes map of a tokenizer, with EOS ids and ids that never match text.

    `tokens[i]` is the exact byte string token i adds to the output; use `b""` for control
    tokens. `size` is the logits width (>= len(tokens)); ids past `len(tokens)` are never
    allowed. `special_token_ids` are never allowed by a grammar (EOS is allowed where the grammar
    may stop). Immutable after construction.
    """

    def __init__(
        self,
        tokens: Sequence[bytes],
        eos_token_ids: Sequence[int],
        *,
        size: int | None = None,
        special_token_ids: Sequence[int] = (),
    ) -> None:
        toks = tuple(tokens)
        for i, t in enumerate(toks):
            if not isinstance(t, bytes):
                raise VocabularyError(f"token {i} is {type(t).__name__}, expected bytes")
        n = len(toks)
        size = n if size is None else int(size)
        if size < n:
            raise VocabularyError(f"size {size} is smaller than the number of tokens {n}")
        eos = tuple(sorted(set(int(e) for e in eos_token_ids)))
        if not eos:
            raise VocabularyError("at least one EOS token id is needed (eos_token_ids is empty)")
        for e in eos:
            if not 0 <= e < size:
                raise VocabularyError(f"EOS id {e} is outside [0, {size})")
        special = frozenset(int(s) for s in special_token_ids) | frozenset(eos)
        for s in special:
            if not 0 <= s < size:
                raise VocabularyError(f"special id {s} is outside [0, {size})")
        self.tokens = toks
        self.eos_token_ids = eos
        self.size = size
        self.special_token_ids = special

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"Vocabulary(size={self.size}, eos={list(self.eos_token_ids)}, fingerprint={self.fingerprint[:12]})"

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of `token_id` (b"" for control tokens and ids past the token list)."""
        if 0 <= token_id < len(self.tokens) and token_id not in self.special_token_ids:
            return self.tokens[token_id]
        return b""

    def decode(self, token_ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes(t) for t in token_ids)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Stable hash of tokens, EOS, special ids and size (the cache key of compiled grammars)."""
        h = hashlib.sha256()
        h.update(f"{self.size}|{list(self.eos_token_ids)}|{sorted(self.special_token_ids)}|".encode())
        for t in self.tokens:
            h.update(len(t).to_bytes(4, "little"))
            h.update(t)
        return h.hexdigest()

    @functools.cached_property
    def trie_tables(self) -> TrieTables:
        """Sorted column layout of the grammar-usable tokens (built once per vocabulary)."""
        ids = [i for i, t in enumerate(self.tokens) if t and i not in self.special_token_ids]
        ids.sort(key=self.tokens.__getitem__)
        lengths = np.fromiter((len(self.tokens[i]) for i in ids), dtype=np.int32, count=len(ids))
        max_len = int(lengths.max()) if len(ids) else 0
        blob = b"".join(self.tokens[i] for i in ids)
        flat = np.frombuffer(blob, dtype=np.uint8).astype(np.int16)
        columns = np.full((max_len + 1, len(ids)), -1, dtype=np.int16)
        starts = np.zeros(len(ids), dtype=np.int64)
        if len(ids):
            starts[1:] = np.cumsum(lengths[:-1])
        byte_sets = np.zeros((4, len(ids)), dtype=np.uint64)
        tail_byte_sets = np.zeros((4, len(ids)), dtype=np.uint64)
        for d in range(max_len):
            sel = np.flatnonzero(lengths > d)
            col = flat[starts[sel] + d]
            columns[d, sel] = col
            for w in range(4):
                in_word = (col >> 6) == w
                bit = np.left_shift(np.uint64(1), (col[in_word] & 63).astype(np.uint64))
                byte_sets[w, sel[in_word]] |= bit
                if d:
                    tail_byte_sets[w, sel[in_word]] |= bit
        by_length = np.argsort(-lengths, kind="stable").astype(np.int32)
        length_columns = np.where(columns[:max_len, by_length] < 0, 256, columns[:max_len, by_length]).astype(np.uint16)
        length_counts = np.array([(lengths > d).sum() for d in range(max_len)], dtype=np.int64)
        first = columns[0][columns[0] >= 0] if len(ids) else np.zeros(0, np.int16)
        first_counts = np.bincount(first, minlength=256).astype(np.int64)
        first_starts = np.concatenate([[0], np.cumsum(first_counts)]).astype(np.int64)
        # sorted by bytes, so (first byte, second byte or -1 past the end) keys never decrease
        key = columns[0].astype(np.int64) * 257 + (columns[1].astype(np.int64) + 1 if max_len else 0)
        bounds = np.searchsorted(key, np.arange(256 * 257 + 1, dtype=np.int64))
        two_byte_starts = np.empty((256, 258), dtype=np.int64)
        two_byte_starts[:, :257] = bounds[:-1].reshape(256, 257)
        two_byte_starts[:, 257] = bounds[257::257]
        return TrieTables(order=np.asarray(ids, dtype=np.int32), columns=columns, lengths=lengths,
                          byte_sets=byte_sets, tail_byte_sets=tail_byte_sets, first_byte_counts=first_counts,
                          by_length=by_length, length_columns=np.ascontiguousarray(length_columns),
                          length_counts=length_counts, first_byte_starts=first_starts,
                          sorted_tokens=tuple(self.tokens[i] for i in ids),
                          num_chars=np.fromiter((_num_chars(self.tokens[i]) for i in ids), dtype=np.int32,
                                                count=len(ids)),
                          two_byte_starts=two_byte_starts)

    @functools.cached_property
    def trie_levels(self) -> TrieLevels:
        """The trie of the grammar-usable tokens level by level (built once per vocabulary)."""
        return build_trie_levels(self.trie_tables)

    @functools.cached_property
    def string_tables(self) -> StringTables:
        """Every token walked through the JSON string automaton (built once per vocabulary)."""
        return build_string_tables(self.trie_tables, self.mask_words)

    @functools.cached_property
    def fragment_tables(self) -> tuple[FragmentTable, ...]:
        """Every token walked through the broad `format` automata (built once per vocabulary)."""
        return build_fragment_tables(self.trie_tables, self.mask_words)

    def prepare(self) -> Vocabulary:
        """Build the per-vocabulary tables now (else on the first compile); returns self.

        Grammar-independent: the sorted trie tables (and the trie level by level), the JSON string walks, the walks of the
        broad `format` strings (email, uri) with their suffix tables ordered by length, the
        syntax trees of all formats and (once per process) the DFA blocks of the value trees
        schemas share (`cfsm.automata.direct.prepare_blocks`) and the random hash weights.
        """
        for fmt in FORMAT_REGEXES:
            format_node(fmt)
        prepare_blocks()
        self.trie_tables  # noqa: B018
        self.trie_levels.below  # noqa: B018
        self.string_tables.inner_edges  # noqa: B018
        self.string_tables.byte_class  # noqa: B018
        self.string_tables.target_columns  # noqa: B018
        self.string_tables.stay_keys  # noqa: B018
        self.string_tables.text_bytes  # noqa: B018
        self.fragment_tables  # noqa: B018
        self.string_tables.suffixes_by_length  # noqa: B018  (the suffix tables by decreasing length: `live_suffixes`)
        for ft in self.fragment_tables:
            ft.suffixes_by_length  # noqa: B018
        seeded_weights(0xB17E, 1 << 15)  # byte classes of tables up to 32k states (more: drawn then)
        seeded_weights(0x100C, 256)  # look-ahead hashes (`block_facts`)
        # the per-token hash weights of batched rows (`mask_rows`)
        token_weights(max(self.trie_tables.max_id, max(self.eos_token_ids, default=0)) + 1)
        self.trie_tables.max_length  # noqa: B018
        self.trie_tables.rank_ids  # noqa: B018  (the grammar walks' token ids and lengths by rank)
        self.trie_tables.rank_lengths  # noqa: B018
        self.trie_tables.longer_than(IndexTuning.share_depth)  # the default (`build_index`'s long tokens)
        return self

    def derived(self, key: str, build: Callable[[], T]) -> T:
        """`build()`, once per vocabulary and `key` (later calls return the first result): values
        that depend on this vocabulary alone, such as the compile of a fixed grammar. Callers
        must not mutate the result (copy it). Kept as long as the vocabulary is."""
        memo: dict[str, Any] = self.__dict__.setdefault("_derived", {})
        if key not in memo:
            memo[key] = build()
        return memo[key]  # type: ignore[no-any-return]

    @property
    def mask_words(self) -> int:
        """Number of int32 words per bitmask row: ceil(size / 32)."""
        return (self.size + 31) // 32
