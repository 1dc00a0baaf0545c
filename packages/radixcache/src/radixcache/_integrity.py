"""`check(cache)`: the full invariant check behind `RadixCache.check_integrity()`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from radixcache.errors import IntegrityError
from radixcache.events import chain_hashes, hash_to_bytes, namespace_seed
from radixcache.keys import TOKEN_BYTES
from radixcache.node import TreeNode

if TYPE_CHECKING:
    from radixcache.cache import RadixCache


def _where(node: TreeNode) -> str:
    depth, prefix_len, cur = 0, 0, node
    while cur.parent is not None:
        depth += 1
        prefix_len += cur.num_tokens
        cur = cur.parent
    head = node.token_ids()[:6].tolist()
    return (f"node (namespace={node.extra_key!r}, depth={depth}, ends at token {prefix_len}, "
            f"edge starts {head}, lock_ref={node.lock_ref})")


def check(cache: RadixCache) -> None:
    ps = cache._page_size
    pb = cache._page_bytes
    if cache._roots.get(None) is not cache._root:
        raise IntegrityError("the default namespace root is missing from the namespace table")
    evictable = protected = 0
    slot_arrays = []
    in_heap_nodes: set[int] = set()
    unlocked_leaves: list[TreeNode] = []
    for ns, root in cache._roots.items():
        if root.parent is not None or root.key or root.num_tokens or root.lock_ref or root.removed:
            raise IntegrityError(f"namespace root {ns!r} is not a clean root (parent/key/lock/removed set)")
        if root.extra_key != ns:
            raise IntegrityError(f"namespace root {ns!r} records extra_key={root.extra_key!r}")
        if ns is not None and not root.children:
            raise IntegrityError(f"namespace {ns!r} has no nodes but is still registered")
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for k, child in node.children.items():
                where = _where(child)
                if child.parent is not node:
                    raise IntegrityError(f"{where}: parent pointer does not point to the node holding it")
                if child.removed:
                    raise IntegrityError(f"{where}: marked removed but still linked in the tree")
                if child.extra_key != ns:
                    raise IntegrityError(f"{where}: extra_key {child.extra_key!r} inside namespace {ns!r}")
                n = child.num_tokens
                if n == 0 or n % ps:
                    raise IntegrityError(f"{where}: edge of {n} tokens is empty or not a multiple of page_size={ps}")
                if len(child.key) != n * TOKEN_BYTES:
                    raise IntegrityError(f"{where}: key holds {len(child.key) // TOKEN_BYTES} tokens, value {n} slots")
                if k != child.key[:pb]:
                    raise IntegrityError(f"{where}: children-dict key differs from the edge's first page")
                if child.value.dtype != np.int64 or child.value.flags.writeable:
                    raise IntegrityError(f"{where}: slot array must be read-only int64")
                if child.lock_ref < 0:
                    raise IntegrityError(f"{where}: negative lock_ref")
                if child.hashes is not None and len(child.hashes) != n // ps:
                    raise IntegrityError(f"{where}: {len(child.hashes)} page hashes for {n // ps} pages")
                child_locks += child.lock_ref
                if child.lock_ref:
                    protected += n
                else:
                    evictable += n
                    if not child.children:
                        unlocked_leaves.append(child)
                if child.in_heap:
                    in_heap_nodes.add(id(child))
                slot_arrays.append(child.value)
                stack.append(child)
            if node.parent is not None and node.lock_ref < child_locks:
                raise IntegrityError(
                    f"{_where(node)}: lock_ref {node.lock_ref} < sum of children's lock_ref {child_locks}"
                )
    if cache._enable_events:
        _check_hashes(cache)
    if evictable != cache._evictable or protected != cache._protected:
        raise IntegrityError(
            f"size counters drifted: evictable {cache._evictable} (walk: {evictable}), "
            f"protected {cache._protected} (walk: {protected})"
        )
    if slot_arrays:
        slots = np.concatenate(slot_arrays)
        uniq, counts = np.unique(slots, return_counts=True)
        if len(uniq) != len(slots):
            raise IntegrityError(f"slots held by two nodes: {uniq[counts > 1][:10].tolist()}")
    heap_ids: dict[int, int] = {}
    for _, _, node in cache._heap:
        heap_ids[id(node)] = heap_ids.get(id(node), 0) + 1
        if not node.in_heap:
            raise IntegrityError(f"{_where(node)}: in the eviction heap but not flagged in_heap")
    if any(c > 1 for c in heap_ids.values()):
        raise IntegrityError("a node has two entries in the eviction heap")
    for node in unlocked_leaves:
        if id(node) not in heap_ids:
            raise IntegrityError(f"{_where(node)}: unlocked leaf missing from the eviction heap (never evictable)")
    for nid in in_heap_nodes:
        if nid not in heap_ids:
            raise IntegrityError("a node is flagged in_heap but has no heap entry")


def _check_hashes(cache: RadixCache) -> None:
    for ns, root in cache._roots.items():
        stack = [(c, namespace_seed(ns)) for c in root.children.values()]
        while stack:
            node, prev = stack.pop()
            want = chain_hashes(prev, node.token_ids(), cache._page_size)
            if node.hashes != want:
                raise IntegrityError(f"{_where(node)}: page hashes do not chain from the parent's last page")
            last = hash_to_bytes(want[-1])
            stack.extend((c, last) for c in node.children.values())
