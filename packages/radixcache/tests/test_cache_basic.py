"""Unit tests of RadixCache: match, insert, splits, locks, eviction, sizes, namespaces."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixcache import InvalidKeyError, LockError, RadixCache, SlotAllocator, TreeNode


def _ins(cache: RadixCache, key: list[int], base: int) -> np.ndarray:
    value = np.arange(base, base + len(key), dtype=np.int64)
    cache.insert(key, value)
    return value


def test_match_on_empty_cache() -> None:
    cache = RadixCache()
    m = cache.match_prefix([1, 2, 3])
    assert m.length == 0 and len(m.indices) == 0 and m.last_node is cache.root
    assert cache.total_size == 0


def test_insert_then_match_returns_slots_of_longest_prefix() -> None:
    cache = RadixCache()
    v = _ins(cache, [1, 2, 3, 4], 100)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.length == 4 and m.indices.tolist() == v.tolist()
    m = cache.match_prefix([1, 2, 9])
    assert m.length == 2 and m.indices.tolist() == [100, 101]
    assert m.last_node.num_tokens == 2  # the match split the edge [1,2,3,4]
    assert cache.total_size == 4
    cache.check_integrity()


def test_insert_reports_prefix_len_and_keeps_old_slots() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3, 4], 100)
    r = cache.insert([1, 2, 3, 7, 8], np.arange(200, 205))
    assert r.prefix_len == 3
    assert cache.total_size == 6
    m = cache.match_prefix([1, 2, 3, 7, 8])
    assert m.indices.tolist() == [100, 101, 102, 203, 204]
    assert m.last_node is r.last_node
    cache.check_integrity()


def test_insert_of_cached_prefix_adds_nothing() -> None:
    cache = RadixCache()
    _ins(cache, [5, 6, 7, 8], 10)
    r = cache.insert([5, 6], [90, 91])
    assert r.prefix_len == 2 and cache.total_size == 4
    assert r.last_node.num_tokens == 2  # split so that last_node ends at the key's end
    cache.check_integrity()


def test_match_split_keeps_locked_handle_valid() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3, 4, 5, 6], 10)
    held = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    cache.lock(held)
    cache.match_prefix([1, 2, 3])  # splits the locked node
    cache.check_integrity()
    assert cache.protected_size == 6 and cache.evictable_size == 0
    assert cache.unlock(held) == 6
    assert cache.protected_size == 0
    cache.check_integrity()


def test_lock_and_unlock_return_evictable_delta() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3, 4], 10)
    _ins(cache, [1, 2, 8, 9], 20)
    a = cache.match_prefix([1, 2, 3, 4]).last_node
    b = cache.match_prefix([1, 2, 8, 9]).last_node
    assert cache.lock(a) == -4
    assert cache.lock(b) == -2  # the shared [1,2] is already locked
    assert cache.evictable_size == 0 and cache.protected_size == 6
    assert cache.unlock(a) == 2
    assert cache.unlock(b) == 4
    with pytest.raises(LockError):
        cache.unlock(b)
    cache.check_integrity()


def test_locked_nodes_are_never_evicted() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3], 10)
    _ins(cache, [4, 5, 6], 20)
    cache.lock(cache.match_prefix([1, 2, 3]).last_node)
    freed = cache.evict(100)
    assert sorted(freed.tolist()) == [20, 21, 22]
    assert cache.match_prefix([1, 2, 3]).length == 3
    assert cache.total_size == 3
    cache.check_integrity()


def test_evict_cascades_to_parent_leaf() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3, 4], 10)
    _ins(cache, [1, 2, 7], 20)
    freed = cache.evict(100)
    assert sorted(freed.tolist()) == [10, 11, 12, 13, 22]
    assert cache.total_size == 0
    cache.check_integrity()


def test_evict_trims_the_tail_of_the_lru_leaf() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3, 4], 10)
    _ins(cache, [9, 9], 20)
    assert cache.evict(1).tolist() == [13]  # exactly what was asked, from the end of the LRU leaf
    assert cache.match_prefix([1, 2, 3, 4]).length == 3
    assert cache.total_size == 5
    assert len(cache.evict(0)) == 0
    whole = RadixCache(trim_leaves=False)
    _ins(whole, [1, 2, 3, 4], 10)
    assert whole.evict(1).tolist() == [10, 11, 12, 13]  # SGLang's behaviour: whole leaves
    cache.check_integrity()


def test_paged_trim_is_page_aligned() -> None:
    cache = RadixCache(page_size=4)
    cache.insert(list(range(12)), np.arange(100, 112))
    assert cache.evict(5).tolist() == list(range(104, 112))  # two pages
    assert cache.match_prefix(list(range(12))).length == 4
    cache.check_integrity()


def test_insert_extends_a_leaf_in_place() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3], 10)
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.lock(node)  # a running request holds the leaf and appends to its own key
    r = cache.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14], cached_len=3)
    assert r.prefix_len == 3 and r.last_node is node and cache.num_nodes() == 1
    assert cache.protected_size == 5 and cache.evictable_size == 0  # its lock covers its new tail
    assert cache.unlock(node) == 5
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == [10, 11, 12, 13, 14]
    chained = RadixCache(merge_leaves=False)
    _ins(chained, [1, 2, 3], 10)
    chained.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
    assert chained.num_nodes() == 2
    cache.check_integrity()
    chained.check_integrity()


def test_no_lock_protects_tokens_another_request_appended() -> None:
    """A leaf grows in place only for its own single holder: when another request holds it (or
    the holder is unknown: no cached_len), the insert hangs a new leaf, which stays evictable."""
    for holders, cached_len in ((1, None), (1, 0), (2, 3)):
        cache = RadixCache()
        _ins(cache, [1, 2, 3], 10)
        node = cache.match_prefix([1, 2, 3]).last_node
        for _ in range(holders):
            cache.lock(node)
        r = cache.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14], cached_len=cached_len)
        assert r.last_node is not node and r.last_node.parent is node and cache.num_nodes() == 2
        assert cache.sizes()[1:3] == (2, 3)  # evictable, protected: the lock covers only its tokens
        assert cache.evict(5).tolist() == [13, 14]
        cache.check_integrity()


def test_lock_of_evicted_node_raises() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2], 10)
    node = cache.match_prefix([1, 2]).last_node
    cache.evict(2)
    with pytest.raises(LockError):
        cache.lock(node)


def test_namespaces_never_share_nodes() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3], 10)
    cache.insert([1, 2, 3], [20, 21, 22], extra_key="lora-a")
    assert cache.match_prefix([1, 2, 3], extra_key="lora-a").indices.tolist() == [20, 21, 22]
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == [10, 11, 12]
    assert cache.match_prefix([1, 2, 3], extra_key="lora-b").length == 0
    assert cache.total_size == 6
    cache.check_integrity()
    cache.evict(6)
    assert cache.namespaces() == [None]
    cache.check_integrity()


def test_page_size_aligns_match_and_insert() -> None:
    cache = RadixCache(page_size=4)
    r = cache.insert(list(range(10)), np.arange(100, 110))
    assert r.prefix_len == 0 and cache.total_size == 8
    m = cache.match_prefix(list(range(7)))
    assert m.length == 4 and m.indices.tolist() == [100, 101, 102, 103]
    m = cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 99, 8])  # mismatch inside page 2
    assert m.length == 4
    m = cache.match_prefix([0, 1, 2, 9])  # mismatch inside page 1
    assert m.length == 0
    cache.check_integrity()


def test_paged_split_happens_on_page_boundary() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], np.arange(6))
    r = cache.insert([1, 2, 3, 9, 5, 6], np.arange(10, 16))
    assert r.prefix_len == 2
    assert cache.total_size == 10
    cache.check_integrity()


def test_bad_inputs_raise_typed_errors() -> None:
    cache = RadixCache()
    with pytest.raises(InvalidKeyError):
        cache.match_prefix([[1, 2], [3, 4]])
    with pytest.raises(InvalidKeyError):
        cache.match_prefix(["a", "b"])
    with pytest.raises(InvalidKeyError):
        cache.insert([1, 2, 3], [1, 2])
    with pytest.raises(ValueError):
        RadixCache(page_size=0)


def test_reset_returns_all_slots_and_invalidates_handles() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3], 10)
    _ins(cache, [1, 5], 20)
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.lock(node)
    held = cache.reset()
    assert sorted(held.tolist()) == [10, 11, 12, 21]
    assert cache.total_size == 0 and cache.protected_size == 0
    with pytest.raises(LockError):
        cache.unlock(node)
    cache.check_integrity()


def test_match_result_indices_are_read_only() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3], 10)
    m = cache.match_prefix([1, 2, 3])
    with pytest.raises(ValueError):
        m.indices[0] = 5


def test_peek_mutates_nothing() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3, 4], 10)
    before = cache.pretty_print(file=_Sink())
    assert cache.peek_prefix_len([1, 2, 9]) == 2
    assert cache.pretty_print(file=_Sink()) == before


def test_touch_prefix_refreshes_lru_without_splitting() -> None:
    cache = RadixCache()
    _ins(cache, [1, 2, 3, 4], 10)
    _ins(cache, [5, 6], 20)
    nodes_before = cache.num_nodes()
    assert cache.touch_prefix([1, 2, 9]) == 2  # ends inside [1,2,3,4]: touched whole, unsplit
    assert cache.num_nodes() == nodes_before and cache.total_size == 6
    assert cache.evict(2).tolist() == [20, 21]  # [5,6] is now the least recently used
    assert cache.touch_prefix([7]) == 0
    assert cache.touch_prefix([1], extra_key="other") == 0
    cache.check_integrity()


def test_version_moves_with_structure_only() -> None:
    cache = RadixCache()
    v = cache.version
    _ins(cache, [1, 2, 3, 4], 10)  # add a leaf
    assert cache.version > v
    v = cache.version
    m = cache.match_prefix([1, 2, 3, 4])  # no split
    cache.lock(m.last_node)
    cache.unlock(m.last_node)
    cache.touch_prefix([1, 2])
    assert cache.peek_prefix_len([1, 2, 3]) == 3
    assert cache.version == v  # clocks, hit counts, locks: unchanged
    cache.match_prefix([1, 2, 9])  # splits [1,2,3,4]
    assert cache.version > v
    for change in (lambda: _ins(cache, [1, 2, 3, 4, 5], 30),  # extends a leaf in place
                   lambda: cache.evict(1),  # trims a tail
                   lambda: cache.evict(100),  # deletes leaves
                   lambda: cache.insert([7], [40], extra_key="ns"),  # a new namespace
                   lambda: cache.reset()):
        v = cache.version
        change()
        assert cache.version > v


def test_find_prefix_and_touch_path_act_like_touch_prefix() -> None:
    a, b = RadixCache(), RadixCache()
    for cache in (a, b):
        _ins(cache, [1, 2, 3, 4], 10)
        _ins(cache, [5, 6], 20)
    path = a.find_prefix([1, 2, 9])
    assert (path.length, path.node, path.partial) == (2, a.root, a.root.children[np.int64(1).tobytes()])
    assert a.find_prefix([5, 6, 7]).partial is None and a.find_prefix([7]).length == 0
    assert a.touch_path(path) == b.touch_prefix([1, 2, 9]) == 2
    assert a.touch_path(path) == b.touch_prefix([1, 2, 9]) == 2  # reusable while the version holds
    assert a.pretty_print(file=_Sink()) == b.pretty_print(file=_Sink())  # same clocks, same nodes
    assert a.evict(2).tolist() == b.evict(2).tolist() == [20, 21]
    with pytest.raises(ValueError, match="stale"):
        a.touch_path(path)  # the eviction changed the structure
    assert a.touch_path(a.find_prefix([1], extra_key="none yet")) == 0


def test_touch_paths_is_touch_path_in_order() -> None:
    a, b = RadixCache(), RadixCache()
    keys = [[1, 2, 9], [5], [7], [1, 2, 3, 4], [5, 6]]
    for cache in (a, b):
        _ins(cache, [1, 2, 3, 4], 10)
        _ins(cache, [5, 6], 20)
        _ins(cache, [5, 7], 30)  # splits [5,6]
    a.touch_paths([a.find_prefix(k) for k in keys])
    for k in keys:
        b.touch_prefix(k)
    assert a.pretty_print(file=_Sink()) == b.pretty_print(file=_Sink())
    assert a.evict(3).tolist() == b.evict(3).tolist()
    assert a.touch_path(a.find_prefix([5, 6])) == b.touch_prefix([5, 6])
    stale = a.find_prefix([1, 2])
    a.evict(100)
    with pytest.raises(ValueError, match="stale"):
        a.touch_paths([a.find_prefix([5]), stale])


def test_a_touch_plan_replays_rounds_of_touches() -> None:
    a, b = RadixCache(), RadixCache()
    keys = [[1, 2, 9], [7], [5, 6], [1, 2, 3, 4], [8], [5]]
    for cache in (a, b):
        _ins(cache, [1, 2, 3, 4], 10)
        _ins(cache, [5, 6], 20)
        _ins(cache, [5, 7], 30)
    plan = a.plan_touches([a.find_prefix(k) for k in keys])
    assert plan.ticks == len(keys)
    for _ in range(3):  # three scheduling rounds of the same waiting queue
        a.apply_touches(plan)
        for k in keys:
            b.touch_prefix(k)
        assert a.pretty_print(file=_Sink()) == b.pretty_print(file=_Sink())
    c = RadixCache()
    assert len(c.plan_touches([c.find_prefix([k]) for k in range(50)]).nodes) == 1  # the root only
    a.evict(1)
    with pytest.raises(ValueError, match="stale"):
        a.apply_touches(plan)


def test_check_integrity_detects_corruption() -> None:
    from radixcache import IntegrityError

    cache = RadixCache()
    _ins(cache, [1, 2, 3], 10)
    _ins(cache, [1, 2, 4], 20)
    node: TreeNode = cache.match_prefix([1, 2, 3]).last_node
    node.lock_ref = 1  # bypass lock(): counters now disagree with the walk
    with pytest.raises(IntegrityError, match="lock_ref|size counters"):
        cache.check_integrity()


class _Sink:
    def write(self, text: str) -> int:
        return len(text)


def test_allocator_alloc_free_and_double_free() -> None:
    from radixcache import SlotError

    alloc = SlotAllocator(8)
    a = alloc.alloc(5)
    assert a is not None and 0 not in a.tolist() and alloc.available == 3
    assert alloc.alloc(4) is None
    alloc.free(a[:2])
    with pytest.raises(SlotError):
        alloc.free(a[:1])
    with pytest.raises(SlotError):
        alloc.free([0])
    assert alloc.available == 5


def test_paged_allocator_hands_out_whole_pages() -> None:
    alloc = SlotAllocator(16, page_size=4)
    a = alloc.alloc(5)
    assert a is not None and len(a) == 8
    assert all(a[i * 4] % 4 == 0 and (a[i * 4 : i * 4 + 4] - a[i * 4]).tolist() == [0, 1, 2, 3] for i in range(2))
    assert min(a.tolist()) >= 4  # page 0 reserved
    alloc.free(a[6:7])  # one slot frees its whole page
    assert alloc.available == 12
    assert alloc.buffer_size == 20


def test_pretty_print_shows_namespaces_and_edges() -> None:
    import io

    cache = RadixCache()
    _ins(cache, [1, 2, 3], 10)
    cache.insert([4], [20], extra_key="t")
    buf = io.StringIO()
    text = cache.pretty_print(file=buf)
    assert buf.getvalue() == text
    assert "[namespace None]" in text and "[namespace 't']" in text and "[1,2,3] n=3" in text
    assert "total=4" in text


def test_from_config() -> None:
    from radixcache import RadixCacheConfig

    cache = RadixCache.from_config(RadixCacheConfig(page_size=4, eviction="fifo", enable_events=True))
    assert cache.page_size == 4 and cache.policy.name == "fifo"
    cache.insert(list(range(4)), list(range(4)))
    assert len(cache.take_events()) == 1
    with pytest.raises(ValueError):
        RadixCacheConfig(page_size=0)


def _clocks(cache: RadixCache) -> list[tuple[int, int, int]]:
    return sorted((n.num_tokens, n.last_access, n.hit_count) for n in cache._walk())


def test_match_node_is_match_prefix_of_the_key_ending_there() -> None:
    a, b = RadixCache(page_size=2), RadixCache(page_size=2)
    for cache in (a, b):
        _ins(cache, [1, 2, 3, 4, 5, 6], 10)
    keys = [[1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 5, 6, 9], [1, 2], [1, 2, 3, 4, 7, 8, 9, 9]]
    for key in keys:
        ra = a.insert(key, np.arange(100, 100 + len(key)))
        rb = b.insert(key, np.arange(100, 100 + len(key)))
        ma, mb = a.match_node(ra.last_node), b.match_prefix(key)
        assert ma.length == mb.length and ma.indices.tolist() == mb.indices.tolist()
        assert (ma.last_node is ra.last_node) and (mb.last_node is rb.last_node)
        assert _clocks(a) == _clocks(b) and a.root.last_access == b.root.last_access
    with pytest.raises(ValueError):
        a.match_node(a.root)


def test_hit_node_is_match_node_without_the_slots() -> None:
    a, b = RadixCache(page_size=2), RadixCache(page_size=2)
    for cache in (a, b):
        _ins(cache, [1, 2, 3, 4, 5, 6], 10)
    for key in ([1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 5, 6, 9, 9], [1, 2]):
        na = a.insert(key, np.arange(100, 100 + len(key))).last_node
        nb = b.insert(key, np.arange(100, 100 + len(key))).last_node
        assert a.hit_node(na) == b.match_node(nb).length
        assert _clocks(a) == _clocks(b) and a.root.last_access == b.root.last_access
    with pytest.raises(ValueError):
        a.hit_node(a.root)



@given(ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12), data=st.data())
def test_key_bytes_is_tobytes_of_every_view(ids: list[int], data: st.DataObject) -> None:
    """`_key_bytes` (no copy when the key is exactly the bytes it views) equals `tobytes` for
    frombuffer keys, their slices, reversed and strided views, and plain arrays."""
    from radixcache.cache import _key_bytes

    raw = np.array(ids, dtype=np.int64).tobytes()
    whole = np.frombuffer(raw, dtype=np.int64)
    lo = data.draw(st.integers(0, len(ids)))
    hi = data.draw(st.integers(lo, len(ids)))
    step = data.draw(st.sampled_from([1, 1, 2, -1]))
    arr = whole[lo:hi:step] if step > 0 else whole[::-1]
    for key in (arr, np.array(arr), np.frombuffer(raw[8 * lo : 8 * hi], dtype=np.int64)):
        n = data.draw(st.integers(0, len(key)))
        assert _key_bytes(key, n) == key[:n].tobytes()


@given(
    inserts=st.lists(st.lists(st.integers(1, 3), max_size=10), max_size=6),
    keys=st.lists(st.tuples(st.lists(st.integers(1, 3), max_size=12), st.sampled_from([None, "b"])), max_size=6),
    page_size=st.sampled_from([1, 2]),
)
def test_match_path_is_match_prefix_of_the_key_found(
    inserts: list[list[int]], keys: list[tuple[list[int], str | None]], page_size: int
) -> None:
    """match_path(find_prefix(key)) does what match_prefix(key) does: result, clocks, hit
    counts and the split where a match ends inside an edge."""
    a, b = RadixCache(page_size), RadixCache(page_size)
    for i, key in enumerate(inserts):
        for cache in (a, b):
            cache.insert(key, np.arange(100 * i, 100 * i + len(key)), "b" if i % 2 else None)
    for key, ns in keys:
        ma, mb = a.match_path(a.find_prefix(key, ns)), b.match_prefix(key, ns)
        assert (ma.length, ma.indices.tolist()) == (mb.length, mb.indices.tolist())
        assert a.path_len(ma.last_node) == b.path_len(mb.last_node) == ma.length
        assert a.pretty_print(file=io.StringIO()) == b.pretty_print(file=io.StringIO())
        assert _clocks(a) == _clocks(b) and a.version == b.version
        assert [r.last_access for r in a._roots.values()] == [r.last_access for r in b._roots.values()]
    stale = a.find_prefix([1, 2, 3, 4])
    a.insert([7, 7, 7, 7], np.arange(4))
    with pytest.raises(ValueError, match="stale"):
        a.match_path(stale)


def test_an_extended_leaf_key_is_joined_when_read() -> None:
    """In-place extensions append key parts without copying the key; every reader (walks,
    splits, trims, evictions, token_ids) sees the whole key."""
    c = RadixCache(page_size=2)
    leaf = c.insert([1, 2, 3, 4], np.arange(4)).last_node
    for start in (5, 7, 9):  # extended below itself (no walk through it), as a request's release
        assert c.insert_below(leaf, [start, start + 1], np.arange(start - 1, start + 1)).last_node is leaf
    assert leaf._tail is not None and len(leaf._tail) == 3  # nothing read the key yet
    assert c.peek_prefix_len(list(range(1, 13))) == 10
    assert leaf.key == np.arange(1, 11, dtype=np.int64).tobytes() and leaf._tail is None
    c.insert(list(range(1, 11)) + [11, 12], np.arange(12))  # extended again: a tail of one part
    upper = c.insert([1, 2, 3, 4, 5, 6, 9, 9], np.arange(100, 108)).last_node.parent  # split inside it
    assert upper is not None and upper.key == np.arange(1, 7, dtype=np.int64).tobytes()
    assert leaf.token_ids().tolist() == [7, 8, 9, 10, 11, 12]
    c.check_integrity()
    assert len(c.evict(3)) == 4  # whole pages; the leaf, if trimmed, keeps the head of its key
    assert leaf.removed or leaf.token_ids().tolist() == [7, 8, 9, 10, 11, 12][: leaf.num_tokens]
    c.check_integrity()
