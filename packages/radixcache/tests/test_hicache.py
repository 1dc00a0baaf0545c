"""HierarchicalCache: a small device tier backed by a host tier, driven like an engine.

Oracles: `FakeKVTransfer` holds, per slot of each pool, the token prefix whose KV it stands
for (a slot handed out by an allocator is wiped first, so only a real copy or a real compute
can fill it); a naive model of every prefix ever inserted (`NaivePrefixCache` without
eviction) gives the exact match length while no tier has lost anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from radixcache import HierarchicalCache, RadixCache, SlotAllocator, TreeNode
from radixcache.testing import FakeKVTransfer, NaivePrefixCache, chunk_pool


class WipingAllocator(SlotAllocator):
    """A SlotAllocator that wipes the fake pool's entry of every slot it hands out."""

    def __init__(self, num_slots: int, page_size: int, pool: dict[int, object]) -> None:
        super().__init__(num_slots, page_size)
        self.pool = pool

    def alloc(self, num_tokens: int) -> npt.NDArray[np.int64] | None:
        slots = super().alloc(num_tokens)
        if slots is not None:
            for s in slots.tolist():
                self.pool.pop(s, None)
        return slots


def _content(ns: object, key: np.ndarray, i: int) -> object:
    """What the KV of token `i` of `key` in namespace `ns` stands for: the prefix it ends."""
    return (ns, tuple(key[: i + 1].tolist()))


def _build(dev_slots: int, host_slots: int, page_size: int, policy: str = "write_back"
           ) -> tuple[HierarchicalCache, FakeKVTransfer]:
    fake = FakeKVTransfer()
    hier = HierarchicalCache.build(WipingAllocator(dev_slots, page_size, fake.device),
                                   WipingAllocator(host_slots, page_size, fake.host), fake, write_policy=policy)
    return hier, fake


def _compute(fake: FakeKVTransfer, key: np.ndarray, ns: object, slots: np.ndarray, start: int) -> None:
    """The engine's forward: writes the KV of key[start:start+len(slots)] into `slots`."""
    for j, s in enumerate(slots.tolist()):
        if start + j < len(key):
            fake.device[s] = _content(ns, key, start + j)


def _serve(hier: HierarchicalCache, fake: FakeKVTransfer, key: np.ndarray, ns: object = None) -> int:
    """One request, admitted, computed and finished; returns the reused length."""
    dev = hier.device
    m = hier.match_prefix(key, ns, limit=len(key) - 1)
    dev.lock(m.last_node)
    new = dev.alloc(len(key) - m.length)
    assert new is not None
    _compute(fake, key, ns, new, m.length)
    hier.insert(key, np.concatenate((m.indices, new)), ns, cached_len=m.length, finished=True)
    dev.unlock(m.last_node)
    return m.length


def _check_slots(fake: FakeKVTransfer, key: np.ndarray, ns: object, slots: np.ndarray) -> None:
    for i, s in enumerate(slots.tolist()):
        assert fake.device.get(s) == _content(ns, key, i), f"device slot {s} of token {i} holds the wrong KV"


def test_evicted_prefix_comes_back_from_host() -> None:
    hier, fake = _build(64, 256, 1)
    a = np.arange(1, 41)
    b = np.arange(100, 140)
    assert _serve(hier, fake, a) == 0
    assert _serve(hier, fake, b) == 0  # evicts most of `a` from the device: offloaded
    assert hier.stats.offloaded_tokens > 0 and hier.stats.dropped_tokens == 0
    res = hier.residency(a)
    assert res.device_len + res.host_len == 40 and res.host_len > 0
    m = hier.match_prefix(np.concatenate((a, [7])), limit=40)
    assert (m.length, m.device_len, m.host_len) == (40, res.device_len, res.host_len)
    _check_slots(fake, a, None, m.indices)
    assert hier.stats.host_hits == 1 and hier.stats.host_hit_tokens == res.host_len
    assert fake.loaded == res.host_len
    hier.check_integrity()


def test_write_through_copies_at_insert_and_eviction_then_copies_nothing() -> None:
    hier, fake = _build(64, 256, 1, "write_through")
    a = np.arange(1, 41)
    _serve(hier, fake, a)
    assert hier.residency(a).device_len == 40
    assert hier.host.peek_prefix_len(a) == 40 and fake.offloaded == 40
    _serve(hier, fake, np.arange(100, 140))
    assert fake.offloaded == 80  # the second key; evicting `a` copied nothing more
    m = hier.match_prefix(a)
    assert m.length == 40 and m.host_len > 0
    _check_slots(fake, a, None, m.indices)


def test_locked_device_node_is_neither_evicted_nor_offloaded() -> None:
    hier, fake = _build(48, 256, 1)
    a = np.arange(1, 31)
    _serve(hier, fake, a)
    m = hier.match_prefix(a)
    hier.device.lock(m.last_node)
    assert hier.device.alloc(30) is None  # 18 free, the 30 cached are locked
    assert fake.offloaded == 0
    hier.device.unlock(m.last_node)
    assert hier.device.alloc(30) is not None
    assert fake.offloaded == 30


def test_host_eviction_is_lru_and_loses_only_the_host_copy() -> None:
    hier, fake = _build(32, 64, 1)
    keys = [np.arange(k * 100, k * 100 + 30) for k in range(1, 5)]
    for key in keys:
        _serve(hier, fake, key)
    # each new key pushed the previous one to the host; the host (64) kept the two newest there
    assert hier.residency(keys[3]).device_len == 30
    for key in keys[1:3]:  # on the host whole (the device may keep a page of the newest)
        assert hier.host.peek_prefix_len(key) == 30 and sum(hier.residency(key)) == 30
    assert sum(hier.residency(keys[0])) < 30  # the oldest was evicted from the host
    hier.check_integrity()


def test_load_needs_room_else_returns_the_device_part() -> None:
    hier, fake = _build(40, 256, 1)
    a = np.arange(1, 31)
    _serve(hier, fake, a)
    b = np.arange(200, 240)
    m = hier.match_prefix(b)
    hier.device.lock(m.last_node)
    got = hier.device.alloc(40)  # all 40 device slots to one request: `a` goes to the host
    assert got is not None and hier.residency(a) == (0, 30)
    m2 = hier.match_prefix(a)
    assert (m2.length, m2.host_len) == (0, 0) and hier.stats.load_failures == 1
    hier.device.allocator.free(got)  # type: ignore[union-attr]
    hier.device.unlock(m.last_node)
    assert hier.match_prefix(a).host_len == 30


def test_constructor_errors() -> None:
    fake = FakeKVTransfer()
    with pytest.raises(ValueError, match="allocator"):
        HierarchicalCache(RadixCache(), RadixCache(allocator=SlotAllocator(8)), fake)
    with pytest.raises(ValueError, match="page_size"):
        HierarchicalCache(RadixCache(1, allocator=SlotAllocator(8)), RadixCache(2, allocator=SlotAllocator(8, 2)), fake)
    with pytest.raises(ValueError, match="write_policy"):
        HierarchicalCache.build(SlotAllocator(8), SlotAllocator(8), fake, write_policy="sometimes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- state machine
@dataclass
class _Req:
    key: np.ndarray
    ns: str | None
    kv: np.ndarray  # kv[:cached_len] the device tree's (locked), the rest the request's
    cached_len: int
    last_node: TreeNode


class TieredMachine(RuleBasedStateMachine):
    """match / insert / lock / evict (device, host) / offload / load-back, checking slot
    conservation in both tiers, the KV each tree slot holds, and (while nothing was lost) the
    match length against every prefix ever inserted."""

    page_size = 1
    dev_pages = 40
    host_pages = 400
    write_policy = "write_back"
    requests = Bundle("requests")

    @initialize()
    def setup(self) -> None:
        ps = self.page_size
        self.hier, self.fake = _build(self.dev_pages * ps, self.host_pages * ps, ps, self.write_policy)
        self.host_evicted = 0

        def count(node: TreeNode, keep: int) -> None:
            self.host_evicted += len(node.value) - keep

        self.hier.host.on_evict = count
        self.model = NaivePrefixCache(ps)  # every prefix ever inserted, none ever evicted
        self.model_slot = 0
        self.running: dict[int, _Req] = {}
        self.next_id = 0
        self.pool = chunk_pool(ps)

    def _key(self, chunks: list[int], tail: list[int]) -> np.ndarray:
        toks = [t for c in chunks for t in self.pool[c]] + tail
        return np.asarray(toks, dtype=np.int64)

    def _lossless(self) -> bool:
        return self.host_evicted == 0 and self.hier.stats.dropped_tokens == 0

    def _remember(self, key: np.ndarray, ns: str | None) -> None:
        n = len(key)
        fresh = np.arange(self.model_slot, self.model_slot + n, dtype=np.int64)
        self.model_slot += n
        self.model.insert(key, fresh, ns)

    def _match(self, key: np.ndarray, ns: str | None, limit: int | None) -> tuple[int, np.ndarray, TreeNode]:
        hier = self.hier
        res = hier.residency(key, ns, limit=limit)
        m = hier.match_prefix(key, ns, limit=limit)
        assert m.device_len == res.device_len
        assert m.host_len in (0, res.host_len)
        assert m.length == m.device_len + m.host_len == len(m.indices)
        _check_slots(self.fake, key, ns, m.indices)
        if self._lossless():
            cut = key if limit is None else key[:limit]
            assert res.device_len + res.host_len == self.model.longest_prefix(cut, ns)[0]
        return m.length, m.indices, m.last_node

    @rule(target=requests, chunks=st.lists(st.integers(0, 3), max_size=5),
          tail=st.lists(st.integers(0, 3), max_size=12), ns=st.sampled_from([None, None, "a"]))
    def admit(self, chunks: list[int], tail: list[int], ns: str | None) -> int:
        key = self._key(chunks, tail)
        length, indices, node = self._match(key, ns, max(len(key) - 1, 0))
        dev = self.hier.device
        dev.lock(node)
        new = dev.alloc(len(key) - length)
        if new is None:
            dev.unlock(node)
            return -1
        _compute(self.fake, key, ns, new, length)
        rid = self.next_id
        self.next_id += 1
        self.running[rid] = _Req(key, ns, np.concatenate((indices, new)), length, node)
        return rid

    @rule(rid=consumes(requests))
    def finish(self, rid: int) -> None:
        req = self.running.pop(rid, None)
        if req is None:
            return
        self.hier.insert(req.key, req.kv, req.ns, cached_len=req.cached_len, finished=True)
        self.hier.device.unlock(req.last_node)
        self._remember(req.key, req.ns)
        if self.write_policy == "write_through" and self._lossless():
            assert self.hier.host.peek_prefix_len(req.key, req.ns) == self.hier.device.aligned_len(len(req.key))

    @rule(rid=requests)
    def checkpoint(self, rid: int) -> None:
        """A running request caches what it computed so far and re-locks at its end (with
        write-through the path is copied to the host while locked on the device)."""
        req = self.running.get(rid)
        if req is None:
            return
        dev = self.hier.device
        r = self.hier.insert(req.key, req.kv, req.ns, cached_len=req.cached_len, finished=False)
        m = dev.match_prefix(req.key, req.ns) if r.last_node.is_root else dev.match_node(r.last_node)
        assert m.length == dev.aligned_len(len(req.key))
        dev.lock(m.last_node)
        dev.unlock(req.last_node)
        req.kv = np.concatenate((m.indices, req.kv[m.length :]))
        req.cached_len = m.length
        req.last_node = m.last_node
        self._remember(req.key[: m.length], req.ns)

    @rule(rid=consumes(requests))
    def abort(self, rid: int) -> None:
        req = self.running.pop(rid, None)
        if req is None:
            return
        self.hier.device.allocator.free(req.kv[req.cached_len :])  # type: ignore[union-attr]
        self.hier.device.unlock(req.last_node)

    @rule(chunks=st.lists(st.integers(0, 3), max_size=5), tail=st.lists(st.integers(0, 3), max_size=12),
          ns=st.sampled_from([None, "a"]))
    def match_only(self, chunks: list[int], tail: list[int], ns: str | None) -> None:
        self._match(self._key(chunks, tail), ns, None)

    @rule(num_tokens=st.integers(0, 60))
    def evict_device(self, num_tokens: int) -> None:
        locked = {int(s) for r in self.running.values() for s in r.kv[: r.cached_len]}
        before = self.fake.offloaded
        self.hier.device.evict(num_tokens)
        for s in locked:  # locked slots stay allocated and hold their KV
            assert self.hier.device.allocator.is_allocated(s)  # type: ignore[union-attr]
        assert self.fake.offloaded >= before

    @rule(num_tokens=st.integers(0, 60))
    def evict_host(self, num_tokens: int) -> None:
        self.hier.host.evict(num_tokens)

    @invariant()
    def slots_are_conserved(self) -> None:
        if not hasattr(self, "hier"):
            return
        sizes = self.hier.sizes()
        owned = sum(len(r.kv) - r.cached_len for r in self.running.values())
        dev_alloc = self.hier.device.allocator
        host_alloc = self.hier.host.allocator
        assert dev_alloc is not None and host_alloc is not None
        assert sizes.device.free is not None and sizes.host.free is not None
        assert sizes.device.free + sizes.device.total + owned == dev_alloc.num_slots
        assert sizes.host.free + sizes.host.total == host_alloc.num_slots
        assert sizes.host.protected == 0  # host locks live only inside a load or an offload
        self.hier.check_integrity()

    @invariant()
    def tree_slots_hold_their_prefix(self) -> None:
        if not hasattr(self, "hier"):
            return
        for tree, pool in ((self.hier.device, self.fake.device), (self.hier.host, self.fake.host)):
            for ns in tree.namespaces():
                root = tree._roots[ns]  # noqa: SLF001 - test walks the tree
                stack: list[tuple[TreeNode, list[int]]] = [(c, []) for c in root.children.values()]
                while stack:
                    node, prefix = stack.pop()
                    path = prefix + node.token_ids().tolist()
                    for j, s in enumerate(node.value.tolist()):
                        i = len(prefix) + j
                        assert pool.get(s) == (ns, tuple(path[: i + 1])), f"slot {s} of token {i} is stale"
                    stack.extend((c, path) for c in node.children.values())
        for req in self.running.values():
            _check_slots(self.fake, req.key, req.ns, req.kv[: req.cached_len])


_SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


_CASES = {
    "large_host": {},
    "small_host": {"host_pages": 24},
    "write_through": {"write_policy": "write_through"},
    "page16": {"page_size": 16, "dev_pages": 10, "host_pages": 60},
    "page16_small_host_write_through": {"page_size": 16, "dev_pages": 10, "host_pages": 8,
                                        "write_policy": "write_through"},
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_tiered_state_machine(case: str) -> None:
    machine = type(f"Tiered_{case}", (TieredMachine,), dict(_CASES[case]))
    _SETTINGS(machine).TestCase().runTest()
