"""Typed exceptions raised at the public boundary of `radixcache`."""

from __future__ import annotations


class RadixCacheError(Exception):
    """Base class of every error raised by `radixcache`."""


class InvalidKeyError(RadixCacheError, ValueError):
    """A key or value given to the cache is malformed (wrong shape, dtype or length)."""


class LockError(RadixCacheError):
    """`lock`/`unlock` misuse: unlocking an unlocked node, or locking an evicted node."""


class IntegrityError(RadixCacheError):
    """`check_integrity()` found a broken invariant; the message names the node and the invariant."""


class SlotError(RadixCacheError, ValueError):
    """`SlotAllocator` misuse: a double free, a reserved or out-of-range slot, a bad size."""


class UnknownPolicyError(RadixCacheError, ValueError):
    """An eviction policy name that is not registered; the message lists the known names."""
