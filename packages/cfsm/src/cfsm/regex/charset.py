"""Sets of Unicode code points as sorted disjoint ranges, and their UTF-8 byte sequences.

Class semantics (``\\d``, ``\\w``, ``\\s``, ``\\p{..}``, case folding) are taken from the `regex`
module itself, so the automaton accepts exactly what `regex.fullmatch` accepts.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Iterator

import regex

__all__ = [
    "Ranges",
    "MAX_CP",
    "normalize",
    "negate",
    "union",
    "from_chars",
    "class_ranges",
    "case_close",
    "utf8_sequences",
]

MAX_CP = 0x10FFFF
_SURR_LO, _SURR_HI = 0xD800, 0xDFFF

Ranges = tuple[tuple[int, int], ...]


def normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sort and merge overlapping or adjacent ranges (inclusive bounds)."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if lo > hi:
            continue
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


def union(*sets: Ranges) -> Ranges:
    return normalize(r for s in sets for r in s)


def negate(ranges: Ranges) -> Ranges:
    out: list[tuple[int, int]] = []
    prev = 0
    for lo, hi in normalize(ranges):
        if lo > prev:
            out.append((prev, lo - 1))
        prev = hi + 1
    if prev <= MAX_CP:
        out.append((prev, MAX_CP))
    return tuple(out)


def from_chars(chars: Iterable[int]) -> Ranges:
    return normalize((c, c) for c in chars)


# NOTE: pure memoization of a constant (no inputs)
@functools.cache
def _all_codepoints() -> str:
    # NOTE: surrogates are left out: they have no UTF-8 encoding, so no byte string matches them.
    return "".join(map(chr, range(_SURR_LO))) + "".join(map(chr, range(_SURR_HI + 1, MAX_CP + 1)))


def _index_to_cp(i: int) -> int:
    return i if i < _SURR_LO else i + (_SURR_HI - _SURR_LO + 1)


# NOTE: pure memoization of immutable inputs, bounded by the classes the `regex` module knows
# (unknown ones raise, and are not kept)
@functools.cache
def class_ranges(class_regex: str) -> Ranges:
    """Code points that the one-character `regex` class `class_regex` matches (e.g. ``\\p{L}``).

    Raises `regex.error` if the class is unknown to the `regex` module.
    """
    text = _all_codepoints()
    out = []
    for m in regex.finditer(f"(?:{class_regex})+", text):
        out.append((_index_to_cp(m.start()), _index_to_cp(m.end() - 1)))
    # a run may straddle the surrogate gap; splitting by index mapping keeps it exact
    fixed: list[tuple[int, int]] = []
    for lo, hi in out:
        if lo < _SURR_LO <= hi:
            fixed += [(lo, _SURR_LO - 1), (_SURR_HI + 1, hi)]
        else:
            fixed.append((lo, hi))
    return normalize(fixed)


# NOTE: pure memoization of a constant (no inputs)
@functools.cache
def _case_classes() -> tuple[list[int], list[tuple[int, ...]]]:
    """Simple case-folding equivalence classes, as the `regex` module's (?i) uses them."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for cp in range(0x20000):
        if _SURR_LO <= cp <= _SURR_HI:
            continue
        ch = chr(cp)
        for other in (ch.lower(), ch.upper(), ch.casefold()):
            if len(other) == 1 and other != ch:
                a, b = find(cp), find(ord(other))
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for cp in list(parent):
        groups.setdefault(find(cp), []).append(cp)
    for root, members in groups.items():
        if root not in members:
            members.append(root)
    keys: list[int] = []
    vals: list[tuple[int, ...]] = []
    for members in groups.values():
        ms = tuple(sorted(set(members)))
        for m in ms:
            keys.append(m)
            vals.append(ms)
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return [keys[i] for i in order], [vals[i] for i in order]


def _contains(ranges: Ranges, cp: int) -> bool:
    i = bisect.bisect_right(ranges, (cp, MAX_CP + 1)) - 1
    return i >= 0 and ranges[i][0] <= cp <= ranges[i][1]


def case_close(ranges: Ranges) -> Ranges:
    """Add every case variant of every member (simple case folding)."""
    ranges = normalize(ranges)
    keys, vals = _case_classes()
    extra: list[int] = []
    for cp, group in zip(keys, vals, strict=True):
        if _contains(ranges, cp):
            extra.extend(group)
    return union(ranges, from_chars(extra))


def _encode(cp: int) -> bytes:
    return chr(cp).encode("utf-8")


def utf8_sequences(lo: int, hi: int) -> Iterator[tuple[tuple[int, int], ...]]:
    """Split the code point range [lo, hi] into UTF-8 byte-range sequences.

    Each yielded sequence is ((b0_lo, b0_hi), (b1_lo, b1_hi), ...); the byte strings matched by
    the yielded sequences are exactly the UTF-8 encodings of the range (surrogates excluded).
    """
    stack = [(lo, hi)]
    while stack:
        s, e = stack.pop()
        if s > e:
            continue
        if s <= _SURR_HI and e >= _SURR_LO:
            stack.append((s, _SURR_LO - 1))
            stack.append((_SURR_HI + 1, e))
            continue
        split = False
        for m in (0x7F, 0x7FF, 0xFFFF):
            if s <= m < e:
                stack.append((s, m))
                stack.append((m + 1, e))
                split = True
                break
        if split:
            continue
        if e <= 0x7F:
            yield ((s, e),)
            continue
        for i in (1, 2, 3):
            mask = (1 << (6 * i)) - 1
            if (s & ~mask) != (e & ~mask):
                if s & mask:
                    stack.append((s, s | mask))
                    stack.append(((s | mask) + 1, e))
                    split = True
                    break
                if (e & mask) != mask:
                    stack.append((s, (e & ~mask) - 1))
                    stack.append((e & ~mask, e))
                    split = True
                    break
        if split:
            continue
        bs, be = _encode(s), _encode(e)
        yield tuple(zip(bs, be, strict=True))
