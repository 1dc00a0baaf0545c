"""Radix-tree KV-cache prefix manager: match, insert, lock, evict, paged slots, cache-aware ordering."""

__version__ = "0.1.0"

__all__ = ["__version__"]
