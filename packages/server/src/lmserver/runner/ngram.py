"""N-gram (prompt lookup) drafting: the tokens that followed the most recent earlier occurrence
of the sequence's last n tokens (longest n first). No model; strongest on copy-heavy work
(editing, summarizing or quoting a given text, code completion).

Torch-free. Each request keeps one `NgramIndex`, updated as its tokens grow (amortized O(1)
per token and n).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """For each n in [min_n, max_n]: n-gram -> the end index of its latest occurrence among the
    positions indexed so far (every position but the last, so the suffix never finds itself)."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._last: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in _last

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `tokens` (the request's prompt + output so far;
        only ever appended to between calls). Mutates the index."""
        n_tok = len(tokens)
        if k <= 0 or n_tok < self.min_n + 1:
            return []
        if n_tok < self._indexed:
            raise ValueError("tokens shrank since the last call; build a new NgramIndex")
        last = self._last
        for end in range(max(self._indexed, self.min_n - 1), n_tok - 1):  # end: index of an n-gram's last token
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                last[tuple(tokens[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, n_tok - 1)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            found = last.get(tuple(tokens[n_tok - n :]))
            if found is not None:
                return list(tokens[found + 1 : min(found + 1 + k, n_tok)])
        return []
