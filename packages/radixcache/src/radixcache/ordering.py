"""Cache-aware ordering of waiting requests (SGLang paper, section 3: longest shared prefix first,
equivalent to a depth-first walk of the tree), with an aging bound against starvation.

Aging bound (the paper leaves starvation open). A request is *starving* once it has waited
`max_wait_rounds` rounds (`waited_rounds[i] >= max_wait_rounds`). The oldest starving request
(most rounds waited, then arrival index) is put first; every other request, starving or not,
keeps its cache-aware place. Hence, if every round admits at least the first request of the
order, a request that arrives while `N` requests are already waiting is admitted after at most
`max_wait_rounds + N` rounds of waiting: once it starves, only starving requests that arrived
before it are older, each round admits the oldest, and when it is the oldest it is first.
Deferral (below) never breaks this: it moves a request behind an earlier one of the same round,
and the first request has none. Putting only one starving request first (rather than all of
them) keeps the cache-aware order for the rest: under memory pressure, a crowd of starving
requests admitted together evicts the prefixes everyone else is about to reuse. `AgingQueue` keeps the counts; `tests/test_ordering.py` checks
the bound against an adversarial arrival stream.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Generic, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from radixcache.cache import RadixCache
from radixcache.keys import KeyLike, as_key
from radixcache.node import TreeNode


class PrefixIndex(Protocol):
    """What `longest_prefix_first` needs from a cache: the page size, a non-mutating prefix
    length, and (with `touch=True`) a prefix length that refreshes the path's access clocks.
    Any prefix cache can be ordered, not only `RadixCache`."""

    @property
    def page_size(self) -> int: ...

    def peek_prefix_len(self, key: KeyLike, extra_key: Hashable = None) -> int: ...

    def touch_prefix(self, key: KeyLike, extra_key: Hashable = None) -> int: ...


class Ordering(NamedTuple):
    """`order` is a permutation of the waiting requests' indices, best first. The first
    `num_ready` are worth admitting this round; the others share at least `defer_shared_tokens`
    uncached tokens with an earlier ready request, so admitting them after it has been inserted
    turns those tokens into hits. `order[0]` is never deferred (the aging bound relies on it)."""

    order: list[int]
    num_ready: int


def _normalize(
    keys: Sequence[KeyLike], extra_keys: Sequence[Hashable] | None, waited_rounds: Sequence[int] | None
) -> tuple[list[npt.NDArray[np.int64]], list[Hashable], list[int]]:
    arrs = [as_key(k) for k in keys]
    n = len(arrs)
    eks: list[Hashable] = list(extra_keys) if extra_keys is not None else [None] * n
    waits = list(waited_rounds) if waited_rounds is not None else [0] * n
    if len(eks) != n or len(waits) != n:
        raise ValueError(
            f"keys ({n}), extra_keys ({len(eks)}) and waited_rounds ({len(waits)}) must have equal lengths"
        )
    return arrs, eks, waits


def _check_defer(defer_shared_tokens: int | None, page_size: int) -> None:
    if defer_shared_tokens is not None and defer_shared_tokens < page_size:
        raise ValueError(
            f"defer_shared_tokens={defer_shared_tokens} must be >= page_size={page_size} (or None)"
        )


def _split_starving(waits: list[int], max_wait_rounds: int | None) -> tuple[list[int], list[int]]:
    """([the oldest starving request] or [], every other index)."""
    if max_wait_rounds is None or not waits:
        return [], list(range(len(waits)))
    oldest = min(range(len(waits)), key=lambda i: (-waits[i], i))
    if waits[oldest] < max_wait_rounds:
        return [], list(range(len(waits)))
    return [oldest], [i for i in range(len(waits)) if i != oldest]


def _with_deferral(
    cache: PrefixIndex,
    arrs: list[npt.NDArray[np.int64]],
    eks: list[Hashable],
    cached: list[int],
    starving: list[int],
    ranked: list[int],
    defer_shared_tokens: int | None,
) -> Ordering:
    if defer_shared_tokens is None:
        return Ordering(starving + ranked, len(starving) + len(ranked))
    ps = cache.page_size
    # NOTE: two requests share >= T >= page_size uncached tokens only if they have the same
    # cached length and the same tokens up to one page past it, so only such a bucket is
    # compared, on the suffixes past the cached prefix.
    buckets: dict[tuple[Hashable, int, bytes], list[int]] = {}
    order = starving + ranked
    for i in order:
        c = cached[i]
        if len(arrs[i]) - c >= defer_shared_tokens:
            buckets.setdefault((eks[i], c, arrs[i][: c + ps].tobytes()), []).append(i)
    deferred_set: set[int] = set()
    for members in buckets.values():
        if len(members) < 2:
            continue
        batch = RadixCache(ps)  # suffixes of the bucket's requests already chosen this round
        for i in members:
            suffix = arrs[i][cached[i] :]
            if batch.peek_prefix_len(suffix) >= defer_shared_tokens:
                deferred_set.add(i)
                continue
            batch.insert(suffix, np.zeros(len(suffix), dtype=np.int64))
    ready = [i for i in order if i not in deferred_set]
    return Ordering(ready + [i for i in order if i in deferred_set], len(ready))


def longest_prefix_first(
    cache: PrefixIndex,
    keys: Sequence[KeyLike],
    *,
    extra_keys: Sequence[Hashable] | None = None,
    waited_rounds: Sequence[int] | None = None,
    max_wait_rounds: int | None = 8,
    defer_shared_tokens: int | None = None,
    touch: bool = False,
) -> Ordering:
    """Order waiting requests by longest cached prefix (ties: arrival index); the oldest starving
    request, if any, first (see the module docstring).

    `keys[i]` is request i's token ids, `waited_rounds[i]` the rounds it has waited (default 0),
    `max_wait_rounds=None` disables aging. Mutates nothing, unless `touch=True`: then the cached
    prefix of every waiting request gets a fresh access clock (`touch_prefix`), so that LRU keeps
    what waiting requests are about to reuse (recommended once per scheduling round; see the
    benchmark results). `cache` may be any `PrefixIndex`.
    """
    arrs, eks, waits = _normalize(keys, extra_keys, waited_rounds)
    _check_defer(defer_shared_tokens, cache.page_size)
    measure = cache.touch_prefix if touch else cache.peek_prefix_len
    cached = [measure(a, e) for a, e in zip(arrs, eks, strict=True)]
    starving, rest = _split_starving(waits, max_wait_rounds)
    rest.sort(key=lambda i: (-cached[i], i))
    return _with_deferral(cache, arrs, eks, cached, starving, rest, defer_shared_tokens)


def dfs_weight_order(
    cache: RadixCache,
    keys: Sequence[KeyLike],
    *,
    extra_keys: Sequence[Hashable] | None = None,
    waited_rounds: Sequence[int] | None = None,
    max_wait_rounds: int | None = 8,
    defer_shared_tokens: int | None = None,
    touch: bool = False,
) -> Ordering:
    """Order waiting requests by a depth-first walk of the tree, heaviest subtree first.

    Each request hangs at the deepest node its key fully matches; a node's weight is the number
    of requests in its subtree. The walk visits a node's children by descending weight, then emits
    the requests hanging at the node itself (arrival order): requests sharing a cached prefix run
    back to back, deeper matches before shallower ones, and requests that match nothing come
    last. (SGLang emits a node's own requests before its children; under memory pressure that
    admits unmatched requests first, which evicts the prefixes the others wait for.)
    The oldest starving request, if any, comes first (see the module docstring). Mutates nothing unless
    `touch=True` (as in `longest_prefix_first`).
    """
    arrs, eks, waits = _normalize(keys, extra_keys, waited_rounds)
    _check_defer(defer_shared_tokens, cache.page_size)
    if touch:
        for a, e in zip(arrs, eks, strict=True):
            cache.touch_prefix(a, e)
    starving, rest = _split_starving(waits, max_wait_rounds)
    cached = [0] * len(arrs)
    at_node: dict[int, list[int]] = {}
    weight: dict[int, int] = {}
    children_of: dict[int, list[TreeNode]] = {}
    roots: dict[int, TreeNode] = {}
    for i in rest:
        length, node, _, _ = cache._peek(arrs[i], eks[i])
        cached[i] = length
        if node is None:  # namespace not cached at all: hang on a synthetic per-namespace slot
            node = cache.root
        at_node.setdefault(id(node), []).append(i)
        cur: TreeNode | None = node
        while cur is not None:
            first = id(cur) not in weight
            weight[id(cur)] = weight.get(id(cur), 0) + 1
            parent = cur.parent
            if parent is None:
                roots[id(cur)] = cur
            elif first:
                children_of.setdefault(id(parent), []).append(cur)
            cur = parent
    ranked: list[int] = []
    # post-order: a subtree's deeper matches first, then the requests hanging at the node itself
    stack: list[tuple[TreeNode, bool]] = [(r, False) for r in sorted(roots.values(), key=lambda r: weight[id(r)])]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            ranked.extend(at_node.get(id(node), ()))
            continue
        stack.append((node, True))
        kids = children_of.get(id(node), [])
        kids.sort(key=lambda c: weight[id(c)])  # heaviest popped first
        stack.extend((c, False) for c in kids)
    if defer_shared_tokens is not None:
        for i in starving:
            cached[i] = cache.peek_prefix_len(arrs[i], eks[i])
    return _with_deferral(cache, arrs, eks, cached, starving, ranked, defer_shared_tokens)


ReqId = TypeVar("ReqId", bound=Hashable)


class AgingQueue(Generic[ReqId]):
    """A waiting queue that counts rounds waited and orders with a cache-aware policy.

    Use per scheduling round: `ordering = q.order(cache)`, admit a prefix of it, then
    `q.end_round(admitted_ids)`. Bound: see the module docstring.
    """

    def __init__(self, policy: str = "lpm", max_wait_rounds: int | None = 8,
                 defer_shared_tokens: int | None = None, touch: bool = False) -> None:
        if policy not in ("lpm", "dfs-weight"):
            raise ValueError(f"policy must be 'lpm' (longest prefix first) or 'dfs-weight', got {policy!r}")
        if max_wait_rounds is not None and max_wait_rounds < 0:
            raise ValueError(f"max_wait_rounds must be >= 0 or None, got {max_wait_rounds}")
        self._policy = policy
        self._max_wait = max_wait_rounds
        self._defer = defer_shared_tokens
        self._touch = touch
        self._ids: list[ReqId] = []
        self._keys: list[npt.NDArray[np.int64]] = []
        self._extra: list[Hashable] = []
        self._waits: list[int] = []

    def __len__(self) -> int:
        return len(self._ids)

    def push(self, req_id: ReqId, key: KeyLike, extra_key: Hashable = None) -> None:
        """Append a waiting request (arrival order is push order). Mutates the queue."""
        self._ids.append(req_id)
        self._keys.append(as_key(key))
        self._extra.append(extra_key)
        self._waits.append(0)

    def waited_rounds(self, req_id: ReqId) -> int:
        return self._waits[self._ids.index(req_id)]

    def order(self, cache: RadixCache) -> tuple[list[ReqId], int]:
        """(request ids best first, number ready this round). Mutates nothing in the queue; the
        cache's access clocks only when built with `touch=True`."""
        fn = longest_prefix_first if self._policy == "lpm" else dfs_weight_order
        o = fn(cache, self._keys, extra_keys=self._extra, waited_rounds=self._waits,
               max_wait_rounds=self._max_wait, defer_shared_tokens=self._defer, touch=self._touch)
        return [self._ids[i] for i in o.order], o.num_ready

    def end_round(self, admitted: Sequence[ReqId]) -> None:
        """Remove the admitted requests; every request still waiting has waited one more round."""
        gone = set(admitted)
        keep = [i for i, r in enumerate(self._ids) if r not in gone]
        if len(keep) != len(self._ids) - len(gone):
            raise ValueError("end_round: an admitted id is not waiting (or appears twice)")
        self._ids = [self._ids[i] for i in keep]
        self._keys = [self._keys[i] for i in keep]
        self._extra = [self._extra[i] for i in keep]
        self._waits = [self._waits[i] + 1 for i in keep]
