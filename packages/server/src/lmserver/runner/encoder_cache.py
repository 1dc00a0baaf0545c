"""EncoderCache: vision-encoder outputs of recent images and videos, by content hash (LRU).

A repeated image skips its vision tower; its KV may be reused too, through the radix cache
(the prompt's key carries the same hash, see io_struct.mm_pad_value). Budgeted in embedding
rows; an item larger than the whole budget is encoded and used once, never kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmserver.io_struct import MultimodalItem

# items -> their embeddings (num_tokens, hidden), in order: one call encodes every miss of a forward
EncodeFn = Callable[[Sequence[MultimodalItem]], list[torch.Tensor]]


class EncoderCache:
    def __init__(self, capacity_rows: int) -> None:
        self.capacity_rows = max(int(capacity_rows), 0)
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.rows = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __contains__(self, content_hash: int) -> bool:
        return content_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, content_hash: int) -> torch.Tensor | None:
        """The rows kept for `content_hash` (marked as just used), None when not kept."""
        hit = self._entries.get(content_hash)
        if hit is not None:
            self._entries.move_to_end(content_hash)
        return hit

    def get_many(self, items: Sequence[MultimodalItem], encode: EncodeFn) -> list[torch.Tensor]:
        """The embeddings of `items` (one tensor each), encoding the misses with one `encode`
        call (each distinct hash once); an item that carries its embeddings (`embeds`, taken from
        this cache when it arrived) is a hit and is kept again. Mutates the cache (LRU order,
        inserts, evictions) and its counters."""
        found: dict[int, torch.Tensor] = {}
        missing: dict[int, MultimodalItem] = {}
        for item in items:
            h = item.content_hash
            if h in found or h in missing:
                continue
            hit = self._entries.get(h)
            if hit is not None:
                self._entries.move_to_end(h)
                found[h] = hit
                self.hits += 1
            elif item.embeds is not None:
                found[h] = item.embeds
                self._put(h, item.embeds)
                self.hits += 1
            else:
                missing[h] = item
        if missing:
            self.misses += len(missing)
            encoded = encode(list(missing.values()))
            for (h, item), rows in zip(missing.items(), encoded, strict=True):
                if rows.shape[0] != item.num_tokens:
                    raise RuntimeError(
                        f"the vision encoder made {rows.shape[0]} rows for a {item.kind} the processor "
                        f"counted {item.num_tokens} tokens for")
                found[h] = rows
                self._put(h, rows)
        return [found[item.content_hash] for item in items]

    def _put(self, content_hash: int, rows: torch.Tensor) -> None:
        n = int(rows.shape[0])
        if n > self.capacity_rows:
            return
        while self.rows + n > self.capacity_rows and self._entries:
            _, old = self._entries.popitem(last=False)
            self.rows -= int(old.shape[0])
            self.evictions += 1
        self._entries[content_hash] = rows
        self.rows += n

    def clear(self) -> None:
        """Drops every entry (counters stay); mutates self."""
        self._entries.clear()
        self.rows = 0

    def stats(self) -> dict[str, Any]:
        lookups = self.hits + self.misses
        return {
            "mm_encoder_cache_entries": len(self._entries),
            "mm_encoder_cache_rows": self.rows,
            "mm_encoder_cache_capacity_rows": self.capacity_rows,
            "mm_encoder_cache_hits": self.hits,
            "mm_encoder_cache_misses": self.misses,
            "mm_encoder_cache_evictions": self.evictions,
            "mm_encoder_cache_hit_rate": self.hits / lookups if lookups else 0.0,
        }
