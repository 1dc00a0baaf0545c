"""Eviction policies: a tiny protocol (`key(node)`, smallest evicted first) and four built-ins.

A policy orders evictable leaves. `RadixCache` keeps them in a lazy heap: an entry's key is
re-read when it reaches the top, and re-pushed if it changed. That is exact as long as a node's
key never decreases while the node lives (true of the built-ins: clocks and counts only grow).
A user policy whose keys can decrease still evicts only evictable leaves, in an approximate order.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from radixcache.errors import UnknownPolicyError
from radixcache.node import TreeNode


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders evictable leaves: the leaf with the smallest `key(node)` is evicted first."""

    name: str

    def key(self, node: TreeNode) -> Any:
        """A comparable value; must not decrease over the node's life (see module docstring)."""
        ...


class LRUPolicy:
    """Least recently used first (the SGLang paper's policy)."""

    name = "lru"

    def key(self, node: TreeNode) -> Any:
        return node.last_access


class LFUPolicy:
    """Fewest hits first; ties broken by least recent use."""

    name = "lfu"

    def key(self, node: TreeNode) -> Any:
        return (node.hit_count, node.last_access)


class FIFOPolicy:
    """Oldest node first (creation order, regardless of use)."""

    name = "fifo"

    def key(self, node: TreeNode) -> Any:
        return node.created


class PriorityPolicy:
    """Lowest priority first (a node keeps the highest priority it was inserted with); ties by LRU."""

    name = "priority"

    def key(self, node: TreeNode) -> Any:
        return (node.priority, node.last_access)


BUILTIN_POLICIES: Mapping[str, type] = MappingProxyType(
    {"lru": LRUPolicy, "lfu": LFUPolicy, "fifo": FIFOPolicy, "priority": PriorityPolicy}
)


def make_policy(eviction: str | EvictionPolicy) -> EvictionPolicy:
    """Resolve a policy name or pass a policy object through; raises `UnknownPolicyError`."""
    if isinstance(eviction, str):
        cls = BUILTIN_POLICIES.get(eviction)
        if cls is None:
            raise UnknownPolicyError(
                f"unknown eviction policy {eviction!r}; built-in: {sorted(BUILTIN_POLICIES)}, "
                "or pass an object with `name` and `key(node)` (see radixcache.EvictionPolicy)"
            )
        policy: EvictionPolicy = cls()
        return policy
    if not callable(getattr(eviction, "key", None)):
        raise UnknownPolicyError(
            f"eviction must be a policy name or an object with a key(node) method, got {eviction!r}"
        )
    return eviction
