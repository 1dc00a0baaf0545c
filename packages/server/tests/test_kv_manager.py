"""KVManager against a straightforward reference (the per-call version it replaced).

The reference keeps each request's slots in a plain array grown by concatenation, extends one
request at a time, converts `fill_ids` on every call and walks the tree for every peek
(`touch_prefix`). The KVManager under test grows slot buffers, allocates a decode round at once
and reuses each waiting request's tree path while the tree's version holds. Driven by the same
random operations, both must hand out the same slots, keep the same tree (clocks and locks
included: `pretty_print`) and the same free list, and return the same prefix lengths.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmserver.io_struct import SamplingParams
from lmserver.scheduler import KVManager, Req, Scheduler
from radixcache import RadixCache, SlotAllocator


class RefKV:
    """The reference: one tree walk and one allocation per call, `req.kv` re-concatenated."""

    def __init__(self, num_slots: int, page_size: int, disable: bool) -> None:
        self.page_size = page_size
        self.allocator = SlotAllocator(num_slots, page_size)
        self.cache = RadixCache(page_size=page_size, eviction="lru")
        self.disable = disable

    def peek(self, req: Req, touch: bool) -> int:
        if self.disable:
            return 0
        key = np.asarray(req.fill_ids, dtype=np.int64)[: req.prefix_cap(self.page_size)]  # as SGLang: len - 1
        return self.cache.touch_prefix(key, req.extra_key) if touch else self.cache.peek_prefix_len(key, req.extra_key)

    def admit(self, req: Req) -> int:
        cap = req.prefix_cap(self.page_size)
        if self.disable or cap == 0:
            req.last_node = self.cache.root
            return 0
        m = self.cache.match_prefix(req.fill_ids[:cap], req.extra_key)
        self.cache.lock(m.last_node)
        req.last_node = m.last_node
        length = m.length
        req.kv = np.array(m.indices, dtype=np.int64)
        req.kv_len = req.cached_len = length
        return length

    def extend(self, req: Req, n: int) -> bool:
        new_len = req.kv_len + n
        missing = new_len - len(req.kv)
        if missing > 0:
            slots = self.allocator.alloc(missing)
            if slots is None:
                need = -(-missing // self.page_size) * self.page_size - self.allocator.available
                freed = self.cache.evict(need)
                if len(freed):
                    self.allocator.free(freed)
                slots = self.allocator.alloc(missing)
            if slots is None:
                return False
            req.kv = np.concatenate([req.kv, slots])
        req.kv_len = new_len
        return True

    def checkpoint(self, req: Req) -> bool:
        if self.disable:
            return False
        key = req.fill_ids[: req.kv_len]
        # cached_len: the request's own locked leaf may grow in place (the frees stay manual here)
        r = self.cache.insert(key, req.kv[: req.kv_len], req.extra_key, cached_len=req.cached_len)
        replaced = r.prefix_len > req.cached_len
        if replaced:
            self.allocator.free(req.kv[req.cached_len : r.prefix_len])
        m = self.cache.match_prefix(key, req.extra_key)
        self.cache.lock(m.last_node)
        self.cache.unlock(req.last_node)
        req.last_node = m.last_node
        if replaced:
            kv = req.kv.copy()
            kv[: m.length] = m.indices
            req.kv = kv
        req.cached_len = m.length
        return replaced

    def release(self, req: Req, cache_tokens: bool) -> None:
        if cache_tokens and not self.disable and req.kv_len > 0:
            r = self.cache.insert(req.fill_ids[: req.kv_len], req.kv[: req.kv_len], req.extra_key,
                                  cached_len=req.cached_len)
            if r.prefix_len > req.cached_len:
                self.allocator.free(req.kv[req.cached_len : r.prefix_len])
            tail_start = max(self.cache.aligned_len(req.kv_len), r.prefix_len, req.cached_len)
        else:
            tail_start = req.cached_len
        if len(req.kv) > tail_start:
            self.allocator.free(req.kv[tail_start:])
        self.cache.unlock(req.last_node)
        req.reset_kv()


def _same_state(kv: KVManager, ref: RefKV, pairs: list[tuple[Req, Req]]) -> None:
    class Sink:
        def write(self, text: str) -> int:
            return len(text)

    assert kv.cache.pretty_print(file=Sink()) == ref.cache.pretty_print(file=Sink())
    assert [n.hit_count for n in kv.cache._walk()] == [n.hit_count for n in ref.cache._walk()]
    a, b = kv.allocator, ref.allocator
    assert a.available == b.available
    assert a._free[: a._top].tolist() == b._free[: b._top].tolist()  # same free list, same order
    for req, rreq in pairs:
        assert req.kv.tolist() == rreq.kv.tolist()
        assert (req.kv_len, req.cached_len) == (rreq.kv_len, rreq.cached_len)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), page_size=st.sampled_from([1, 4]), disable=st.booleans(),
       num_slots=st.sampled_from([48, 96, 400]))
def test_kv_manager_matches_the_reference(data: st.DataObject, page_size: int, disable: bool, num_slots: int) -> None:
    kv = KVManager(num_slots, page_size, disable)
    ref = RefKV(num_slots - num_slots % page_size, page_size, disable)
    heads = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]
    waiting: list[tuple[Req, Req]] = []
    active: list[tuple[Req, Req]] = []
    arrival = 0
    for _ in range(data.draw(st.integers(1, 60))):
        op = data.draw(st.sampled_from(["add", "peek", "peek", "admit", "decode", "checkpoint", "release",
                                        "rewind", "extend"]))
        if op == "add" or not (waiting or active):
            ids = data.draw(st.sampled_from(heads)) + data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=10))
            ns = data.draw(st.sampled_from([None, None, "b"]))
            out = data.draw(st.lists(st.integers(1, 12), max_size=3))  # a retracted request has outputs
            arrival += 1
            pair = tuple(Req(f"r{arrival}", ids, SamplingParams(max_new_tokens=8), 8, arrival=arrival, extra_key=ns)
                         for _ in range(2))
            for r in pair:
                r.output_ids.extend(out)
            waiting.append(pair)  # type: ignore[arg-type]
        elif op == "peek" and waiting:
            touch = data.draw(st.booleans())
            lens = kv.peek_prefix_lens([p[0] for p in waiting], touch=touch)
            assert lens == [ref.peek(p[1], touch) for p in waiting]
            if waiting and data.draw(st.booleans()):
                req, rreq = data.draw(st.sampled_from(waiting))
                assert kv.peek_prefix_len(req) == ref.peek(rreq, False)
        elif op == "admit" and waiting:
            pair = waiting.pop(data.draw(st.integers(0, len(waiting) - 1)))
            req, rreq = pair
            assert kv.admit(req) == ref.admit(rreq)
            n = req.fill_len - req.kv_len
            ok = kv.extend(req, n)
            assert ok == ref.extend(rreq, n)
            if ok:
                active.append(pair)
            else:
                kv.release(req, cache_tokens=False)
                ref.release(rreq, cache_tokens=False)
                waiting.append(pair)
        elif op == "decode" and active:
            failed = kv.extend_all([p[0] for p in active], 1)
            want = next((p[0] for p in active if not ref.extend(p[1], 1)), None)
            assert failed is want
            if failed is None:
                tok = data.draw(st.integers(1, 12))
                for req, rreq in active:  # the sampled token joins fill_ids; its KV comes next round
                    req.output_ids.append(tok)
                    rreq.output_ids.append(tok)
            else:  # undo like a retraction: give back what the round took
                for req, rreq in active:
                    req.kv_len = rreq.kv_len = min(req.kv_len, req.fill_len)
        elif op == "checkpoint" and active:
            req, rreq = data.draw(st.sampled_from(active))
            req.kv_len = rreq.kv_len = min(req.kv_len, req.fill_len)
            assert kv.checkpoint(req) == ref.checkpoint(rreq)
        elif op == "release" and active:
            pair = active.pop(data.draw(st.integers(0, len(active) - 1)))
            req, rreq = pair
            req.kv_len = rreq.kv_len = min(req.kv_len, req.fill_len)
            cache_tokens = data.draw(st.booleans())
            kv.release(req, cache_tokens)
            ref.release(rreq, cache_tokens)
            if data.draw(st.booleans()):
                waiting.append(pair)  # retracted: waits again, tokens kept
        elif op == "rewind" and waiting:
            # a waiting request's output replaced in place (same length): its kept path is stale
            req, rreq = data.draw(st.sampled_from(waiting))
            new = data.draw(st.lists(st.integers(1, 12), min_size=len(req.output_ids), max_size=len(req.output_ids)))
            req.output_ids[:] = new
            rreq.output_ids[:] = new
        elif op == "extend" and active:
            req, rreq = data.draw(st.sampled_from(active))
            n = data.draw(st.integers(0, 3))
            assert kv.extend(req, n) == ref.extend(rreq, n)
        _same_state(kv, ref, waiting + active)
        kv.cache.check_integrity()
    for req, rreq in active:
        req.kv_len = rreq.kv_len = min(req.kv_len, req.fill_len)
        kv.release(req, True)
        ref.release(rreq, True)
    _same_state(kv, ref, [])
    kv.check_invariant()


def test_times_split_between_tree_work_and_slot_bookkeeping() -> None:
    for disable in (False, True):
        kv = KVManager(256, 1, disable)
        req = Req("a", list(range(1, 40)), SamplingParams(max_new_tokens=4), 4, arrival=0)
        kv.peek_prefix_lens([req], touch=True)
        kv.admit(req)
        kv.extend(req, req.fill_len)
        kv.checkpoint(req)
        for t in range(4):
            req.output_ids.append(t + 1)
            kv.extend_all([req], 1)
        kv.release(req)
        assert kv.slot_time_s > 0
        # the cache off does no tree work at all; on, both parts are measured
        assert (kv.radix_time_s == 0.0) if disable else (kv.radix_time_s > 0)
        stats = Scheduler(kv, max_running_requests=2).stats()  # what /get_server_info reports
        assert (stats["radix_time_s"], stats["slot_time_s"]) == (kv.radix_time_s, kv.slot_time_s)


def test_slot_buffer_grows_and_keeps_the_slots() -> None:
    req = Req("a", [1, 2, 3], SamplingParams(max_new_tokens=4), 4, arrival=0)
    want: list[int] = []
    for k in range(100):
        if k % 3:
            req.append_slot(k + 10)
            want.append(k + 10)
        else:
            req.append_slots(np.arange(k, k + 5, dtype=np.int64))
            want.extend(range(k, k + 5))
        assert req.kv.tolist() == want and req.kv_alloc == len(want)
    req.kv[:3] = [7, 8, 9]  # a view: writes reach the request's slots
    assert req.kv[:3].tolist() == [7, 8, 9]
    req.reset_kv()
    assert len(req.kv) == 0


def test_kept_path_is_dropped_when_a_waiting_request_is_rewound() -> None:
    kv = KVManager(256, 1)
    req = Req("a", [1, 2, 3, 4], SamplingParams(max_new_tokens=8), 8, arrival=0)
    req.output_ids.extend([5, 6, 7])
    kv.admit(req)
    kv.extend(req, req.fill_len)
    kv.release(req)  # retracted: [1..7] cached, the request waits again
    assert kv.peek_prefix_lens([req], touch=True) == [6]  # capped: the last token is recomputed
    req.output_ids[:] = [5, 9, 9]  # same length, new tokens (jump-forward of a waiting request)
    assert kv.peek_prefix_lens([req], touch=True) == [5]
    assert kv.peek_prefix_len(req) == 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40), st.lists(st.integers(0, 2**40), max_size=10))
def test_fill_key_is_the_int64_array_of_fill_ids(input_ids: list[int], output_ids: list[int]) -> None:
    req = Req("r", input_ids, SamplingParams(max_new_tokens=4), 4, arrival=0)
    req.output_ids.extend(output_ids)
    key = req.fill_key()
    assert key.dtype == np.int64 and key.shape == (len(input_ids) + len(output_ids),)
    assert np.array_equal(key, np.array(input_ids + output_ids, dtype=np.int64))
    assert req.fill_key() is not None and np.array_equal(req.fill_key(), key)  # the cached prompt part


def test_fill_key_rejects_ids_out_of_int64_range_as_numpy_does() -> None:
    req = Req("r", [1, 2**64], SamplingParams(max_new_tokens=4), 4, arrival=0)
    try:
        req.fill_key()
    except OverflowError:
        pass
    else:  # pragma: no cover
        raise AssertionError("an id past int64 must not be accepted")


def test_release_after_another_request_extended_the_locked_leaf_in_place() -> None:
    # a's locked leaf [1..4] grows in place by b's checkpoint ([1..4, 5, 6]); a then releases
    # other tokens ([1..4, 7, 8]): the tree must split where they part, as a plain insert does
    kv, ref = KVManager(64, 1), RefKV(64, 1, False)
    pairs = []
    for rid, ids in (("a", [1, 2, 3, 4]), ("b", [1, 2, 3, 4, 5, 6])):
        req, rreq = (Req(rid, ids, SamplingParams(max_new_tokens=4), 4, arrival=0) for _ in range(2))
        assert kv.admit(req) == ref.admit(rreq)
        assert kv.extend(req, req.fill_len - req.kv_len) == ref.extend(rreq, rreq.fill_len - rreq.kv_len)
        assert kv.checkpoint(req) == ref.checkpoint(rreq)
        pairs.append((req, rreq))
        _same_state(kv, ref, pairs)
    (a, ra), (b, rb) = pairs
    for req in (a, ra):
        req.output_ids.extend([7, 8])
    assert kv.extend(a, 2) == ref.extend(ra, 2)
    kv.release(a, True)
    ref.release(ra, True)
    _same_state(kv, ref, [(b, rb)])
    kv.release(b, True)
    ref.release(rb, True)
    _same_state(kv, ref, [])
    kv.check_invariant()
    assert kv.cache.peek_prefix_len([1, 2, 3, 4, 7, 8]) == 6 and kv.cache.peek_prefix_len([1, 2, 3, 4, 5, 6]) == 6


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=12), st.lists(st.integers(0, 2**40), max_size=8), st.data())
def test_fill_key_range_is_a_slice_of_fill_key(input_ids: list[int], output_ids: list[int], data: st.DataObject) -> None:
    req = Req("r", input_ids, SamplingParams(max_new_tokens=4), 4, arrival=0)
    req.output_ids.extend(output_ids)
    end = data.draw(st.integers(0, req.fill_len))
    start = data.draw(st.integers(0, end))
    assert req.fill_key_range(start, end).tolist() == req.fill_key()[start:end].tolist()


def test_host_tier_keeps_every_history_of_a_small_device_pool() -> None:
    """KVManager with radixcache's host tier (FakeKVTransfer pools): three chats whose histories
    outgrow a 64-slot device pool reuse their whole history every turn, part of it loaded back,
    each slot holding the KV of its token's prefix; accounting holds in both tiers."""
    from radixcache.testing import FakeKVTransfer

    for policy in ("write_back", "write_through"):
        kv = KVManager(64, 1)
        pools = FakeKVTransfer()
        kv.enable_host_tier(512, pools, policy)  # type: ignore[arg-type]
        histories = [[100 * c + i for i in range(1, 21)] for c in range(3)]
        for turn in range(3):
            for c, hist in enumerate(histories):
                hist.extend(range(1000 + 10 * turn, 1010 + 10 * turn))
                req = Req(f"c{c}t{turn}", list(hist), SamplingParams(max_new_tokens=1), 1, arrival=0)
                reused = kv.admit(req)
                assert reused == (0 if turn == 0 else len(hist) - 10), (policy, turn, c, reused)
                for i, slot in enumerate(req.kv[:reused].tolist()):  # the reused KV is this prefix's
                    assert pools.device[slot] == tuple(hist[: i + 1])
                assert kv.extend(req, req.fill_len - req.kv_len)
                for i in range(reused, req.kv_len):  # "the forward"
                    pools.device[int(req.kv[i])] = tuple(hist[: i + 1])
                kv.release(req)
                kv.check_invariant()
        stats = Scheduler(kv, max_running_requests=2).stats()
        assert stats["hicache_host_hits"] > 0 and stats["hicache_loaded_tokens"] == pools.loaded > 0
        assert stats["hicache_offloaded_tokens"] == pools.offloaded > 0 and stats["hicache_dropped_tokens"] == 0
        kv.flush()
        kv.check_invariant()
        assert kv.host_stats()["hicache_host_used_slots"] == 0
