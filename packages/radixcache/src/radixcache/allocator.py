"""`SlotAllocator`: free list of KV slots in whole pages; slot 0 (page 0) is reserved as padding."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from radixcache.errors import SlotError


class SlotAllocator:
    """Hands out KV-cache slot ids in whole pages of `page_size` slots.

    Sizing, explicitly: `num_slots` usable slots (a multiple of `page_size`: `num_pages` pages),
    ids `page_size .. num_slots + page_size - 1`; page 0 (slots `0 .. page_size - 1`) is never
    handed out, so slot 0 can pad batches. A KV buffer for this allocator needs
    `buffer_size = num_slots + page_size` rows. To fit an existing buffer of R rows, use
    `SlotAllocator.for_buffer(R, page_size)` (`num_slots = R - page_size`, rounded down to pages).
    `alloc(n)` hands out `alloc_size(n)` slots (`n` rounded up to whole pages).
    """

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise SlotError(f"page_size must be a positive int, got {page_size!r}")
        if not isinstance(num_slots, int) or num_slots < 0 or num_slots % page_size:
            raise SlotError(
                f"num_slots must be an int >= 0 and a multiple of page_size={page_size}, got {num_slots!r} "
                "(num_slots counts usable slots; the padding page is extra: buffer_size = num_slots + page_size; "
                "SlotAllocator.for_buffer(rows, page_size) sizes one to a buffer)"
            )
        self._page_size = page_size
        self._num_pages = num_slots // page_size
        self._offsets = np.arange(page_size, dtype=np.int64)
        self._init_free()

    def _init_free(self) -> None:
        # stack of free page ids; the top (end) is handed out first, low ids first initially
        self._free = np.arange(self._num_pages, 0, -1, dtype=np.int64)
        self._top = self._num_pages
        self._allocated = np.zeros(self._num_pages + 1, dtype=bool)

    @classmethod
    def for_buffer(cls, buffer_size: int, page_size: int = 1) -> SlotAllocator:
        """The largest allocator whose `buffer_size` fits in `buffer_size` rows (the padding page
        included): `num_slots = (buffer_size // page_size - 1) * page_size`."""
        if not isinstance(buffer_size, int) or not isinstance(page_size, int) or page_size < 1:
            raise SlotError(f"buffer_size and page_size must be ints (page_size >= 1), got {buffer_size!r}, {page_size!r}")
        if buffer_size < page_size:
            raise SlotError(f"buffer_size={buffer_size} cannot hold the padding page (page_size={page_size})")
        return cls((buffer_size // page_size - 1) * page_size, page_size)

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        """Usable pages (`num_slots // page_size`); page 0, the padding page, is not counted."""
        return self._num_pages

    def alloc_size(self, num_tokens: int) -> int:
        """Slots `alloc(num_tokens)` hands out: `num_tokens` rounded up to whole pages."""
        return -(-num_tokens // self._page_size) * self._page_size

    @property
    def num_slots(self) -> int:
        return self._num_pages * self._page_size

    @property
    def buffer_size(self) -> int:
        """Rows a KV buffer needs: usable slots plus the reserved padding page."""
        return (self._num_pages + 1) * self._page_size

    @property
    def available(self) -> int:
        """Free slots right now."""
        return self._top * self._page_size

    def alloc(self, num_tokens: int) -> npt.NDArray[np.int64] | None:
        """`ceil(num_tokens / page_size)` whole pages as a slot array of that many pages times
        `page_size` slots (each page contiguous, page-aligned), or None when too few are free.
        Mutates: the free list."""
        if num_tokens < 0:
            raise SlotError(f"alloc(num_tokens={num_tokens}) needs num_tokens >= 0")
        ps = self._page_size
        k = -(-num_tokens // ps)
        if k > self._top:
            return None
        pages = self._free[self._top - k : self._top][::-1].copy()
        self._top -= k
        self._allocated[pages] = True
        if ps == 1:
            return pages
        return (pages[:, None] * ps + self._offsets).reshape(-1)

    def free(self, indices: npt.ArrayLike) -> None:
        """Return the pages that `indices` touch (any slots of a page free the whole page).

        Raises `SlotError` on a reserved or out-of-range slot, or a page that is not allocated
        (a double free); in that case nothing is freed. Mutates: the free list."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        k = len(idx)
        if k == 0:
            return
        ps = self._page_size
        if k == 1:  # one slot (a request's unaligned tail): scalar checks, same errors
            page = int(idx[0]) // ps
            if page < 1 or page > self._num_pages:
                self._raise_range(page)
            if not self._allocated[page]:
                raise SlotError(f"double free: pages {[page]} (slot {page * ps}...) are already free")
            self._allocated[page] = False
            self._free[self._top] = page
            self._top += 1
            return
        pages = idx if ps == 1 else idx // ps
        if ps > 1:
            keep = np.empty(len(pages), dtype=bool)
            keep[0] = True
            np.not_equal(pages[1:], pages[:-1], out=keep[1:])
            pages = pages[keep]
        srt = np.sort(pages, kind="stable") if len(pages) > 1 else pages  # runs: near O(n)
        lo, hi = int(srt[0]), int(srt[-1])
        if lo < 1 or hi > self._num_pages:
            self._raise_range(lo if lo < 1 else hi)
        if not self._allocated[pages].all():
            bad = pages[~self._allocated[pages]][:5]
            raise SlotError(f"double free: pages {bad.tolist()} (slot {bad[0] * ps}...) are already free")
        if len(srt) > 1 and (srt[1:] == srt[:-1]).any():
            raise SlotError("double free: the same page appears twice in one free() call")
        self._allocated[pages] = False
        k = len(pages)
        self._free[self._top : self._top + k] = pages
        self._top += k

    def _raise_range(self, page: int) -> None:
        raise SlotError(
            f"slot ids must lie in [{self._page_size}, {self.buffer_size - 1}] (page 0 is reserved padding); "
            f"got a slot on page {page}"
        )

    def is_allocated(self, slot: int) -> bool:
        """Whether the page of `slot` is currently handed out."""
        page = slot // self._page_size
        return 1 <= page <= self._num_pages and bool(self._allocated[page])

    def reset(self) -> None:
        """Mark every slot free again. Mutates: the free list."""
        self._init_free()
