"""`RadixCacheConfig`: the one frozen configuration object of `radixcache`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RadixCacheConfig:
    """Settings of a `RadixCache` (see `RadixCache.from_config`).

    - `page_size`: tokens per KV page; keys are matched and cached in whole pages.
    - `eviction`: name of a built-in eviction policy (`lru`, `lfu`, `fifo`, `priority`).
    - `enable_events`: record stored/removed page events for `take_events()` (costs one hash
      per page on insert).
    - `merge_leaves`: extend a leaf in place when an insert continues it (short paths).
    - `trim_leaves`: `evict` cuts the tail of a leaf to free exactly what is asked.
    - `max_wait_rounds`: aging bound used by the cache-aware ordering helpers: a request passed
      over this many rounds is ordered ahead of every non-starving request.
    """

    page_size: int = 1
    eviction: str = "lru"
    enable_events: bool = False
    merge_leaves: bool = True
    trim_leaves: bool = True
    max_wait_rounds: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")
        if not isinstance(self.max_wait_rounds, int) or self.max_wait_rounds < 0:
            raise ValueError(f"max_wait_rounds must be an int >= 0, got {self.max_wait_rounds!r}")
