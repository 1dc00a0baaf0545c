"""The router's approximate prefix tree and policies against naive models."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.edge.router.policy import CacheAware, CacheAwareConfig, RoundRobin, ShortestQueue
from lmserver.edge.router.prefix_tree import PrefixTree

WORKERS = ["w0", "w1", "w2"]
texts = st.text(alphabet="abc", min_size=0, max_size=12)
ops = st.lists(st.tuples(st.sampled_from(WORKERS), texts), max_size=25)


def _lcp(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _naive_chars(strings: set[str]) -> int:
    return len({s[:i] for s in strings for i in range(1, len(s) + 1)})


@settings(max_examples=150, deadline=None)
@given(ops, texts)
def test_match_and_size_equal_naive_model(inserts: list[tuple[str, str]], query: str) -> None:
    tree, naive = PrefixTree(), {w: set() for w in WORKERS}
    for worker, text in inserts:
        tree.insert(text, worker)
        naive[worker].add(text)
    got = tree.match(query).matched
    for w in WORKERS:
        want = max((_lcp(s, query) for s in naive[w]), default=0)
        assert got.get(w, 0) == want
        assert tree.chars(w) == _naive_chars(naive[w])


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from(WORKERS), st.integers(0, 20), texts)
def test_eviction_bounds_one_worker_and_leaves_others_alone(
    inserts: list[tuple[str, str]], victim: str, limit: int, query: str
) -> None:
    tree = PrefixTree()
    for worker, text in inserts:
        tree.insert(text, worker)
    before = tree.match(query).matched
    before_chars = {w: tree.chars(w) for w in WORKERS}
    dropped = tree.evict_to(victim, limit)
    assert tree.chars(victim) <= limit
    assert dropped == before_chars[victim] - tree.chars(victim)
    after = tree.match(query).matched
    for w in WORKERS:
        if w != victim:
            assert after.get(w, 0) == before.get(w, 0)
            assert tree.chars(w) == before_chars[w]
        else:
            assert after.get(w, 0) <= before.get(w, 0)


def test_eviction_drops_least_recently_used_first() -> None:
    tree = PrefixTree()
    tree.insert("old-branch", "w")
    tree.insert("new-branch", "w")
    tree.match("new-branch")
    tree.evict_to("w", len("new-branch"))
    assert tree.match("new-branch").matched["w"] == len("new-branch")
    assert tree.match("old-branch").matched.get("w", 0) == 0


def test_cache_aware_keeps_prefix_groups_together_and_spreads_groups() -> None:
    policy = CacheAware()
    loads = {"a": 0, "b": 0}
    system = {g: f"system prompt of group {g} " * 20 for g in range(4)}
    placement: dict[int, set[str]] = {g: set() for g in range(4)}
    for i in range(40):
        g = i % 4
        placement[g].add(policy.choose(system[g] + f"question {i}", loads))
    assert all(len(ws) == 1 for ws in placement.values())
    assert {next(iter(ws)) for ws in placement.values()} == {"a", "b"}


def test_cache_aware_balances_when_load_is_skewed() -> None:
    policy = CacheAware(CacheAwareConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    text = "shared prefix " * 10
    assert policy.choose(text, {"a": 0, "b": 0}) == "a"
    assert policy.choose(text, {"a": 3, "b": 0}) == "a"  # under the thresholds: cache wins
    assert policy.choose(text, {"a": 10, "b": 0}) == "b"  # skewed: least loaded wins


def test_simple_policies() -> None:
    rr = RoundRobin()
    assert [rr.choose("", {"a": 0, "b": 0}) for _ in range(4)] == ["a", "b", "a", "b"]
    assert ShortestQueue().choose("", {"a": 3, "b": 1, "c": 2}) == "b"


def test_router_config_reaches_the_cache_aware_policy() -> None:
    from lmserver.edge.router.app import Router, RouterConfig

    text = "shared prefix " * 10
    for abs_threshold, expected in ((64, "a"), (16, "b")):
        router = Router(RouterConfig(workers=("a", "b"), cache_aware=CacheAwareConfig(balance_abs_threshold=abs_threshold)))
        router.workers["a"].in_flight = 0
        assert router.pick(text, set()) == "a"  # first sight: the emptier tree, then name order
        router.workers["a"].in_flight, router.workers["b"].in_flight = 70, 40
        # 70 vs 40: unbalanced past 16 (and 70 > 1.5 x 40), within 64: the cached worker keeps it
        assert router.pick(text, set()) == expected
