"""Radix-tree KV-cache prefix manager: match, insert, lock, evict, paged slots, cache-aware ordering.

Pure Python plus numpy. The public API is everything in `__all__`; see the package README for the
ownership protocol an engine follows.
"""

from radixcache.allocator import SlotAllocator
from radixcache.cache import CacheSizes, InsertResult, MatchResult, PrefixPath, RadixCache, TouchPlan
from radixcache.config import RadixCacheConfig
from radixcache.errors import (
    IntegrityError,
    InvalidKeyError,
    LockError,
    RadixCacheError,
    SlotError,
    UnknownPolicyError,
)
from radixcache.events import AllCleared, Event, PageRemoved, PageStored
from radixcache.hicache import (
    WRITE_POLICIES,
    HierarchicalCache,
    KVTransfer,
    Residency,
    TieredMatch,
    TieredSizes,
    TierStats,
    WritePolicy,
)
from radixcache.keys import KeyLike, as_key
from radixcache.node import TreeNode
from radixcache.ordering import AgingQueue, Ordering, PrefixIndex, dfs_weight_order, longest_prefix_first
from radixcache.policy import (
    BUILTIN_POLICIES,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    PriorityPolicy,
    make_policy,
)

__version__ = "0.1.0"

__all__ = [
    "BUILTIN_POLICIES",
    "WRITE_POLICIES",
    "AgingQueue",
    "AllCleared",
    "CacheSizes",
    "Event",
    "EvictionPolicy",
    "FIFOPolicy",
    "HierarchicalCache",
    "InsertResult",
    "IntegrityError",
    "InvalidKeyError",
    "KVTransfer",
    "KeyLike",
    "LFUPolicy",
    "LRUPolicy",
    "LockError",
    "MatchResult",
    "Ordering",
    "PageRemoved",
    "PageStored",
    "PrefixIndex",
    "PrefixPath",
    "PriorityPolicy",
    "RadixCache",
    "RadixCacheConfig",
    "RadixCacheError",
    "Residency",
    "SlotAllocator",
    "SlotError",
    "TierStats",
    "TieredMatch",
    "TieredSizes",
    "TouchPlan",
    "TreeNode",
    "UnknownPolicyError",
    "WritePolicy",
    "__version__",
    "as_key",
    "dfs_weight_order",
    "longest_prefix_first",
    "make_policy",
]
