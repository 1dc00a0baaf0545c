"""Regexes for JSON Schema `format` values (on the decoded string; all ASCII)."""

from __future__ import annotations

__all__ = ["FORMAT_REGEXES"]

_D = "[0-9]"
_YEAR = f"{_D}{{4}}"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
_MD = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
DATE = f"(?:{_YEAR}-{_MD}|{_LEAP_YEAR}-02-29)"
_HMS = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?"
_OFFSET = "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
TIME = f"{_HMS}{_OFFSET}"
DATE_TIME = f"{DATE}[Tt]{TIME}"
UUID = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
IPV4 = f"{_OCTET}(?:\\.{_OCTET}){{3}}"
_H = "[0-9a-fA-F]{1,4}"
_LS32 = f"(?:{_H}:{_H}|{IPV4})"


def _h16s_then_colons(most: int) -> str:
    """An optional run of 1 to `most` + 1 groups, then "::" (RFC 3986's `[ *n( h16 ":" ) h16 ] "::"`)."""
    return f"(?:(?:{_H}:){{0,{most}}}{_H})?::"


# RFC 3986 `IPv6address`, IPv4-suffixed forms included
IPV6 = (
    f"(?:(?:{_H}:){{6}}{_LS32}"
    f"|::(?:{_H}:){{5}}{_LS32}"
    f"|(?:{_H})?::(?:{_H}:){{4}}{_LS32}"
    f"|{_h16s_then_colons(1)}(?:{_H}:){{3}}{_LS32}"
    f"|{_h16s_then_colons(2)}(?:{_H}:){{2}}{_LS32}"
    f"|{_h16s_then_colons(3)}{_H}:{_LS32}"
    f"|{_h16s_then_colons(4)}{_LS32}"
    f"|{_h16s_then_colons(5)}{_H}"
    f"|{_h16s_then_colons(6)})"
)
_ATOM = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
# NOTE: label length (at most 63) is not enforced: a counted repeat costs ~60 automaton states
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
# NOTE: dot-atom local parts and domain names only (no quoted local part, no address literal):
# the fragment tables (`fragments`) are built for this shape
EMAIL = f"{_ATOM}(?:\\.{_ATOM})*@{_LABEL}(?:\\.{_LABEL})+"
_PCHAR = "(?:[A-Za-z0-9._~!$&'()*+,;=:@/-]|%[0-9A-Fa-f]{2})"
URI = f"[A-Za-z][A-Za-z0-9+.-]*:{_PCHAR}*(?:\\?(?:{_PCHAR}|\\?)*)?(?:#(?:{_PCHAR}|\\?)*)?"

FORMAT_REGEXES: dict[str, str] = {
    "date": DATE,
    "time": TIME,
    "date-time": DATE_TIME,
    "uuid": UUID,
    "ipv4": IPV4,
    "ipv6": IPV6,
    "email": EMAIL,
    "uri": URI,
}
