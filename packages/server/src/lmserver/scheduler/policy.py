"""Waiting-queue orders: `lpm` (longest cached prefix first), `dfs-weight`, `fcfs`; plus aging.

Aging: a request passed over for `aging_rounds` scheduling rounds goes first (in arrival
order), whatever the policy, so no request starves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmserver.scheduler.kv import KVManager
from lmserver.scheduler.req import Req

# lpm and dfs-weight cost a prefix match per waiting request; past this queue length they
# fall back to fcfs (as SGLang does) to keep scheduling cheap.
MAX_CACHE_AWARE_QUEUE = 256

PolicyFn = Callable[[list[Req], KVManager], list[Req]]


def order_fcfs(waiting: list[Req], kv: KVManager) -> list[Req]:
    return sorted(waiting, key=lambda r: r.arrival)


def order_lpm(waiting: list[Req], kv: KVManager) -> list[Req]:
    """Longest cached prefix first; ties by arrival. Refreshes the LRU clock of those prefixes."""
    if kv.disable_radix_cache:
        return order_fcfs(waiting, kv)  # every prefix is 0
    lens = kv.peek_prefix_lens(waiting, touch=True)
    prefix = {r.rid: n for r, n in zip(waiting, lens, strict=True)}
    return sorted(waiting, key=lambda r: (-prefix[r.rid], r.arrival))


def order_dfs_weight(waiting: list[Req], kv: KVManager) -> list[Req]:
    """Depth-first over the radix tree, heavier subtrees (more waiting requests) first.

    Requests ending at the same node keep arrival order. May split tree nodes (match_prefix)
    but changes no cached content.
    """
    if kv.disable_radix_cache:
        return order_fcfs(waiting, kv)
    by_node: dict[int, list[Req]] = {}
    nodes: dict[int, Any] = {}
    weight: dict[int, int] = {}
    children: dict[int, list[Any]] = {}
    roots: list[Any] = []
    for req, node in zip(waiting, kv.match_last_nodes(waiting), strict=True):
        by_node.setdefault(id(node), []).append(req)
        nodes[id(node)] = node
        walk: Any = node
        while walk is not None:
            key = id(walk)
            first = key not in weight
            weight[key] = weight.get(key, 0) + 1
            parent = walk.parent
            if first:
                if parent is None:
                    roots.append(walk)
                else:
                    children.setdefault(id(parent), []).append(walk)
            walk = parent
    out: list[Req] = []
    # iterative DFS (a deep tree must not hit the recursion limit); heaviest child popped first
    stack = sorted(roots, key=lambda c: weight[id(c)])
    while stack:
        node = stack.pop()
        out.extend(sorted(by_node.get(id(node), []), key=lambda r: r.arrival))
        stack.extend(sorted(children.get(id(node), []), key=lambda c: weight[id(c)]))
    return out


POLICIES: dict[str, PolicyFn] = {"fcfs": order_fcfs, "lpm": order_lpm, "dfs-weight": order_dfs_weight}


class UnknownPolicyError(ValueError):
    """schedule_policy names no known policy."""


def order_waiting(waiting: list[Req], kv: KVManager, policy: str, aging_rounds: int) -> list[Req]:
    """The waiting queue in service order; aged requests first. Mutates nothing in `waiting`."""
    if policy not in POLICIES:
        raise UnknownPolicyError(f"unknown schedule_policy {policy!r}; choose one of {sorted(POLICIES)}")
    aged = sorted((r for r in waiting if r.wait_rounds >= aging_rounds), key=lambda r: r.arrival)
    rest = [r for r in waiting if r.wait_rounds < aging_rounds]
    fn = POLICIES[policy] if len(rest) <= MAX_CACHE_AWARE_QUEUE else order_fcfs
    return aged + fn(rest, kv)
