"""Cache-aware ordering helpers and the aging (starvation) bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache import RadixCache
from radixcache.ordering import AgingQueue, dfs_weight_order, longest_prefix_first
from radixcache.testing import NaivePrefixCache


def _cache_with(prefixes: list[list[int]]) -> tuple[RadixCache, NaivePrefixCache]:
    cache, model = RadixCache(), NaivePrefixCache()
    slot = 1
    for p in prefixes:
        vals = np.arange(slot, slot + len(p))
        slot += len(p)
        cache.insert(p, vals)
        model.insert(p, vals)
    return cache, model


@settings(max_examples=50, deadline=None)
@given(
    prefixes=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), max_size=6),
    keys=st.lists(st.lists(st.integers(0, 2), max_size=10), max_size=8),
)
def test_longest_prefix_first_sorts_by_naive_prefix(prefixes: list[list[int]], keys: list[list[int]]) -> None:
    cache, model = _cache_with(prefixes)
    before = cache.pretty_print(file=_Sink())
    o = longest_prefix_first(cache, keys, max_wait_rounds=None)
    want = sorted(range(len(keys)), key=lambda i: (-model.longest_prefix(keys[i])[0], i))
    assert o.order == want and o.num_ready == len(keys)
    assert cache.pretty_print(file=_Sink()) == before  # ordering mutates nothing


def test_touch_keeps_waiting_prefixes_from_eviction() -> None:
    cache, _ = _cache_with([[1, 1, 1], [2, 2, 2]])
    cache.match_prefix([2, 2, 2])  # [1,1,1] is now the LRU leaf
    o = longest_prefix_first(cache, [[1, 1, 1, 5]], touch=True)
    assert o.order == [0]
    assert cache.evict(3).tolist() == [4, 5, 6]  # [2,2,2] goes first: [1,1,1] is wanted


def test_only_the_oldest_starving_request_jumps_the_queue() -> None:
    cache, _ = _cache_with([[1, 2, 3, 4]])
    keys = [[9], [1, 2, 3, 4], [8], [1, 2]]
    o = longest_prefix_first(cache, keys, waited_rounds=[3, 0, 5, 1], max_wait_rounds=3)
    assert o.order == [2, 1, 3, 0]  # 2 is the oldest starving; 0 (also starving) keeps its place
    o = longest_prefix_first(cache, keys, waited_rounds=[3, 0, 3, 1], max_wait_rounds=3)
    assert o.order == [0, 1, 3, 2]  # equal waits: the earlier arrival is older


def test_deferral_holds_back_requests_sharing_an_uncached_prefix() -> None:
    cache = RadixCache()
    shared = list(range(100, 200))
    keys = [shared + [i] for i in range(5)] + [[7, 7]]
    o = longest_prefix_first(cache, keys, defer_shared_tokens=32)
    assert o.num_ready == 2
    assert set(o.order[:2]) == {0, 5} and sorted(o.order[2:]) == [1, 2, 3, 4]
    cache.insert(keys[0], np.arange(1, 102))
    o = longest_prefix_first(cache, keys[1:], defer_shared_tokens=32)
    assert o.num_ready == 5  # the shared part is cached now: nothing more to gain by waiting


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=60, deadline=None)
@given(
    prefixes=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=8), max_size=5),
    keys=st.lists(st.lists(st.integers(0, 1), max_size=10), max_size=10),
    waits=st.lists(st.integers(0, 3), min_size=10, max_size=10),
    threshold=st.integers(1, 4),
)
def test_deferral_matches_naive_oracle(
    prefixes: list[list[int]], keys: list[list[int]], waits: list[int], threshold: int
) -> None:
    """Deferred iff an earlier ready request shares >= threshold tokens past the cached prefix."""
    cache, model = _cache_with(prefixes)
    w = waits[: len(keys)]
    o = longest_prefix_first(cache, keys, waited_rounds=w, max_wait_rounds=3, defer_shared_tokens=threshold)
    full = longest_prefix_first(cache, keys, waited_rounds=w, max_wait_rounds=3)
    ready: list[int] = []
    deferred: list[int] = []
    for i in full.order:
        cached = model.longest_prefix(keys[i])[0]
        if any(_lcp(keys[i], keys[j]) - cached >= threshold for j in ready):
            deferred.append(i)
        else:
            ready.append(i)
    assert o.order == ready + deferred and o.num_ready == len(ready)
    assert not keys or o.order[0] == full.order[0]  # the head is never deferred


def test_dfs_weight_groups_subtrees_heaviest_first() -> None:
    cache, _ = _cache_with([[1, 1, 1, 1], [1, 1, 2, 2], [3, 3, 3]])
    keys = [
        [3, 3, 3, 0],  # 0: under [3,3,3]
        [1, 1, 2, 2, 5],  # 1: under [1,1]->[2,2]
        [1, 1, 1, 1, 5],  # 2: under [1,1]->[1,1]
        [1, 1, 2, 2, 6],  # 3: under [1,1]->[2,2]
        [9],  # 4: no match, hangs at the root
        [1, 1, 1, 1, 7],  # 5
        [1, 1, 2, 2, 7],  # 6
    ]
    o = dfs_weight_order(cache, keys, max_wait_rounds=None)
    # the [1,1] subtree (5 requests) first: its heavier [2,2] branch (3) before [1,1] (2); then
    # [3,3,3] (1); the root's own request (matching nothing) last
    assert o.order == [1, 3, 6, 2, 5, 0, 4]


@settings(max_examples=30, deadline=None)
@given(
    prefixes=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), max_size=6),
    keys=st.lists(st.lists(st.integers(0, 2), max_size=10), max_size=10),
)
def test_dfs_weight_is_a_permutation_with_contiguous_subtrees(prefixes: list[list[int]], keys: list[list[int]]) -> None:
    cache, _ = _cache_with(prefixes)
    o = dfs_weight_order(cache, keys, max_wait_rounds=None)
    assert sorted(o.order) == list(range(len(keys)))
    hang = [cache._peek(np.asarray(keys[i], dtype=np.int64), None)[1] for i in o.order]
    subtrees: dict[int, list[int]] = {}  # node id -> positions of requests in its subtree
    for pos, node in enumerate(hang):
        while node is not None:
            subtrees.setdefault(id(node), []).append(pos)
            node = node.parent
    for positions in subtrees.values():  # every subtree's requests are emitted back to back
        assert positions == list(range(positions[0], positions[0] + len(positions)))
    for i in range(len(hang)):  # deeper matches first: no request after one hanging above it
        for j in range(i + 1, len(hang)):
            assert not _is_strict_ancestor(hang[i], hang[j])


def _is_strict_ancestor(a: object, b: object) -> bool:
    """Whether node b lies strictly below node a (so b's requests must precede a's)."""
    cur = getattr(b, "parent", None)
    while cur is not None:
        if cur is a:
            return True
        cur = cur.parent
    return False


def _simulate(
    max_wait_rounds: int | None, rounds: int = 60, policy: str = "lpm"
) -> tuple[dict[int, int], dict[int, int]]:
    """Adversary: every round a request with a long cached prefix arrives; only the head of the
    order is admitted. Returns (waited rounds at admission, requests waiting at arrival)."""
    cache = RadixCache()
    hot = list(range(1000, 1100))
    cache.insert(hot, np.arange(1, 101))
    q: AgingQueue[int] = AgingQueue(policy, max_wait_rounds=max_wait_rounds, defer_shared_tokens=8, touch=True)
    waited: dict[int, int] = {}
    ahead: dict[int, int] = {}
    rid = 0
    for r in range(rounds):
        for _ in range(2 if r % 3 == 0 else 1):  # arrivals outpace admissions
            ahead[rid] = len(q)
            key = [rid % 7] if rid % 4 == 0 else hot + [rid]  # every 4th request shares nothing
            q.push(rid, key)
            rid += 1
        ids, _ = q.order(cache)
        head = ids[0]
        waited[head] = q.waited_rounds(head)
        q.end_round([head])
    return waited, ahead


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
@pytest.mark.parametrize("k", [0, 2, 5])
def test_aging_bound_holds_under_adversarial_arrivals(k: int, policy: str) -> None:
    waited, ahead = _simulate(max_wait_rounds=k, policy=policy)
    assert waited, "nothing was admitted"
    for rid, w in waited.items():
        assert w <= k + ahead[rid], f"request {rid} waited {w} > {k} + {ahead[rid]}"


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_without_aging_cold_requests_starve(policy: str) -> None:
    waited, ahead = _simulate(max_wait_rounds=None, policy=policy)
    cold = [rid for rid in ahead if rid % 4 == 0]
    admitted_cold = [rid for rid in cold if rid in waited]
    assert len(admitted_cold) < len(cold) // 2  # the bound is what prevents this


def test_aging_queue_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        AgingQueue("random")
    q: AgingQueue[str] = AgingQueue()
    q.push("a", [1])
    with pytest.raises(ValueError):
        q.end_round(["b"])


class _Sink:
    def write(self, text: str) -> int:
        return len(text)
