"""Eviction order of each policy against a naive oracle, plus a user-defined policy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache import RadixCache, TreeNode, UnknownPolicyError


def _evict_order(cache: RadixCache) -> list[int]:
    """Leaf ids (slot // 100) in eviction order; evict(1) trims one token at a time."""
    order: list[int] = []
    while cache.total_size:
        leaf = int(cache.evict(1)[0]) // 100
        if not order or order[-1] != leaf:
            order.append(leaf)
    return order


def _leaves(cache: RadixCache, n: int, priorities: list[int] | None = None) -> None:
    for i in range(n):
        cache.insert([i, i, i], np.arange(i * 100, i * 100 + 3), priority=(priorities or [0] * n)[i])


def test_lru_order() -> None:
    cache = RadixCache(eviction="lru")
    _leaves(cache, 4)
    cache.match_prefix([2, 2, 2])
    cache.match_prefix([0, 0, 0, 5])
    assert _evict_order(cache) == [1, 3, 2, 0]


def test_lru_split_refreshes_both_halves() -> None:
    """A match that ends inside an edge refreshes the clock of the whole edge, its unmatched
    lower half included (as SGLang's tree: the split happens on a node the match touched)."""
    for match in ("match_prefix", "insert"):
        cache = RadixCache(eviction="lru")
        cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
        cache.insert([5], [20])
        if match == "match_prefix":
            cache.match_prefix([1, 2, 9])  # splits after [1, 2]
        else:
            cache.insert([1, 2, 9], [10, 11, 30])  # splits after [1, 2], adds [9]
        assert cache.evict(1).tolist() == [20]  # the untouched leaf is the oldest
        assert cache.peek_prefix_len([1, 2, 3, 4]) == 4


def test_lfu_order() -> None:
    cache = RadixCache(eviction="lfu")
    _leaves(cache, 4)
    for key, times in (([0, 0, 0], 3), ([1, 1, 1], 1), ([2, 2, 2], 2)):
        for _ in range(times):
            cache.match_prefix(key)
    assert _evict_order(cache) == [3, 1, 2, 0]


def test_fifo_order_ignores_use() -> None:
    cache = RadixCache(eviction="fifo")
    _leaves(cache, 4)
    cache.match_prefix([0, 0, 0])
    cache.match_prefix([1, 1, 1])
    assert _evict_order(cache) == [0, 1, 2, 3]


def test_priority_order_then_lru() -> None:
    cache = RadixCache(eviction="priority")
    _leaves(cache, 4, priorities=[5, 1, 3, 1])
    cache.match_prefix([1, 1, 1])  # 1 and 3 tie on priority; 3 is now least recently used
    assert _evict_order(cache) == [3, 1, 2, 0]


def test_priority_keeps_maximum_of_inserts() -> None:
    cache = RadixCache(eviction="priority")
    _leaves(cache, 2, priorities=[1, 2])
    cache.insert([0, 0, 0], np.arange(3), priority=9)  # already cached: only raises priority
    assert _evict_order(cache) == [1, 0]


class NewestFirst:
    """A user policy: evict the most recently created node first."""

    name = "newest"

    def key(self, node: TreeNode) -> Any:
        return -node.created


def test_user_policy() -> None:
    cache = RadixCache(eviction=NewestFirst())
    _leaves(cache, 4)
    assert cache.policy.name == "newest"
    assert _evict_order(cache) == [3, 2, 1, 0]


def test_unknown_policy_lists_names() -> None:
    with pytest.raises(UnknownPolicyError, match="lru"):
        RadixCache(eviction="mru")
    with pytest.raises(UnknownPolicyError):
        RadixCache(eviction=42)  # type: ignore[arg-type]


_ops = st.lists(
    st.tuples(st.sampled_from(["match", "insert"]), st.integers(0, 5), st.integers(0, 3)), max_size=40
)


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "priority"])
@settings(max_examples=40, deadline=None)
@given(ops=_ops)
def test_order_matches_naive_oracle(policy: str, ops: list[tuple[str, int, int]]) -> None:
    """Independent leaves (distinct first tokens); the oracle tracks clocks by hand."""
    cache = RadixCache(eviction=policy)
    last: dict[int, int] = {}
    hits: dict[int, int] = {}
    created: dict[int, int] = {}
    prio: dict[int, int] = {}
    for clock, (op, leaf, p) in enumerate(ops, start=1):
        if op == "insert":
            cache.insert([leaf, 7], [leaf * 100, leaf * 100 + 1], priority=p)
            if leaf in last:
                hits[leaf] += 1
                prio[leaf] = max(prio[leaf], p)
            else:
                created[leaf], hits[leaf], prio[leaf] = clock, 0, p
            last[leaf] = clock
        elif leaf in last:
            cache.match_prefix([leaf, 7, 9])
            last[leaf] = clock
            hits[leaf] += 1
        else:
            cache.match_prefix([leaf])
    keys = {
        "lru": lambda i: last[i],
        "lfu": lambda i: (hits[i], last[i]),
        "fifo": lambda i: created[i],
        "priority": lambda i: (prio[i], last[i]),
    }[policy]
    assert _evict_order(cache) == sorted(last, key=keys)
