"""Page events for an external cache-aware router: which pages were stored or removed.

Each page (`page_size` tokens) is named by a chained 64-bit hash: the hash of the previous page's
hash, the page's token ids and the namespace (`extra_key`). Equal hashes mean equal prefixes in
the same namespace, so a router can mirror the tree from events alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class PageStored:
    """Pages added to the cache: `page_hashes[i]` names the page with `token_ids[i*P:(i+1)*P]`."""

    page_hashes: tuple[int, ...]
    parent_hash: int | None  # hash of the page before the first one; None at a namespace root
    token_ids: tuple[int, ...]
    extra_key: Hashable


@dataclass(frozen=True)
class PageRemoved:
    """Pages evicted from the cache."""

    page_hashes: tuple[int, ...]
    extra_key: Hashable


@dataclass(frozen=True)
class AllCleared:
    """`reset()` dropped every page."""


Event = PageStored | PageRemoved | AllCleared


def namespace_seed(extra_key: Hashable) -> bytes:
    """The 8-byte seed that starts the hash chain of a namespace (stable across processes for
    str/int/bytes/tuple keys, whose repr is stable)."""
    if extra_key is None:
        return bytes(8)
    return hashlib.blake2b(repr(extra_key).encode(), digest_size=8).digest()


def chain_hashes(
    prev: bytes, tokens: npt.NDArray[np.int64], page_size: int
) -> list[int]:
    """Chained hashes of `len(tokens) // page_size` whole pages following a page hashed `prev`."""
    out: list[int] = []
    raw = np.ascontiguousarray(tokens, dtype=np.int64).tobytes()
    step = page_size * 8
    for start in range(0, len(raw) - len(raw) % step, step):
        digest = hashlib.blake2b(prev + raw[start : start + step], digest_size=8).digest()
        out.append(int.from_bytes(digest, "little", signed=True))
        prev = digest
    return out


def hash_to_bytes(h: int) -> bytes:
    return h.to_bytes(8, "little", signed=True)
