"""take_events(): a router that mirrors the cache from events alone sees exactly the cached pages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache import AllCleared, PageRemoved, PageStored, RadixCache
from radixcache.events import chain_hashes, namespace_seed
from radixcache.testing import NaivePrefixCache


def _expected_hashes(model: NaivePrefixCache) -> set[int]:
    """Chained hash of every cached page, computed from scratch per cached prefix."""
    out = set()
    for ns, toks in model._pages:
        out.add(chain_hashes(namespace_seed(ns), np.asarray(toks, dtype=np.int64), model.page_size)[-1])
    return out


def _apply(mirror: set[int], events: list) -> None:
    for ev in events:
        if isinstance(ev, PageStored):
            assert not mirror.intersection(ev.page_hashes), "stored a page twice"
            mirror.update(ev.page_hashes)
        elif isinstance(ev, PageRemoved):
            assert mirror.issuperset(ev.page_hashes), "removed a page never stored"
            mirror.difference_update(ev.page_hashes)
        else:
            assert isinstance(ev, AllCleared)
            mirror.clear()


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "extend", "extend", "match", "evict", "reset"]),
            st.lists(st.integers(0, 2), max_size=14),
            st.sampled_from([None, "t1"]),
        ),
        max_size=30,
    )
)
def test_event_mirror_equals_cached_pages(page_size: int, ops: list) -> None:
    cache = RadixCache(page_size, enable_events=True)
    model = NaivePrefixCache(page_size)
    mirror: set[int] = set()
    next_slot = 1
    last: list[int] = []
    for op, toks, ns in ops:
        if op == "extend":  # the next turn of a conversation: a longer key under a cached one
            op, toks = "insert", last + toks
        if op == "insert":
            last = toks
            vals = np.arange(next_slot, next_slot + len(toks))
            next_slot += len(toks)
            cache.insert(toks, vals, ns)
            model.insert(toks, vals, ns)
        elif op == "match":
            cache.match_prefix(toks, ns)  # splits emit nothing: page hashes do not change
        elif op == "evict":
            model.remove_slots(cache.evict(len(toks)))
        else:
            cache.reset()
            model.reset()
        _apply(mirror, cache.take_events())
        assert mirror == _expected_hashes(model)
        cache.check_integrity()
    assert cache.take_events() == []


def test_events_name_parent_and_tokens() -> None:
    cache = RadixCache(2, enable_events=True)
    cache.insert([1, 2, 3, 4], np.arange(4))
    cache.insert([1, 2, 5, 6, 7], np.arange(10, 15))
    first, second = cache.take_events()
    assert isinstance(first, PageStored) and isinstance(second, PageStored)
    assert first.parent_hash is None and first.token_ids == (1, 2, 3, 4) and len(first.page_hashes) == 2
    assert second.parent_hash == first.page_hashes[0] and second.token_ids == (5, 6)


def test_events_off_by_default() -> None:
    cache = RadixCache()
    cache.insert([1, 2], [1, 2])
    cache.evict(2)
    assert cache.take_events() == []


def test_namespaces_hash_apart() -> None:
    cache = RadixCache(enable_events=True)
    cache.insert([1, 2], [1, 2], extra_key="a")
    cache.insert([1, 2], [3, 4], extra_key="b")
    a, b = cache.take_events()
    assert isinstance(a, PageStored) and isinstance(b, PageStored)
    assert not set(a.page_hashes) & set(b.page_hashes)
