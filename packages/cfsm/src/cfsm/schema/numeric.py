"""Exact numeric languages: integer and decimal ranges, and integer multiples, as syntax trees.

Integers are written without leading zeros and without "-0"; bounded numbers are written in
plain decimal form (no exponent), so the bound check is exact on the written value.
"""

from __future__ import annotations

from decimal import Decimal

from cfsm.automata.automaton import dfa_from_table
from cfsm.regex.json_values import DIGIT, FRACTION, INT, NAT, NONZERO, NUMBER
from cfsm.regex.syntax import EMPTY, NOTHING, Chars, Intersect, Node, Repeat, alt, cat, lit

__all__ = ["int_range", "decimal_range", "multiple_of", "DIGIT", "NAT", "INT", "NUMBER"]


def _digits(lo: str, hi: str) -> Node:
    return Chars(((ord(lo), ord(hi)),))


def _same_len(a: str, b: str) -> Node:
    """Digit strings of len(a) == len(b) between a and b (leading zeros allowed)."""
    if a == b:
        return lit(a)
    if a.strip("0") == "" and b.strip("9") == "":
        return Repeat(DIGIT, len(a), len(a))  # NOTE: keeps the recursion linear in the length
    if len(a) == 1:
        return _digits(a, b)
    if a[0] == b[0]:
        return cat(lit(a[0]), _same_len(a[1:], b[1:]))
    rest = len(a) - 1
    parts = [cat(lit(a[0]), _same_len(a[1:], "9" * rest))]
    if int(b[0]) - int(a[0]) > 1:
        parts.append(cat(_digits(str(int(a[0]) + 1), str(int(b[0]) - 1)), Repeat(DIGIT, rest, rest)))
    parts.append(cat(lit(b[0]), _same_len("0" * rest, b[1:])))
    return alt(*parts)


def _nat_range(lo: int, hi: int | None) -> Node:
    """Natural numbers in [lo, hi] (hi None: unbounded), no leading zeros."""
    if hi is not None and lo > hi:
        return NOTHING
    parts: list[Node] = []
    if lo == 0:
        parts.append(lit("0"))
        lo = 1
        if hi is not None and hi < 1:
            return parts[0]
    la = len(str(lo))
    lb = None if hi is None else len(str(hi))
    if lb is not None and la == lb:
        parts.append(_same_len(str(lo), str(hi)))
        return alt(*parts)
    parts.append(_same_len(str(lo), "9" * la))
    if lb is None:
        parts.append(cat(NONZERO, Repeat(DIGIT, la, None)))
    else:
        for length in range(la + 1, lb):
            parts.append(cat(NONZERO, Repeat(DIGIT, length - 1, length - 1)))
        parts.append(_same_len("1" + "0" * (lb - 1), str(hi)))
    return alt(*parts)


def int_range(lo: int | None, hi: int | None) -> Node:
    """Integers in [lo, hi]; None is unbounded on that side."""
    if lo is not None and hi is not None and lo > hi:
        return NOTHING
    parts: list[Node] = []
    if hi is None or hi >= 0:
        parts.append(_nat_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        mag_lo = 1 if hi is None or hi >= 0 else -hi
        mag_hi = None if lo is None else -lo
        parts.append(cat(lit("-"), _nat_range(mag_lo, mag_hi)))
    return alt(*parts)


def _frac_ge(s: str, strict: bool) -> Node:
    """Nonempty digit strings f with 0.f >= 0.s (> if strict); s has no trailing zeros."""
    any_digits = Repeat(DIGIT, 0, None)
    parts = []
    for i in range(len(s)):
        if s[i] != "9":
            parts.append(cat(lit(s[:i]), _digits(str(int(s[i]) + 1), "9"), any_digits))
    if strict:
        parts.append(cat(lit(s), any_digits, NONZERO, any_digits))
    else:
        parts.append(cat(lit(s), any_digits) if s else Repeat(DIGIT, 1, None))
    return alt(*parts)


def _frac_le(s: str, strict: bool) -> Node:
    """Nonempty digit strings f with 0.f <= 0.s (< if strict); s has no trailing zeros."""
    zeros = Repeat(lit("0"), 0, None)
    parts = []
    for i in range(len(s)):
        if s[i] != "0":
            parts.append(cat(lit(s[:i]), _digits("0", str(int(s[i]) - 1)), Repeat(DIGIT, 0, None)))
    for k in range(1, len(s)):
        parts.append(cat(lit(s[:k]), zeros))  # proper prefixes are smaller than s
    if not strict:
        parts.append(cat(lit(s), zeros) if s else Repeat(lit("0"), 1, None))
    return alt(*parts) if parts else NOTHING


def _split(x: Decimal) -> tuple[int, str]:
    ip = int(x)
    frac = format(x - ip, "f")
    frac = frac.split(".")[1].rstrip("0") if "." in frac else ""
    return ip, frac


def _nonneg_decimal(lo: Decimal, lo_excl: bool, hi: Decimal | None, hi_excl: bool) -> Node:
    """Written decimals d.ddd (no exponent) with value in the range, lo >= 0."""
    a_int, a_frac = _split(lo)
    dot = lit(".")
    # fraction options when the integer part equals a_int
    ge_parts = [cat(dot, _frac_ge(a_frac, lo_excl))]
    if not a_frac and not lo_excl:
        ge_parts.append(EMPTY)
    ge = alt(*ge_parts)
    if hi is None:
        middle = cat(_nat_range(a_int + 1, None), Repeat(FRACTION, 0, 1))
        return alt(cat(lit(str(a_int)), ge), middle)
    b_int, b_frac = _split(hi)
    le_parts = [cat(dot, _frac_le(b_frac, hi_excl))]
    if b_frac or not hi_excl:
        le_parts.append(EMPTY)
    le = alt(*le_parts)
    if a_int == b_int:
        return cat(lit(str(a_int)), Intersect([ge, le]))
    parts = [cat(lit(str(a_int)), ge), cat(lit(str(b_int)), le)]
    if b_int - a_int >= 2:
        parts.append(cat(_nat_range(a_int + 1, b_int - 1), Repeat(FRACTION, 0, 1)))
    return alt(*parts)


def decimal_range(lo: Decimal | None, lo_excl: bool, hi: Decimal | None, hi_excl: bool) -> Node:
    """Plain decimals (optional fraction, no exponent) whose value is in the range."""
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_excl or hi_excl))):
        return NOTHING
    parts: list[Node] = []
    if hi is None or hi >= 0:
        if lo is None or lo < 0:
            parts.append(_nonneg_decimal(Decimal(0), False, hi, hi_excl))
        else:
            parts.append(_nonneg_decimal(lo, lo_excl, hi, hi_excl))
    if lo is None or lo < 0:
        # magnitudes of negatives: (max(0, -hi), -lo], zero itself excluded ("-0" is not written)
        if hi is None or hi >= 0:
            mag_lo, mag_lo_excl = Decimal(0), True
        else:
            mag_lo, mag_lo_excl = -hi, hi_excl
        mag_hi = None if lo is None else -lo
        parts.append(cat(lit("-"), _nonneg_decimal(mag_lo, mag_lo_excl, mag_hi, lo_excl)))
    return alt(*parts)


def multiple_of(k: int) -> Node:
    """Integers divisible by k > 0 (no leading zeros, no "-0"), via a remainder automaton."""
    if k <= 0:
        raise ValueError("multipleOf must be positive")
    if k == 1:
        return INT
    # states are remainders; the regex is built by unrolling remainder classes into a DFA
    # embedded through Intersect with a digit automaton: accept digit strings whose value % k == 0.
    table = [[(10 * r + d) % k for d in range(10)] for r in range(k)]
    divisible = dfa_from_table(table, start=0, accepting={0}, alphabet=b"0123456789")
    return cat(Repeat(lit("-"), 0, 1), Intersect([NAT, divisible]))
