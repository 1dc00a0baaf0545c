"""Routing policies: cache-aware (approximate prefix tree + load balance), round-robin,
shortest queue. A policy is a plain object over worker names and loads; no I/O."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from lmserver.edge.router.prefix_tree import PrefixTree


class RoutingPolicy(Protocol):
    name: str

    def choose(self, text: str, loads: dict[str, int]) -> str:
        """Picks a worker among `loads` (worker -> requests in flight); may record `text`."""
        ...

    def remove_worker(self, worker: str) -> None: ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, text: str, loads: dict[str, int]) -> str:
        workers = sorted(loads)
        return workers[next(self._counter) % len(workers)]

    def remove_worker(self, worker: str) -> None:
        pass


class ShortestQueue:
    name = "shortest_queue"

    def choose(self, text: str, loads: dict[str, int]) -> str:
        return min(sorted(loads), key=lambda w: loads[w])

    def remove_worker(self, worker: str) -> None:
        pass


@dataclass(frozen=True)
class CacheAwareConfig:
    # defaults as SGLang's model gateway (SMG) documents them for its cache-aware policy
    cache_threshold: float = 0.3  # route by prefix when matched / len(text) exceeds this
    balance_abs_threshold: int = 64  # load is unbalanced when max - min exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max exceeds min * this
    max_tree_chars_per_worker: int = 4_000_000  # approximate-cache size bound per worker


class CacheAware:
    """Longest-prefix routing on an approximate tree, with a load-balance escape hatch.

    - Unbalanced load (both thresholds exceeded): the least loaded worker.
    - Else, when the best prefix match covers more than `cache_threshold` of the text: that
      worker (ties: fewer requests in flight).
    - Else: the worker with the smallest approximate cache (most room), then the least loaded.
    The chosen worker is recorded in the tree as now holding `text`.
    """

    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self.tree = PrefixTree()

    def choose(self, text: str, loads: dict[str, int]) -> str:
        workers = sorted(loads)
        cfg = self.config
        lo, hi = min(loads.values()), max(loads.values())
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            chosen = min(workers, key=lambda w: loads[w])
        else:
            match = self.tree.match(text)
            candidates = {w: n for w, n in match.matched.items() if w in loads}
            best = max(candidates.values(), default=0)
            if text and best / len(text) > cfg.cache_threshold:
                chosen = min((w for w in workers if candidates.get(w) == best), key=lambda w: loads[w])
            else:
                chosen = min(workers, key=lambda w: (self.tree.chars(w), loads[w]))
        self.tree.insert(text, chosen)
        self.tree.evict_to(chosen, cfg.max_tree_chars_per_worker)
        return chosen

    def remove_worker(self, worker: str) -> None:
        self.tree.remove_worker(worker)


POLICIES = {"cache_aware": CacheAware, "round_robin": RoundRobin, "shortest_queue": ShortestQueue}


def make_policy(name: str, cache_aware: CacheAwareConfig | None = None) -> RoutingPolicy:
    """The policy called `name`; `cache_aware` configures the cache-aware one."""
    if name == "cache_aware":
        return CacheAware(cache_aware)
    try:
        return POLICIES[name]()  # type: ignore[no-any-return]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None
