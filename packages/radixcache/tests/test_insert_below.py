"""`insert_below(node, key, value)` against `insert(path + key, ...)` on a twin cache.

Both caches see the same operations; where one calls `insert_below` from the node a
`match_prefix` returned, the other inserts the whole key. Trees (edges, slots, locks, clocks),
hit counts, priorities, sizes and results must stay identical.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache import RadixCache, TreeNode


def _dump(cache: RadixCache) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for ns in sorted(cache.namespaces(), key=repr):
        stack: list[tuple[TreeNode, int]] = [(cache._roots[ns], 0)]
        while stack:
            node, depth = stack.pop()
            out.append((ns, depth, node.key, node.value.tolist(), node.lock_ref, node.last_access,
                        node.hit_count, node.priority))
            stack.extend((c, depth + 1) for _, c in sorted(node.children.items()))
    return out


@settings(max_examples=150, deadline=None)
@given(
    page_size=st.sampled_from([1, 4]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "below", "below", "evict"]),
            st.lists(st.integers(0, 2), min_size=0, max_size=24),
            st.integers(0, 24),
            st.sampled_from([None, "x"]),
            st.integers(0, 2),
        ),
        max_size=30,
    ),
)
def test_insert_below_equals_insert_of_the_whole_key(
    page_size: int, ops: list[tuple[str, list[int], int, str | None, int]]
) -> None:
    a, b = RadixCache(page_size), RadixCache(page_size)
    next_slot = 0
    for op, toks, cut, ns, prio in ops:
        key = np.array(toks, dtype=np.int64)
        value = np.arange(next_slot, next_slot + len(toks), dtype=np.int64)
        next_slot += len(toks)
        if op == "evict":
            assert a.evict(cut).tolist() == b.evict(cut).tolist()
        elif op == "insert":
            assert a.insert(key, value, ns, prio).prefix_len == b.insert(key, value, ns, prio).prefix_len
        else:  # the cached prefix of key[:cut] as the node below which the rest goes
            ma, mb = a.match_prefix(key[:cut], ns), b.match_prefix(key[:cut], ns)
            assert ma.length == mb.length
            if ma.last_node.extra_key != ns:  # match_prefix gives the default root for a new namespace
                ra = a.insert(key, value, ns, prio)
            else:
                ra = a.insert_below(ma.last_node, key[ma.length :], value[ma.length :], prio)
            rb = b.insert(key, value, ns, prio)
            assert ra.prefix_len == rb.prefix_len
            assert (ra.last_node.parent is None) == (rb.last_node.parent is None)
        assert _dump(a) == _dump(b)
        assert (a.evictable_size, a.protected_size) == (b.evictable_size, b.protected_size)
        a.check_integrity()


def test_path_len_counts_the_tokens_down_to_the_node() -> None:
    cache = RadixCache(1)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    m = cache.match_prefix([1, 2, 9])  # splits [1, 2 | 3, 4]
    assert cache.path_len(m.last_node) == 2 and cache.path_len(cache.root) == 0
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    assert cache.path_len(leaf) == 4
    cache.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])  # extends the leaf in place
    assert cache.path_len(leaf) == 5
