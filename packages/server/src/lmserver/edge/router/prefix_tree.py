"""Approximate radix tree of the router (SGLang paper, appendix A.3: the "meta-tree").

One tree over request text (characters) for all workers: each node records which workers saw
its prefix and when. The router never sees a worker's real cache, so this is an estimate:
a worker's cached prefix is the longest path it was last sent, pruned by a per-worker size
bound with least-recently-used leaves dropped first.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    edge: str = ""
    parent: _Node | None = None
    children: dict[str, _Node] = field(default_factory=dict)  # first char of edge -> child
    last_access: dict[str, int] = field(default_factory=dict)  # worker -> logical clock


@dataclass(frozen=True)
class PrefixMatch:
    """Matched characters per worker (workers absent from the dict matched 0)."""

    matched: dict[str, int]
    text_len: int

    def best(self) -> tuple[str | None, int]:
        if not self.matched:
            return None, 0
        worker = max(sorted(self.matched), key=lambda w: self.matched[w])
        return worker, self.matched[worker]


class PrefixTree:
    """Character radix tree shared by all workers.

    `insert` and `match` refresh access times; `evict_to(worker, max_chars)` drops that
    worker's least recently used leaves until it holds at most `max_chars` characters.
    """

    def __init__(self) -> None:
        self._root = _Node()
        self._clock = itertools.count(1)
        self._chars: dict[str, int] = {}  # worker -> characters attributed to it

    def chars(self, worker: str) -> int:
        return self._chars.get(worker, 0)

    def workers(self) -> list[str]:
        return sorted(w for w, n in self._chars.items() if n > 0)

    def insert(self, text: str, worker: str) -> None:
        """Records that `worker` was sent `text` (so it now caches it). Mutates the tree."""
        now = next(self._clock)
        node = self._root
        node.last_access[worker] = now
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(edge=text[i:], parent=node, last_access={worker: now})
                node.children[text[i]] = leaf
                self._chars[worker] = self._chars.get(worker, 0) + len(text) - i
                return
            common = _common_prefix_len(child.edge, text, i)
            if common < len(child.edge):
                child = self._split(child, common)
            if worker not in child.last_access:
                self._chars[worker] = self._chars.get(worker, 0) + len(child.edge)
            child.last_access[worker] = now
            node = child
            i += common

    def match(self, text: str) -> PrefixMatch:
        """Longest prefix of `text` each worker holds. Refreshes access times of matched nodes."""
        now = next(self._clock)
        matched: dict[str, int] = {}
        node = self._root
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            common = _common_prefix_len(child.edge, text, i)
            for worker in child.last_access:
                matched[worker] = i + common
                child.last_access[worker] = now
            if common < len(child.edge):
                break
            node = child
            i += common
        return PrefixMatch(matched, len(text))

    def remove_worker(self, worker: str) -> None:
        """Forgets everything attributed to `worker` (a dropped or restarted worker)."""
        self.evict_to(worker, 0)
        self._root.last_access.pop(worker, None)

    def evict_to(self, worker: str, max_chars: int) -> int:
        """Drops `worker`'s LRU leaves until it holds <= max_chars; returns characters dropped."""
        dropped = 0
        if self.chars(worker) <= max_chars:
            return 0
        heap = [(n.last_access[worker], id(n), n) for n in self._worker_leaves(worker)]
        heapq.heapify(heap)
        while heap and self._chars[worker] > max_chars:
            _, _, node = heapq.heappop(heap)
            del node.last_access[worker]
            self._chars[worker] -= len(node.edge)
            dropped += len(node.edge)
            parent = node.parent
            if not node.last_access and not node.children and parent is not None:
                del parent.children[node.edge[0]]
            if (
                parent is not None
                and parent is not self._root
                and worker in parent.last_access
                and not any(worker in c.last_access for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.last_access[worker], id(parent), parent))
        return dropped

    def _worker_leaves(self, worker: str) -> list[_Node]:
        leaves, stack = [], [self._root]
        while stack:
            node = stack.pop()
            held = [c for c in node.children.values() if worker in c.last_access]
            if node is not self._root and worker in node.last_access and not held:
                leaves.append(node)
            stack.extend(held)
        return leaves

    def _split(self, child: _Node, at: int) -> _Node:
        parent = child.parent
        assert parent is not None and 0 < at < len(child.edge)
        mid = _Node(edge=child.edge[:at], parent=parent, last_access=dict(child.last_access))
        parent.children[mid.edge[0]] = mid
        child.edge = child.edge[at:]
        child.parent = mid
        mid.children[child.edge[0]] = child
        return mid


def _common_prefix_len(edge: str, text: str, start: int) -> int:
    n = min(len(edge), len(text) - start)
    if edge[:n] == text[start : start + n]:
        return n
    lo, hi = 0, n  # binary search on the first mismatch (string slices compare in C)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if edge[:mid] == text[start : start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
