"""Test helpers: small vocabularies that need no tokenizer files, and a brute-force mask oracle."""

from __future__ import annotations

from cfsm.errors import RejectedTokenError
from cfsm.guide import Guide
from cfsm.masks.index import Index
from cfsm.masks.vocab import Vocabulary

__all__ = ["accepts_bytes", "allowed_by_advance", "char_vocab", "tiny_vocab"]


def accepts_bytes(index: Index, text: str, eos_id: int) -> bool:
    """Whether `index` (over a byte vocabulary: token id = byte value) accepts the UTF-8 bytes of
    `text` followed by EOS `eos_id`."""
    guide = Guide(index)
    try:
        guide.advance_many(list(text.encode()))
        guide.advance(eos_id)
    except RejectedTokenError:
        return False
    return True


def allowed_by_advance(guide: Guide, vocab_size: int) -> set[int]:
    """The token ids a copy of `guide` accepts, one `advance` each (the oracle of a mask, for
    small vocabularies). Mutates nothing."""
    ok = set()
    for t in range(vocab_size):
        probe = guide.copy()
        try:
            probe.advance(t)
        except RejectedTokenError:
            continue
        ok.add(t)
    return ok


def char_vocab(chars: str = "abc", eos_id: int | None = None) -> Vocabulary:
    """One token per character of `chars` (UTF-8), then EOS."""
    tokens = [c.encode() for c in chars]
    eos = len(tokens) if eos_id is None else eos_id
    tokens.append(b"")
    return Vocabulary(tokens, [eos])


def tiny_vocab() -> Vocabulary:
    """A small BPE-like vocabulary: single bytes for printable ASCII, common multi-byte pieces,
    UTF-8 fragments, a special token and EOS (id 0)."""
    pieces: list[bytes] = [b"", b""]  # 0: EOS, 1: a control token
    pieces += [bytes([b]) for b in range(32, 127)]
    pieces += [b"\n", b"\t", b"\xc3", b"\xa9", "é".encode(), "€".encode(), b"\xe2\x82", "😀".encode()]
    pieces += [b'{"', b'":', b'",', b'"}', b'","', b'":"', b"true", b"false", b"null", b"name", b"age",
               b" the", b"ab", b"abc", b"bc", b"12", b"123", b"00", b".5", b"-1", b'", "', b'": ', b"[1", b"],",
               b"::", b"1.", b"2024", b"-0", b"e+", b'\\"', b"\\n", b"\\u00", b"ip", b"10.", b".0."]
    return Vocabulary(pieces, [0], special_token_ids=[1])
