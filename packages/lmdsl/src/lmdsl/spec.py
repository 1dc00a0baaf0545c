"""API speculative execution helpers (paper §5), as pure functions over text.

Completion models: one call continues past a `gen`'s stop; the continuation is kept and matched
against the program's later constant text and `gen` calls. Chat models: all `gen` calls of one
assistant turn become one call whose reply is split by the turn's constant text.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmdsl.ir import SamplingParams


@dataclass(frozen=True)
class SpecTerm:
    """One piece of an assistant turn under chat speculation: constant text or a deferred gen."""

    text: str | None = None
    name: str | None = None
    params: SamplingParams | None = None

    @property
    def is_gen(self) -> bool:
        return self.params is not None


def find_first_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index of the earliest stop string in `text`, or -1."""
    found = [i for i in (text.find(s) for s in stops if s) if i != -1]
    return min(found) if found else -1


def consume_constant(buffer: str, constant: str) -> str:
    """The speculative buffer after the program appends `constant`: "" on a mismatch."""
    if buffer.startswith(constant):
        return buffer[len(constant):]
    return ""


def match_template(terms: list[SpecTerm], reply: str) -> dict[int, str] | None:
    """Splits a chat reply by the turn's constant text, in order.

    Returns {term index: generated text} for every gen term, or None when the reply does not
    follow the template (a constant is missing where expected, or a gen has no end).
    """
    pos = 0
    values: dict[int, str] = {}
    for k, term in enumerate(terms):
        if not term.is_gen:
            assert term.text is not None
            if not reply.startswith(term.text, pos):
                return None
            pos += len(term.text)
            continue
        assert term.params is not None
        nxt = terms[k + 1] if k + 1 < len(terms) and not terms[k + 1].is_gen else None
        candidates = [i for i in (reply.find(s, pos) for s in (term.params.stop or ()) if s) if i != -1]
        if nxt is not None and nxt.text:
            i = reply.find(nxt.text, pos)
            if i != -1:
                candidates.append(i)
        if candidates:
            end = min(candidates)
        elif nxt is None or not nxt.text:
            end = len(reply)
        else:
            return None
        values[k] = reply[pos:end]
        pos = end
    return values
