"""SlotAllocator against a naive set-of-free-pages model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache import SlotAllocator, SlotError


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 13), st.integers(0, 10)), max_size=40))
def test_allocator_matches_naive_free_set(page_size: int, ops: list[tuple[bool, int, int]]) -> None:
    num_pages = 10
    alloc = SlotAllocator(num_pages * page_size, page_size)
    free_pages = set(range(1, num_pages + 1))
    held: list[np.ndarray] = []
    for is_alloc, n, pick in ops:
        if is_alloc:
            got = alloc.alloc(n)
            need = -(-n // page_size)
            if need > len(free_pages):
                assert got is None
                continue
            assert got is not None and len(got) == need * page_size
            pages = got.reshape(-1, page_size)
            assert (pages - pages[:, :1] == np.arange(page_size)).all() and (pages[:, 0] % page_size == 0).all()
            got_pages = set((pages[:, 0] // page_size).tolist())
            assert got_pages <= free_pages and len(got_pages) == need
            free_pages -= got_pages
            if need:
                held.append(got)
        elif held:
            slots = held.pop(pick % len(held))
            alloc.free(slots)
            free_pages |= set((slots // page_size).tolist())
            with pytest.raises(SlotError, match="double free"):
                alloc.free(slots[:1])
        assert alloc.available == len(free_pages) * page_size
        for p in range(1, num_pages + 1):
            assert alloc.is_allocated(p * page_size) == (p not in free_pages)


def test_free_rejects_reserved_out_of_range_and_repeats() -> None:
    alloc = SlotAllocator(8, page_size=2)
    a = alloc.alloc(4)
    assert a is not None
    with pytest.raises(SlotError, match="reserved"):
        alloc.free([1])
    with pytest.raises(SlotError):
        alloc.free([10])
    with pytest.raises(SlotError, match="twice"):
        alloc.free(np.array([a[0], a[2], a[0]]))
    assert alloc.available == 4  # a failed free changes nothing
    alloc.free(a)
    assert alloc.available == 8
    alloc.reset()
    assert alloc.available == 8
    with pytest.raises(SlotError):
        SlotAllocator(7, page_size=2)
    with pytest.raises(SlotError):
        alloc.alloc(-1)
