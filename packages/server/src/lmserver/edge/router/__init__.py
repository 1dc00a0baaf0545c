"""Data-parallel router: approximate prefix tree, routing policies, HTTP proxy."""

from lmserver.edge.router.policy import CacheAware, RoundRobin, ShortestQueue, make_policy
from lmserver.edge.router.prefix_tree import PrefixMatch, PrefixTree

__all__ = ["CacheAware", "PrefixMatch", "PrefixTree", "RoundRobin", "ShortestQueue", "make_policy"]
