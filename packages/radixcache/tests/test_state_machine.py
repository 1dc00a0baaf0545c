"""Property test: RadixCache + SlotAllocator driven like an engine, against the naive model.

Checked after every step: matched length and slots equal the naive longest cached prefix;
evictable + protected == total == naive total; locked prefixes are never evicted; every slot is
free in the allocator, held by exactly one node, or held by exactly one running request;
`check_integrity()` passes; a `find_prefix` path kept while the cache's `version` is unchanged
is exactly what a fresh `find_prefix` finds, and so is any kept path after `refresh_prefix` (and
after `refresh_path`, when it keeps one). Runs with page sizes 1 and 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixcache import MatchResult, PrefixPath, RadixCache, SlotAllocator, TreeNode
from radixcache.testing import NaivePrefixCache, chunk_pool

NUM_SLOTS = 512


@dataclass
class _Req:
    key: np.ndarray
    extra_key: str | None
    kv: np.ndarray  # slots for key[i]; kv[:cached_len] tree-owned, the rest request-owned
    cached_len: int
    last_node: TreeNode


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    eviction = "lru"
    options: dict = {}  # noqa: RUF012 - per-subclass RadixCache keyword options

    requests = Bundle("requests")

    @initialize()
    def setup(self) -> None:
        self.cache = RadixCache(self.page_size, self.eviction, **self.options)
        self.alloc = SlotAllocator(NUM_SLOTS, self.page_size)
        self.model = NaivePrefixCache(self.page_size)
        self.running: dict[int, _Req] = {}
        self.next_id = 0
        self.pool = chunk_pool(self.page_size)
        self.paths: list[tuple[np.ndarray, str | None, PrefixPath]] = []  # kept find_prefix results
        # slot arrays handed out by match (read-only views of node slots) and their contents
        # then: no later split, extension or trim may change them
        self.handed: list[tuple[np.ndarray, list[int]]] = []

    def _key(self, chunks: list[int], tail: list[int]) -> np.ndarray:
        toks: list[int] = []
        for c in chunks:
            toks.extend(self.pool[c])
        toks.extend(tail)
        return np.asarray(toks, dtype=np.int64)

    def _check_match(self, key: np.ndarray, extra_key: str | None) -> None:
        want_len, want_slots = self.model.longest_prefix(key, extra_key)
        assert self.cache.peek_prefix_len(key, extra_key) == want_len
        m = self.cache.match_prefix(key, extra_key)
        assert m.length == want_len, (m.length, want_len)
        assert m.indices.tolist() == want_slots
        self.handed = [*self.handed[-15:], (m.indices, want_slots)]

    def _evict_into_allocator(self, num_tokens: int) -> None:
        locked = {int(s) for r in self.running.values() for s in r.kv[: r.cached_len]}
        before = self.cache.evictable_size
        freed = self.cache.evict(num_tokens)
        assert not locked.intersection(freed.tolist()), "evicted a locked slot"
        assert len(freed) >= min(num_tokens, 1) or before == 0
        assert len(freed) >= num_tokens or self.cache.evictable_size == 0
        self.model.remove_slots(freed)
        self.alloc.free(freed)

    @rule(
        target=requests,
        chunks=st.lists(st.integers(0, 3), max_size=6),
        tail=st.lists(st.integers(0, 3), max_size=20),
        ns=st.sampled_from([None, None, "a"]),
        extra=st.integers(0, 40),
    )
    def admit(self, chunks: list[int], tail: list[int], ns: str | None, extra: int) -> int:
        key = self._key(chunks, tail)
        self._check_match(key, ns)
        m = self.cache.match_prefix(key, ns)
        self.cache.lock(m.last_node)
        need = len(key) - m.length
        new = self.alloc.alloc(need)
        if new is None:
            self._evict_into_allocator(need - self.alloc.available + self.page_size)
            new = self.alloc.alloc(need)
        return self._hold(key, ns, m, new)

    def _hold(self, key: np.ndarray, ns: str | None, m: MatchResult, new: np.ndarray | None) -> int:
        """Registers a running request holding the locked match `m` plus `new` slots; without
        slots (`new` None) unlocks the match and returns -1."""
        if new is None:
            self.cache.unlock(m.last_node)
            return -1
        kv = np.concatenate([m.indices, new])
        rid = self.next_id
        self.next_id += 1
        self.running[rid] = _Req(key, ns, kv, m.length, m.last_node)
        return rid

    def _insert(self, req: _Req) -> int:
        r = self.cache.insert(req.key, req.kv, req.extra_key)
        want_prefix = self.model.insert(req.key, req.kv, req.extra_key)
        assert r.prefix_len == want_prefix
        assert r.prefix_len >= req.cached_len
        self.alloc.free(req.kv[req.cached_len : r.prefix_len])
        return r.prefix_len

    @rule(rid=consumes(requests))
    def finish(self, rid: int) -> None:
        req = self.running.pop(rid, None)
        if req is None:
            return
        self._insert(req)
        aligned = self.cache.aligned_len(len(req.key))
        self.alloc.free(req.kv[aligned:])
        self.cache.unlock(req.last_node)

    @rule(rid=requests)
    def checkpoint(self, rid: int) -> None:
        req = self.running.get(rid)
        if req is None:
            return
        r = self.cache.insert(req.key, req.kv, req.extra_key)
        assert r.prefix_len == self.model.insert(req.key, req.kv, req.extra_key) >= req.cached_len
        self.alloc.free(req.kv[req.cached_len : r.prefix_len])
        # re-lock the end: the key walked again, or the node insert returned (no key)
        m = self.cache.match_prefix(req.key, req.extra_key) if r.last_node.is_root else self.cache.match_node(r.last_node)
        assert m.length == self.cache.aligned_len(len(req.key))
        assert m.indices.tolist() == self.model.longest_prefix(req.key, req.extra_key)[1]
        self.cache.lock(m.last_node)
        self.cache.unlock(req.last_node)
        req.kv = np.concatenate([m.indices, req.kv[m.length :]])
        req.cached_len = m.length
        req.last_node = m.last_node

    @rule(rid=requests, tail=st.lists(st.integers(0, 3), min_size=1, max_size=20))
    def decode(self, rid: int, tail: list[int]) -> None:
        """The request's key grows (its next tokens): its next checkpoint or finish extends its
        leaf in place (or adds one)."""
        req = self.running.get(rid)
        if req is None:
            return
        new = self.alloc.alloc(len(tail))
        if new is None:
            return
        req.key = np.concatenate([req.key, np.asarray(tail, dtype=np.int64)])
        req.kv = np.concatenate([req.kv, new])

    @rule(rid=consumes(requests))
    def abort(self, rid: int) -> None:
        req = self.running.pop(rid, None)
        if req is None:
            return
        self.alloc.free(req.kv[req.cached_len :])
        self.cache.unlock(req.last_node)

    @rule(num_tokens=st.integers(0, 120))
    def evict(self, num_tokens: int) -> None:
        self._evict_into_allocator(num_tokens)

    @rule(
        chunks=st.lists(st.integers(0, 3), max_size=6),
        tail=st.lists(st.integers(0, 3), max_size=20),
        ns=st.sampled_from([None, "a", "b"]),
    )
    def match_only(self, chunks: list[int], tail: list[int], ns: str | None) -> None:
        self._check_match(self._key(chunks, tail), ns)

    @rule(
        chunks=st.lists(st.integers(0, 3), max_size=6),
        tail=st.lists(st.integers(0, 3), max_size=20),
        ns=st.sampled_from([None, "a"]),
    )
    def touch(self, chunks: list[int], tail: list[int], ns: str | None) -> None:
        key = self._key(chunks, tail)
        nodes = self.cache.num_nodes()
        assert self.cache.touch_prefix(key, ns) == self.model.longest_prefix(key, ns)[0]
        assert self.cache.num_nodes() == nodes  # touching never splits

    @rule(
        chunks=st.lists(st.integers(0, 3), max_size=6),
        tail=st.lists(st.integers(0, 3), max_size=20),
        ns=st.sampled_from([None, "a"]),
    )
    def keep_path(self, chunks: list[int], tail: list[int], ns: str | None) -> None:
        key = self._key(chunks, tail)
        path = self.cache.find_prefix(key, ns)
        assert path.length == self.model.longest_prefix(key, ns)[0]
        self.paths = [*self.paths[-7:], (key, ns, path)]

    @rule(i=st.integers(0, 7))
    def touch_kept_path(self, i: int) -> None:
        if not self.paths:
            return
        key, ns, path = self.paths[i % len(self.paths)]
        if path.version != self.cache.version:
            with pytest.raises(ValueError, match="stale"):
                self.cache.touch_path(path)
            return
        assert self.cache.touch_path(path) == self.model.longest_prefix(key, ns)[0]

    @rule()
    def touch_fresh_kept_paths(self) -> None:
        fresh = [path for _, _, path in self.paths if path.version == self.cache.version]
        nodes = self.cache.num_nodes()
        self.cache.touch_paths(fresh)
        assert self.cache.num_nodes() == nodes

    @rule(i=st.integers(0, 7))
    def refresh_kept_path(self, i: int) -> None:
        if not self.paths:
            return
        j = i % len(self.paths)
        key, ns, path = self.paths[j]
        refreshed = self.cache.refresh_prefix(path, key, ns)
        assert refreshed.version == self.cache.version
        assert refreshed.length == self.model.longest_prefix(key, ns)[0]
        self.paths[j] = (key, ns, refreshed)

    @invariant()
    def handed_out_slots_never_change(self) -> None:
        for arr, slots in self.handed:
            assert arr.tolist() == slots

    @invariant()
    def refreshed_kept_paths_are_fresh_ones(self) -> None:
        for key, ns, path in self.paths:
            fresh = self.cache.find_prefix(key, ns)
            refreshed = self.cache.refresh_prefix(path, key, ns)
            assert refreshed.version == fresh.version and refreshed.length == fresh.length
            assert refreshed.node is fresh.node and refreshed.partial is fresh.partial
            assert refreshed.next_page == fresh.next_page
            kept = self.cache.refresh_path(path)  # without the key: the same, or None
            if kept is not None:
                assert kept == fresh and kept.node is fresh.node and kept.partial is fresh.partial

    @invariant()
    def kept_paths_exact_while_version_unchanged(self) -> None:
        for key, ns, path in self.paths:
            fresh = self.cache.find_prefix(key, ns)
            if fresh.version != path.version:
                continue
            assert fresh.length == path.length == self.model.longest_prefix(key, ns)[0]
            assert fresh.node is path.node and fresh.partial is path.partial

    @precondition(lambda self: not self.running)
    @rule()
    def reset_when_idle(self) -> None:
        held = self.cache.reset()
        assert sorted(held.tolist()) == sorted(self.model.slots())
        self.alloc.free(held)
        self.model.reset()

    @invariant()
    def consistent(self) -> None:
        cache = self.cache
        cache.check_integrity()
        assert cache.evictable_size + cache.protected_size == cache.total_size == self.model.total_size
        tree = self.model.slots()
        held: list[int] = []
        for req in self.running.values():
            owned = req.kv[req.cached_len :]
            if self.page_size > 1:  # the whole pages the request's slots touch
                pages = np.unique(owned // self.page_size)
                owned = (pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)
            held.extend(owned.tolist())
            assert set(req.kv[: req.cached_len].tolist()) <= tree, "a locked prefix lost its slots"
        assert len(held) == len(set(held)), "a slot is held by two requests"
        assert not tree.intersection(held), "a slot is held by a request and by the tree"
        for s in list(tree) + held:
            assert self.alloc.is_allocated(s), f"slot {s} in use but free in the allocator"
        assert len(tree) + len(held) + self.alloc.available == NUM_SLOTS, "a slot leaked"


_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("eviction", ["lru", "lfu", "fifo", "priority"])
def test_cache_matches_naive_model(page_size: int, eviction: str) -> None:
    machine = type(f"Machine_{page_size}_{eviction}", (CacheMachine,), {"page_size": page_size, "eviction": eviction})
    examples = 40 if eviction == "lru" else 12
    settings(_SETTINGS, max_examples=examples)(machine).TestCase().runTest()


@pytest.mark.parametrize("page_size", [1, 16])
def test_whole_node_mode_matches_naive_model(page_size: int) -> None:
    """SGLang's granularity: no in-place leaf extension, whole-leaf eviction."""
    options = {"merge_leaves": False, "trim_leaves": False}
    machine = type(f"MachineWhole_{page_size}", (CacheMachine,), {"page_size": page_size, "options": options})
    settings(_SETTINGS, max_examples=15)(machine).TestCase().runTest()


class EngineApiMachine(CacheMachine):
    """The same engine through the bookkeeping-owning API: the cache is given the allocator,
    admits match with `limit` (keys as lists or int32 arrays), `alloc` evicts when short,
    `insert(..., cached_len=...)` frees the duplicates (and at finish the unaligned tail), `evict`
    and `reset` free into the allocator. Checked as well: `sizes()` agrees with the naive model
    and the allocator, and `free + total + held by requests == NUM_SLOTS` after every step."""

    @initialize()
    def setup(self) -> None:
        super().setup()
        self.cache = RadixCache(self.page_size, self.eviction, allocator=self.alloc, **self.options)
        self.finished: list[tuple[np.ndarray, str | None]] = []

    def _alloc(self, num_tokens: int) -> np.ndarray | None:
        """`cache.alloc`; the model drops what it evicted. None only when free + evictable
        cannot cover it (then nothing was evicted)."""
        before = self._tree_slots()
        free_before, evictable = self.alloc.available, self.cache.evictable_size
        new = self.cache.alloc(num_tokens)
        evicted = sorted(before - self._tree_slots())
        if evicted:
            self.model.remove_slots(np.asarray(evicted, dtype=np.int64))
        if new is None:
            assert self.alloc.alloc_size(num_tokens) > free_before + evictable and not evicted
        else:
            assert len(new) == self.alloc.alloc_size(num_tokens)
        return new

    def _evict_into_allocator(self, num_tokens: int) -> None:
        locked = {int(s) for r in self.running.values() for s in r.kv[: r.cached_len]}
        before = self.model.slots()
        assert len(self.cache.evict(num_tokens)) == 0  # freed into the allocator
        cached_now = self._tree_slots()
        freed = sorted(before - cached_now)
        assert not locked.intersection(freed), "evicted a locked slot"
        assert len(freed) >= min(num_tokens, len(before) - len(locked)) or not self.cache.evictable_size
        self.model.remove_slots(np.asarray(freed, dtype=np.int64))
        for s in freed:
            assert not self.alloc.is_allocated(s), f"evicted slot {s} not back in the allocator"

    def _tree_slots(self) -> set[int]:
        out: set[int] = set()
        for node in self.cache._walk():
            out.update(node.value.tolist())
        return out

    @rule(
        target=CacheMachine.requests,
        chunks=st.lists(st.integers(0, 3), max_size=6),
        tail=st.lists(st.integers(0, 3), max_size=20),
        ns=st.sampled_from([None, None, "a"]),
        kind=st.sampled_from(["list", "int32", "int64"]),
        cut=st.integers(0, 3),
        budget=st.integers(0, 200),
    )
    def admit(self, chunks: list[int], tail: list[int], ns: str | None, kind: str, cut: int, budget: int) -> int:
        """Admission with a decode budget: slots past the key, held until the finish."""
        key = self._key(chunks, tail)
        m = self._match_limited(key, ns, kind, cut)
        self.cache.lock(m.last_node)
        new = self._alloc(len(key) - m.length + budget)
        return self._hold(key, ns, m, new)

    def _match_limited(self, key: np.ndarray, ns: str | None, kind: str, cut: int) -> MatchResult:
        limit = max(len(key) - cut, 0)
        want_len, want_slots = self.model.longest_prefix(key[:limit], ns)
        given = key.tolist() if kind == "list" else key.astype(np.int32) if kind == "int32" else key
        m = self.cache.match_prefix(given, ns, limit=limit)
        assert (m.length, m.indices.tolist()) == (want_len, want_slots) and m.length <= limit
        return m

    @rule(i=st.integers(0, 7), kind=st.sampled_from(["list", "int32", "int64"]), cut=st.integers(0, 2))
    def match_finished_again(self, i: int, kind: str, cut: int) -> None:
        """A finished request's key again (often cached whole): the limit must hold."""
        if self.finished:
            key, ns = self.finished[i % len(self.finished)]
            self._match_limited(key, ns, kind, cut)

    @rule(rid=CacheMachine.requests, tail=st.lists(st.integers(0, 3), min_size=1, max_size=20))
    def decode(self, rid: int, tail: list[int]) -> None:
        """The key grows into the request's spare slots first, then into `cache.alloc`'s."""
        req = self.running.get(rid)
        if req is None:
            return
        need = len(tail) - (len(req.kv) - len(req.key))
        if need > 0:
            new = self._alloc(need)
            if new is None:
                return
            req.kv = np.concatenate([req.kv, new])
        req.key = np.concatenate([req.key, np.asarray(tail, dtype=np.int64)])

    def _settle(self, req: _Req, finished: bool) -> int:
        value = req.kv if finished else req.kv[: len(req.key)]
        held_before = self._req_pages(value[req.cached_len :])
        r = self.cache.insert(req.key, value, req.extra_key, cached_len=req.cached_len, finished=finished)
        assert len(r.free) == 0  # freed into the allocator
        assert r.prefix_len == self.model.insert(req.key, req.kv, req.extra_key) >= req.cached_len
        aligned = self.cache.aligned_len(len(req.key))
        kept = self._req_pages(value[r.prefix_len : aligned]) | (set() if finished else self._req_pages(value[aligned:]))
        for page in held_before:  # exactly the pages neither the tree took nor the request keeps
            assert self.alloc.is_allocated(page * self.page_size) == (page in kept), page
        return r.prefix_len

    def _req_pages(self, slots: np.ndarray) -> set[int]:
        return {int(s) // self.page_size for s in slots}

    @rule(rid=consumes(CacheMachine.requests))
    def finish(self, rid: int) -> None:
        req = self.running.pop(rid, None)
        if req is None:
            return
        self._settle(req, finished=True)
        self.cache.unlock(req.last_node)
        self.finished = [*self.finished[-7:], (req.key, req.extra_key)]

    @rule(rid=CacheMachine.requests)
    def checkpoint(self, rid: int) -> None:
        req = self.running.get(rid)
        if req is None:
            return
        self._settle(req, finished=False)
        m = self.cache.match_prefix(req.key, req.extra_key)
        self.cache.lock(m.last_node)
        self.cache.unlock(req.last_node)
        req.kv = np.concatenate([m.indices, req.kv[m.length :]])
        req.cached_len = m.length
        req.last_node = m.last_node

    @precondition(lambda self: not self.running)
    @rule()
    def reset_when_idle(self) -> None:
        assert len(self.cache.reset()) == 0
        self.model.reset()

    @invariant()
    def sizes_agree(self) -> None:
        s = self.cache.sizes()
        assert s.total == s.evictable + s.protected == self.model.total_size
        held = {p for r in self.running.values() for p in self._req_pages(r.kv[r.cached_len :])}
        assert s.free == self.alloc.available
        assert s.free + s.total + len(held) * self.page_size == NUM_SLOTS, "a slot leaked"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("merge", [True, False])
def test_engine_api_conserves_slots(page_size: int, merge: bool) -> None:
    """The bookkeeping-owning API (allocator given to the cache) against the naive model."""
    options = {} if merge else {"merge_leaves": False, "trim_leaves": False}
    machine = type(f"EngineApi_{page_size}_{merge}", (EngineApiMachine,), {"page_size": page_size, "options": options})
    settings(_SETTINGS, max_examples=30)(machine).TestCase().runTest()
