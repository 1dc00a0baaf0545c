"""EngineCore's prompt check (`_valid_token_ids`) against the plain per-token predicate."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lmserver.engine.core import _valid_token_ids


def _oracle(ids: list, vocab: int) -> bool:
    return all(isinstance(t, int) and 0 <= t < vocab for t in ids)  # the check it replaced


@given(st.lists(st.integers(-3, 60), min_size=1, max_size=40), st.integers(1, 58))
def test_integer_prompts_match_the_predicate(ids: list[int], vocab: int) -> None:
    assert _valid_token_ids(ids, vocab) == _oracle(ids, vocab)


def test_non_integer_entries_are_rejected() -> None:
    assert _valid_token_ids([1, 2, 3], 4)
    assert _valid_token_ids([np.int64(3)], 4)  # numpy integers are token ids too
    for bad in ([1, 2.0], [1, None], [1, "2"], [2**70], [[1, 2]], [True]):
        assert not _valid_token_ids(bad, 10**9), bad
