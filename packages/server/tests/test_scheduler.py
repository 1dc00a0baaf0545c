"""Scheduler unit and property tests: no torch, a fake model, an oracle of KV slot contents.

The fake forward "writes" into each new slot the hash of the token prefix it stands for, and
checks that every slot a request attends to (prefix reused from the radix cache included)
holds the hash of the same prefix of that request. Any wrong reuse, lost slot, double use or
stale table row fails the check.
"""

from __future__ import annotations

import hashlib
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmserver.io_struct import SamplingParams
from lmserver.scheduler import KVManager, Req, ReqStatus, ScheduleDecision, Scheduler
from lmserver.scheduler.pacer import MAX_STEP_FACTOR, PacerConfig, PrefillPacer

VOCAB = 50


def _h(tokens: list[int]) -> str:
    return hashlib.blake2b(repr(tokens).encode(), digest_size=8).hexdigest()


def _next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole context (never an EOS)."""
    return int(_h(tokens), 16) % VOCAB


class FakeEngine:
    def __init__(self, num_slots: int = 512, page_size: int = 1, disable: bool = False, **kw: object) -> None:
        self.kv = KVManager(num_slots, page_size, disable)
        kw.setdefault("max_running_requests", 8)
        self.sched = Scheduler(self.kv, **kw)  # type: ignore[arg-type]
        self.slot_content: dict[int, str] = {}
        self.table: dict[int, dict[int, int]] = {}
        self.finished: dict[str, Req] = {}
        self.arrival = 0
        self.decisions: list[ScheduleDecision] = []

    def add(self, rid: str, ids: list[int], max_new: int, **kw: object) -> Req:
        self.arrival += 1
        req = Req(rid, ids, SamplingParams(max_new_tokens=max_new), max_new, arrival=self.arrival, **kw)  # type: ignore[arg-type]
        self.sched.add(req)
        return req

    def step(self) -> ScheduleDecision:
        d = self.sched.schedule()
        self.decisions.append(d)
        used: set[int] = set()
        for item in d.items:
            req = self.sched.reqs[item.rid]
            row = self.table.setdefault(item.req_pool_idx, {})
            for k, slot in enumerate(item.table_slots):
                row[item.table_start + k] = slot
            fill = req.fill_ids
            assert item.token_ids == fill[item.prefix_len : item.prefix_len + len(item.token_ids)]
            for k, slot in enumerate(item.out_slots):
                assert slot not in used, "two tokens of one forward share a slot"
                assert slot >= self.kv.page_size, "padding slot handed out"
                used.add(slot)
                pos = item.prefix_len + k
                assert row[pos] == slot
                self.slot_content[slot] = _h(fill[: pos + 1])
            end = item.prefix_len + len(item.token_ids)
            for pos in range(end):  # every slot attended to holds this request's prefix
                assert self.slot_content.get(row[pos]) == _h(fill[: pos + 1]), f"bad KV at {pos} for {req}"
        self.sched.commit(d)
        for item in d.items:
            req = self.sched.reqs.get(item.rid)
            if req is None or item.prefix_len + len(item.token_ids) != req.fill_len:
                continue
            if req.remaining_new_tokens > 0:
                req.output_ids.append(_next_token(req.fill_ids))
            if req.remaining_new_tokens == 0:
                self.sched.finish(req, {"type": "length"})
                self.finished[req.rid] = req
        return d

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("scheduler made no progress")


def _expected_output(ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(_next_token(ids + out))
    return out


def test_prefix_is_reused_and_memory_returns() -> None:
    eng = FakeEngine()
    prompt = list(range(1, 41))
    eng.add("a", prompt, 5)
    eng.run()
    b = eng.add("b", prompt[:30] + [7, 7], 3)
    eng.run()
    assert b.cached_tokens == 30
    assert eng.finished["b"].output_ids == _expected_output(prompt[:30] + [7, 7], 3)
    eng.sched.check_memory_invariant()
    assert eng.kv.cache.total_size > 0
    assert eng.sched.flush_cache()
    assert eng.kv.allocator.available == eng.kv.num_slots


def test_full_prompt_hit_still_recomputes_last_token() -> None:
    eng = FakeEngine()
    eng.add("a", [1, 2, 3, 4], 1)
    eng.run()
    b = eng.add("b", [1, 2, 3, 4], 2)
    eng.run()
    assert b.cached_tokens == 3
    assert eng.finished["b"].output_ids == _expected_output([1, 2, 3, 4], 2)


def test_logprob_start_len_caps_the_reused_prefix() -> None:
    eng = FakeEngine()
    eng.add("a", list(range(1, 21)), 1)
    eng.run()
    b = eng.add("b", list(range(1, 21)), 1, logprob_start_len=5)
    eng.run()
    assert b.cached_tokens == 4  # tokens from position 4 on are recomputed (logits of 4 give token 5)


def test_chunked_prefill_splits_and_matches() -> None:
    eng = FakeEngine(chunked_prefill_size=16, max_prefill_tokens=64)
    eng.add("a", list(range(1, 50)), 4)
    d1 = eng.step()
    assert [len(i.token_ids) for i in d1.items] == [16]
    assert not d1.items[0].completes_prefill
    eng.run()
    assert eng.finished["a"].output_ids == _expected_output(list(range(1, 50)), 4)
    extend_sizes = [len(d.items[0].token_ids) for d in eng.decisions if d.mode == "extend"]
    assert extend_sizes == [16, 16, 16, 1]
    eng.sched.check_memory_invariant()


def test_abort_at_every_stage_frees_everything() -> None:
    for stage in ("waiting", "prefilling", "running"):
        eng = FakeEngine(chunked_prefill_size=8)
        eng.add("a", list(range(1, 30)), 10)
        eng.add("b", list(range(1, 12)), 10)
        if stage != "waiting":
            eng.step()
        if stage == "running":
            for _ in range(6):
                eng.step()
        status = eng.sched.reqs["a"].status
        expected = {"waiting": ReqStatus.WAITING, "prefilling": ReqStatus.PREFILLING, "running": ReqStatus.RUNNING}
        assert status == expected[stage]
        assert eng.sched.abort("a") is not None
        assert eng.sched.abort("a") is None
        eng.run()
        assert set(eng.finished) == {"b"}
        eng.sched.check_memory_invariant()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("chunk", [-1, 8])
def test_retraction_under_memory_pressure_loses_nothing(page_size: int, mixed: bool, chunk: int) -> None:
    eng = FakeEngine(
        num_slots=96, page_size=page_size, max_running_requests=6, init_new_token_ratio=0.0,
        min_new_token_ratio=0.0, enable_mixed_chunk=mixed, chunked_prefill_size=chunk,
    )
    prompts = {f"r{i}": [i + 1] * 5 + list(range(10, 20)) for i in range(6)}
    for rid, ids in prompts.items():
        eng.add(rid, ids, 30)
    eng.run()
    assert eng.sched.num_retractions > 0
    assert set(eng.finished) == set(prompts)
    for rid, ids in prompts.items():
        assert eng.finished[rid].output_ids == _expected_output(ids, 30)
    eng.sched.check_memory_invariant()


def test_lpm_serves_the_longest_cached_prefix_first() -> None:
    eng = FakeEngine(max_running_requests=1, schedule_policy="lpm")
    eng.add("warm", list(range(1, 31)), 1)
    eng.run()
    eng.add("cold", list(range(100, 130)), 1)
    eng.add("hot", list(range(1, 31)) + [5], 1)
    d = eng.step()
    assert [i.rid for i in d.items] == ["hot"]


def test_fcfs_keeps_arrival_order() -> None:
    eng = FakeEngine(max_running_requests=1, schedule_policy="fcfs")
    eng.add("warm", list(range(1, 31)), 1)
    eng.run()
    eng.add("cold", list(range(100, 130)), 1)
    eng.add("hot", list(range(1, 31)) + [5], 1)
    assert [i.rid for i in eng.step().items] == ["cold"]


def test_dfs_weight_groups_requests_of_the_heaviest_subtree() -> None:
    eng = FakeEngine(max_running_requests=8, schedule_policy="dfs-weight")
    a, b = list(range(1, 21)), list(range(30, 50))
    eng.add("wa", a, 1)
    eng.add("wb", b, 1)
    eng.run()
    eng.add("b1", b + [1], 1)
    eng.add("a1", a + [1], 1)
    eng.add("a2", a + [2], 1)
    eng.add("a3", a + [3], 1)
    order = [i.rid for i in eng.step().items]
    assert order == ["a1", "a2", "a3", "b1"]


def test_aging_bound_prevents_starvation() -> None:
    eng = FakeEngine(max_running_requests=1, schedule_policy="lpm", aging_rounds=3)
    hot = list(range(1, 31))
    eng.add("warm", hot, 1)
    eng.run()
    eng.add("cold", list(range(100, 130)), 1)
    served: list[str] = []
    for i in range(8):
        eng.add(f"hot{i}", hot + [i + 1], 1)
        d = eng.step()
        served += [item.rid for item in d.items]
    assert "cold" in served
    assert served.index("cold") <= 4


def test_in_batch_prefix_dedup_defers_sharers() -> None:
    eng = FakeEngine(max_running_requests=8)
    system = list(range(1, 60))
    eng.add("x", system + [1], 2)
    eng.add("y", system + [2], 2)
    eng.add("z", [9] * 10, 2)
    first = [i.rid for i in eng.step().items]
    assert first == ["x", "z"]
    second = eng.step()
    y_item = next(i for i in second.items if i.rid == "y")
    assert y_item.prefix_len == len(system)
    eng.run()
    assert eng.finished["y"].cached_tokens == len(system)


def test_sharers_wait_for_a_prefix_still_prefilling_in_chunks() -> None:
    """A request sharing the uncached part of a prompt that another request is prefilling in
    chunks waits for those chunks to reach the cache (then hits all of the shared part) instead of
    computing the same KV alongside; an unrelated request is admitted meanwhile."""
    eng = FakeEngine(num_slots=2048, max_running_requests=8, chunked_prefill_size=64)
    system = list(range(1, 200))
    eng.add("x", system + [1], 2)
    assert [i.rid for i in eng.step().items] == ["x"]  # first chunk of x
    eng.add("y", system + [2], 2)
    eng.add("z", [900] * 10, 2)
    rounds_deferred = 0
    while eng.sched.reqs["x"].status.name == "PREFILLING":
        rids = [i.rid for i in eng.step().items]
        if "x" in rids and eng.sched.reqs["x"].status.name == "PREFILLING":
            assert "y" not in rids
            rounds_deferred += 1
    assert rounds_deferred >= 1
    eng.run()
    from lmserver.scheduler.scheduler import IN_BATCH_PREFIX_THRESHOLD as T

    # x's last chunk (8 tokens) runs beside y: a share shorter than T is not worth a wait
    assert len(system) - T <= eng.finished["y"].cached_tokens <= len(system)
    assert eng.finished["z"].cached_tokens == 0 and "z" in eng.finished


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_a_full_batch_does_not_order_the_waiting_queue(policy: str) -> None:
    """With no free row nothing can be admitted: no round peeks or touches the waiting queue
    until a row frees up; then the cache-aware order is the same as ever."""
    eng = FakeEngine(max_running_requests=1, schedule_policy=policy)
    eng.add("warm", list(range(1, 31)), 1)
    eng.run()
    eng.add("long", list(range(100, 130)), 4)
    eng.step()  # admits "long": the one row is taken
    eng.add("cold", list(range(200, 230)), 1)
    eng.add("hot", list(range(1, 31)) + [5], 1)
    calls: list[str] = []
    for name in ("peek_prefix_lens", "match_last_nodes"):
        orig = getattr(eng.kv, name)

        def spy(*args: object, _orig: object = orig, _name: str = name, **kw: object) -> object:
            calls.append(_name)
            return _orig(*args, **kw)  # type: ignore[operator]

        setattr(eng.kv, name, spy)
    def clocks() -> list[int]:
        return [n.last_access for n in eng.kv.cache._walk()]

    for _ in range(2):  # decodes of "long" (its prefill sampled the first token)
        before = clocks()
        assert eng.step().mode == "decode"
        assert calls == [] and clocks() == before  # the waiting prefix ("hot") was not touched
    assert eng.step().mode == "decode" and "long" in eng.finished and calls == []
    # a free row again: ordered as ever (this dfs-weight serves requests at the root first)
    assert [i.rid for i in eng.step().items] == (["hot"] if policy == "lpm" else ["cold"])
    assert calls


def test_disabled_cache_same_path_no_reuse() -> None:
    eng = FakeEngine(disable=True)
    eng.add("a", list(range(1, 21)), 3)
    eng.run()
    b = eng.add("b", list(range(1, 21)), 3)
    eng.run()
    assert b.cached_tokens == 0
    assert eng.kv.cache.total_size == 0
    eng.sched.check_memory_invariant()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_in_batch_prefix_check_is_the_pairwise_one(data: st.DataObject) -> None:
    """Deferral in a round is decided by the admitted requests with the same first token only;
    the same as comparing `cached + THRESHOLD` leading tokens with every admitted request."""
    from lmserver.scheduler.scheduler import IN_BATCH_PREFIX_THRESHOLD as T

    eng = FakeEngine(num_slots=4096, max_running_requests=64, max_prefill_tokens=1 << 20)
    heads = [[1] * 80, [1] * 40 + [2] * 40, [2] * 80]
    eng.add("warm", [1] * 30, 1)
    eng.run()

    def make(i: int) -> Req:
        ids = data.draw(st.sampled_from(heads))[: data.draw(st.integers(0, 80))]
        ids = ids + data.draw(st.lists(st.integers(1, 2), max_size=8))
        req = Req(f"q{i}", ids, SamplingParams(max_new_tokens=1), 1, arrival=i,
                  extra_key=data.draw(st.sampled_from([None, "b"])))
        req.output_ids.extend(data.draw(st.lists(st.integers(1, 3), max_size=3)))
        return req

    admitted = [make(i) for i in range(data.draw(st.integers(0, 6)))]
    by_first: dict[tuple[str | None, int], list[Req]] = {}
    for other in admitted:
        if other.fill_len:
            by_first.setdefault((other.extra_key, other.fill_ids[0]), []).append(other)
    req = make(99)
    need = eng.kv.peek_prefix_len(req) + T
    naive = req.fill_len >= need and any(
        o.extra_key == req.extra_key and o.fill_len >= need and o.fill_ids[:need] == req.fill_ids[:need]
        for o in admitted
    )
    assert eng.sched._shares_uncached_prefix(req, by_first) == naive


def test_scheduler_does_not_import_torch() -> None:
    import subprocess

    code = "import sys, lmserver.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    page_size=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(["lpm", "fcfs", "dfs-weight"]),
    chunk=st.sampled_from([-1, 8, 24]),
    disable=st.booleans(),
    mixed=st.booleans(),
    num_slots=st.sampled_from([64, 128, 512]),
)
def test_random_workloads_keep_every_invariant(
    data: st.DataObject, page_size: int, policy: str, chunk: int, disable: bool, mixed: bool, num_slots: int
) -> None:
    eng = FakeEngine(
        num_slots, page_size, disable, schedule_policy=policy, chunked_prefill_size=chunk,
        enable_mixed_chunk=mixed, max_running_requests=data.draw(st.integers(1, 6)), max_prefill_tokens=40,
        init_new_token_ratio=data.draw(st.sampled_from([0.0, 0.7])), min_new_token_ratio=0.0,
    )
    prefixes = [list(range(1, 20)), list(range(20, 33)), []]
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    n = data.draw(st.integers(1, 12))
    for i in range(n):
        body = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12))
        ids = data.draw(st.sampled_from(prefixes)) + body
        # NOTE: a request must fit in the cache alone (the engine caps context_length likewise)
        max_new = min(data.draw(st.integers(0, 24)), num_slots - len(ids) - page_size)
        eng.add(f"r{i}", ids, max_new)
        expected[f"r{i}"] = _expected_output(ids, max_new)
    for _ in range(2000):
        if not eng.sched.has_work():
            break
        if data.draw(st.integers(0, 9)) == 0 and eng.sched.reqs:
            rid = data.draw(st.sampled_from(sorted(eng.sched.reqs)))
            eng.sched.abort(rid)
            aborted.add(rid)
        else:
            eng.step()
        eng.kv.cache.check_integrity()
    assert not eng.sched.has_work()
    assert set(eng.finished) | aborted == set(expected)
    for rid, req in eng.finished.items():
        assert req.output_ids == expected[rid]
    eng.sched.check_memory_invariant()


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


# --- the prefill pacer of mixed steps: a model of step cost (fixed overhead + cost per prompt token) ---


def _step_seconds(overhead: float, per_token: float, tokens: int) -> float:
    return overhead + per_token * tokens


@settings(max_examples=200, deadline=None)
@given(overhead_share=st.floats(0.0, 0.5), per_token=st.floats(1e-6, 1e-3), target=st.floats(0.01, 2.0),
       start=st.integers(1, 20_000), most=st.integers(1, 20_000))
def test_pacer_converges_monotonically_to_the_target_size(
        overhead_share: float, per_token: float, target: float, start: int, most: int) -> None:
    # NOTE: near its fixed point the size contracts at the rate overhead / target; an overhead
    # close to the target (a step that cannot get shorter) converges slowly, so it stays <= half
    overhead = overhead_share * target
    least = max(1, most // 64)
    pacer = PrefillPacer(PacerConfig(target_s=target, min_tokens=least, max_tokens=most, start_tokens=start))
    # the size whose step takes `target`, within the bounds
    ideal = min(max((target - overhead) / per_token, least), most)
    sizes = [pacer.tokens]
    for _ in range(80):
        n = pacer.tokens
        pacer.observe(n, _step_seconds(overhead, per_token, n))
        sizes.append(pacer.tokens)
        assert least <= pacer.tokens <= most
    # never overshoots: moves only toward the ideal size (up to 2 tokens of integer truncation: the
    # size is a float, each step runs its integer part), at most 2x a step
    below = sizes[0] <= ideal
    for a, b in zip(sizes, sizes[1:], strict=False):
        assert (b >= a - 2) if below else (b <= a + 2)
        assert b <= a * MAX_STEP_FACTOR + 1 and b >= a / MAX_STEP_FACTOR - 1
    assert abs(sizes[-1] - ideal) <= max(2.0, 0.02 * ideal)


def test_short_steps_of_a_small_remainder_do_not_grow_or_shrink_the_size() -> None:
    pacer = PrefillPacer(PacerConfig(target_s=0.06, min_tokens=16, max_tokens=8192, start_tokens=2048))
    pacer.observe(100, 0.004)  # the prompts ran out: a small fast step says nothing about 2,048
    assert pacer.tokens == 2048
    pacer.observe(100, 0.5)  # a small step that overran (the decode rows alone are slow): shrink
    assert pacer.tokens < 2048


@pytest.mark.parametrize("bad", [dict(target_s=0.0), dict(min_tokens=0), dict(min_tokens=10, max_tokens=5)])
def test_bad_pacer_configs_are_refused(bad: dict[str, float]) -> None:
    kw: dict[str, float] = dict(target_s=0.1, min_tokens=1, max_tokens=8, start_tokens=4)
    kw.update(bad)
    with pytest.raises(ValueError):
        PacerConfig(**kw)  # type: ignore[arg-type]


def test_mixed_steps_carry_the_decodes_and_at_most_the_pacers_prompt_tokens() -> None:
    pacer = PrefillPacer(PacerConfig(target_s=1.0, min_tokens=4, max_tokens=64, start_tokens=16))
    eng = FakeEngine(num_slots=1024, enable_mixed_chunk=True, chunked_prefill_size=64, pacer=pacer)
    eng.add("stream", [1, 2, 3], 40)
    eng.step()  # its prefill
    long_prompt = [7] * 300
    eng.add("long", long_prompt, 3)
    prefill_rounds = 0
    while "long" in eng.sched.reqs and eng.sched.reqs["long"].kv_len < len(long_prompt):
        d = eng.step()
        rids = [item.rid for item in d.items]
        assert "stream" in rids, "a running request skipped a round while a prompt prefilled"
        prompt_tokens = sum(len(item.token_ids) for item in d.items if item.rid == "long")
        assert prompt_tokens == d.paced_prefill_tokens <= pacer.tokens
        # a fake clock: this step took 1 s per 8 prompt tokens, so the pacer settles at 8
        pacer.observe(prompt_tokens, prompt_tokens / 8.0)
        prefill_rounds += 1
    assert pacer.tokens == 8
    assert prefill_rounds >= 300 // 16
    eng.run()
    assert eng.finished["stream"].output_ids == _expected_output([1, 2, 3], 40)
    assert eng.finished["long"].output_ids == _expected_output(long_prompt, 3)
    eng.sched.check_memory_invariant()
