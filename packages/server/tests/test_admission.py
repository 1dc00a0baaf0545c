"""SLO admission (scheduler/admission.py) against a naive model of a device. No torch, no clock.

The simulated device takes `a + b * rows` seconds (of a made-up clock) for a decode step and
`e0 + e1 * prompt_rows` more for a step that also computes prompt rows. A few long "streams"
decode, then a storm of short requests arrives at once. Without the admission the storm joins the
batch as rows allow and the streams' steps slow down (the test shows it does); with a target the
streams' mean gap over the storm stays within the target plus the credit's cap spread over the
run, and every request still finishes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.io_struct import SamplingParams
from lmserver.scheduler import KVManager, Req, ReqStatus, Scheduler
from lmserver.scheduler.admission import AdmissionConfig, LinearFit, StepBudget


class Device:
    """The naive cost model: a decode step of `rows` rows, plus the prompt rows' extra."""

    def __init__(self, a: float, b: float, e0: float, e1: float) -> None:
        self.a, self.b, self.e0, self.e1 = a, b, e0, e1

    def step_s(self, decode_rows: int, prompt_rows: int) -> float:
        t = self.a + self.b * (decode_rows + prompt_rows)
        return t + (self.e0 + self.e1 * prompt_rows if prompt_rows else 0.0)


def simulate(device: Device, budget: StepBudget | None, *, streams: int = 4, storm: int = 60,
             stream_tokens: int = 600, storm_tokens: int = 24, max_rows: int = 128, trickle: bool = False,
             chunk: int = 8192) -> dict[str, object]:
    """Runs the streams, then the storm, to the end. Returns the streams' gaps while any storm
    request was unfinished, every step's (decode rows, prompt rows, seconds), and the finished ids.
    `trickle`: the storm's requests arrive one a step (as compiles finish), not all at once."""
    kv = KVManager(16384, 1, False)
    sched = Scheduler(kv, max_running_requests=max_rows, enable_mixed_chunk=True, admission=budget,
                      chunked_prefill_size=chunk)
    arrival = 0

    def add(rid: str, n_prompt: int, max_new: int) -> None:
        nonlocal arrival
        arrival += 1
        ids = [(arrival * 7 + k) % 50 + 1 for k in range(n_prompt)]  # distinct prompts: no prefix reuse
        sched.add(Req(rid, ids, SamplingParams(max_new_tokens=max_new), max_new, arrival=arrival))

    for i in range(streams):
        add(f"s{i}", 16, stream_tokens)
    finished: set[str] = set()
    steps: list[tuple[int, int, float]] = []
    storm_gaps: list[float] = []
    stormed = False
    pending = 0  # storm requests still to arrive (trickle)
    for _ in range(100_000):
        if not sched.has_work() and not pending:
            break
        if not stormed and len(sched.running) == streams and all(len(r.output_ids) >= 20 for r in sched.running):
            pending = storm
            stormed = True
        for _ in range(min(pending, 1) if trickle else pending):
            add(f"g{storm - pending}", 12, storm_tokens)
            pending -= 1
        d = sched.schedule()
        prompt = [it for it in d.items if sched.reqs[it.rid].status == ReqStatus.PREFILLING]
        decode_rows = len(d.items) - len(prompt)
        seconds = device.step_s(decode_rows, len(prompt))
        steps.append((decode_rows, len(prompt), seconds))
        streams_decoding = sum(1 for it in d.items if it.rid.startswith("s") and it not in prompt)
        if stormed and streams_decoding and any(r.startswith("g") for r in sched.reqs):
            storm_gaps.append(seconds)
        sched.commit(d)
        for it in d.items:
            req = sched.reqs.get(it.rid)
            if req is None or it.prefix_len + len(it.token_ids) != req.fill_len:
                continue
            req.output_ids.append(1)
            if req.remaining_new_tokens == 0:
                sched.finish(req, {"type": "length"})
                finished.add(req.rid)
        if budget is not None:
            budget.observe(decode_rows, len(prompt), seconds)
    else:
        raise AssertionError("no progress")
    return {"storm_gaps": storm_gaps, "steps": steps, "finished": finished, "sched": sched}


H200_LIKE = Device(a=0.00470, b=0.00002, e0=0.012, e1=0.00005)  # ~4.9 ms at 8 rows, ~6.8 at 104; eager prefill ~+12 ms


def test_without_admission_the_storm_slows_the_streams() -> None:
    """The reference the admission must beat: every storm request joins at once."""
    out = simulate(H200_LIKE, None)
    calm = H200_LIKE.step_s(4, 0)
    gaps = out["storm_gaps"]
    assert len(out["finished"]) == 64
    assert max(gaps) > calm * 1.2 or np.mean(gaps) > calm * 1.1


@pytest.mark.parametrize("slack", [1.05, 1.1, 1.25])
def test_admission_keeps_the_streams_within_target(slack: float) -> None:
    calm = H200_LIKE.step_s(4, 0)
    cfg = AdmissionConfig(target_s=calm * slack, max_step_s=0.06)
    budget = StepBudget(cfg)
    out = simulate(H200_LIKE, budget)
    gaps: list[float] = out["storm_gaps"]  # type: ignore[assignment]
    assert len(out["finished"]) == 64  # everyone is served
    # credit accounting: sum(gap - target) <= cap + the unpaid first prefill step (its extra was not known yet)
    first_extra = max(s for d, p, s in out["steps"] if p) - cfg.target_s
    assert sum(g - cfg.target_s for g in gaps) <= budget.cap_s + first_extra + 1e-9
    assert np.mean(gaps) <= cfg.target_s + (budget.cap_s + first_extra) / len(gaps) + 1e-12
    assert max(gaps) <= max(cfg.max_step_s, first_extra + cfg.target_s)
    assert budget.num_deferred > 0  # the limit did something


@settings(max_examples=25, deadline=None)
@given(a=st.floats(0.002, 0.02), b_frac=st.floats(0.0, 0.05), e0_frac=st.floats(0.0, 5.0),
       e1_frac=st.floats(0.0, 0.2), slack=st.floats(1.02, 1.5), streams=st.integers(1, 6))
def test_admission_property(a: float, b_frac: float, e0_frac: float, e1_frac: float, slack: float,
                            streams: int) -> None:
    """Any linear device: every request finishes and the streams' overrun of the target over the
    storm stays within the credit's cap plus the first (unmeasured) prefill step and the probe
    steps taken before the slope was known."""
    device = Device(a, a * b_frac, a * e0_frac, a * e1_frac)
    calm = device.step_s(streams, 0)
    budget = StepBudget(AdmissionConfig(target_s=calm * slack))
    out = simulate(device, budget, streams=streams, storm=40, stream_tokens=400, storm_tokens=16)
    assert len(out["finished"]) == streams + 40
    steps: list[tuple[int, int, float]] = out["steps"]  # type: ignore[assignment]
    target = budget.config.target_s
    first_extra = max((s - target for d, p, s in steps if p and d), default=0.0)
    # a probe: the batch grows probe_rows past the largest measured before the slope is known
    probe = budget.config.probe_rows * device.b * 2 * len(steps) / 50
    gaps: list[float] = out["storm_gaps"]  # type: ignore[assignment]
    assert sum(g - target for g in gaps) <= budget.cap_s + max(first_extra, 0.0) + probe + 1e-9


def test_no_decoding_means_no_limit() -> None:
    budget = StepBudget(AdmissionConfig(target_s=0.001))
    budget.observe(8, 0, 0.5)  # far over the target
    assert budget.admit_limit(active=8, decoding=0) is None
    assert budget.admit_limit(active=8, decoding=8) == 0


def test_row_limit_follows_the_fitted_line() -> None:
    """a + b * rows <= target: the largest admissible batch, from steps measured at two sizes."""
    budget = StepBudget(AdmissionConfig(target_s=0.006, credit_cap_steps=0))
    for rows in (8, 16) * 20:
        budget.observe(rows, 0, 0.004 + 0.0001 * rows)
    budget.credit = 1.0  # the credit is not what this test limits by
    # (0.006 - 0.004) / 0.0001 = 20 rows in all
    assert budget.admit_limit(active=8, decoding=8) == 12
    assert budget.admit_limit(active=20, decoding=20) == 0
    assert budget.admit_limit(active=25, decoding=25) == 0


def test_probe_before_the_slope_is_known() -> None:
    budget = StepBudget(AdmissionConfig(target_s=0.006, probe_rows=4))
    for _ in range(10):
        budget.observe(8, 0, 0.005)
    assert budget.admit_limit(active=8, decoding=8) == 4  # 8 + probe_rows
    over = StepBudget(AdmissionConfig(target_s=0.004))
    over.observe(8, 0, 0.005)
    assert over.admit_limit(active=8, decoding=8) == 0  # the running batch alone is over the target


def test_prefill_step_waits_for_credit() -> None:
    """An admitting step's overrun (its extra over a decode step) must be covered by the credit."""
    budget = StepBudget(AdmissionConfig(target_s=0.006, credit_cap_steps=100))
    for rows in (8, 9) * 20:
        budget.observe(rows, 0, 0.005)  # 1 ms under the target each: credit 40 ms
    budget.observe(8, 4, 0.025)  # a prefill step: 20 ms over a decode step
    budget.observe(8, 8, 0.025)
    credit = budget.credit
    assert credit == pytest.approx(0.040 - 2 * 0.019)
    assert budget.admit_limit(active=8, decoding=8) == 0  # 25 ms - 6 ms > credit
    assert not budget.extend_affordable(8, 1)
    for _ in range(30):
        budget.observe(8, 0, 0.005)
    assert budget.admit_limit(active=8, decoding=8) > 0
    assert budget.extend_affordable(8, 1)


@settings(max_examples=50, deadline=None)
@given(points=st.lists(st.tuples(st.integers(1, 200), st.floats(0.001, 0.1)), min_size=2, max_size=40),
       forget=st.floats(0.5, 0.999))
def test_linear_fit_is_weighted_least_squares(points: list[tuple[int, float]], forget: float) -> None:
    """The oracle: numpy's weighted polyfit with weights forget ** age (np.polyfit weighs residuals by w)."""
    fit = LinearFit(forget)
    for x, y in points:
        fit.add(x, y)
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points])
    w = forget ** np.arange(len(points) - 1, -1, -1, dtype=float)
    coef = fit.coefficients()
    assert coef is not None
    mean_x = float(np.average(xs, weights=w))
    var = float(np.average((xs - mean_x) ** 2, weights=w))
    if var < fit.min_var:
        assert coef[1] == 0.0 and coef[0] == pytest.approx(float(np.average(ys, weights=w)))
        return
    b, a = np.polyfit(xs, ys, 1, w=np.sqrt(w))
    if b < 0:  # clamped to 0 (a slope of rounding size may land either side of 0 in the two computations)
        assert coef[1] == pytest.approx(0.0, abs=1e-9)
        return
    assert coef[1] == pytest.approx(b, rel=1e-6, abs=1e-9)
    assert coef[0] == pytest.approx(a, rel=1e-6, abs=1e-9)


def test_config_rejects_bad_values() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            AdmissionConfig(target_s=bad)
    with pytest.raises(ValueError):
        AdmissionConfig(target_s=0.01, forget=1.0)


# --- the relative target (the default on CUDA): slowdown x the protected requests' start step ---------


@pytest.mark.parametrize("trickle", [False, True])
@pytest.mark.parametrize("slowdown", [1.05, 1.25])
def test_relative_target_keeps_the_streams_within_their_slowdown(slowdown: float, trickle: bool) -> None:
    """The streams start with nothing waiting (protected, start batch 4); the storm arrives at once
    (admitted from a backlog: protected only once the queue empties) or one request a step (as
    compiles finish: each protected by its own start batch). The streams' overrun of slowdown x
    their calm step stays within the credit's cap plus the first (unmeasured) prefill step; every
    request finishes; without the admission the same storm slows them more."""
    calm = H200_LIKE.step_s(4, 0)
    budget = StepBudget(AdmissionConfig(slowdown=slowdown, max_step_s=0.06))
    out = simulate(H200_LIKE, budget, trickle=trickle)
    assert len(out["finished"]) == 64
    target = slowdown * calm
    assert out["sched"].schedule().mode == "idle"  # type: ignore[attr-defined]
    assert budget.target_s is None  # everyone ended: nothing protected
    steps: list[tuple[int, int, float]] = out["steps"]  # type: ignore[assignment]
    gaps: list[float] = out["storm_gaps"]  # type: ignore[assignment]
    first_extra = max(s for d, p, s in steps if p and d) - target
    assert sum(g - target for g in gaps) <= budget.config.credit_cap_steps * target + first_extra + 1e-9
    assert budget.num_deferred > 0
    free: list[float] = simulate(H200_LIKE, None, trickle=trickle)["storm_gaps"]  # type: ignore[assignment]
    assert np.mean(gaps) < np.mean(free)


@settings(max_examples=20, deadline=None)
@given(a=st.floats(0.002, 0.02), b_frac=st.floats(0.0, 0.05), e0_frac=st.floats(0.0, 5.0),
       e1_frac=st.floats(0.0, 0.2), slowdown=st.floats(1.02, 1.5), streams=st.integers(1, 6),
       trickle=st.booleans())
def test_relative_target_property(a: float, b_frac: float, e0_frac: float, e1_frac: float, slowdown: float,
                                  streams: int, trickle: bool) -> None:
    """Any linear device, the storm at once or trickling: every request finishes and the streams'
    overrun of slowdown x their calm step stays within the credit's cap, the first prefill step and
    the probe steps taken before the slope was known (the bound of the absolute target)."""
    device = Device(a, a * b_frac, a * e0_frac, a * e1_frac)
    budget = StepBudget(AdmissionConfig(slowdown=slowdown))
    out = simulate(device, budget, streams=streams, storm=40, stream_tokens=400, storm_tokens=16, trickle=trickle)
    assert len(out["finished"]) == streams + 40
    target = slowdown * device.step_s(streams, 0)
    steps: list[tuple[int, int, float]] = out["steps"]  # type: ignore[assignment]
    first_extra = max((s - target for d, p, s in steps if p and d), default=0.0)
    probe = budget.config.probe_rows * device.b * 2 * len(steps) / 50
    gaps: list[float] = out["storm_gaps"]  # type: ignore[assignment]
    cap = budget.config.credit_cap_steps * target
    assert sum(g - target for g in gaps) <= cap + max(first_extra, 0.0) + probe + 1e-9


def _run(sched: Scheduler, reqs: list[Req]) -> list[list[str]]:
    """Schedules to the end (one token per row and step); returns each step's request ids."""
    for r in reqs:
        sched.add(r)
    rounds: list[list[str]] = []
    for _ in range(10_000):
        if not sched.has_work():
            return rounds
        d = sched.schedule()
        rounds.append([it.rid for it in d.items])
        sched.commit(d)
        for it in d.items:
            req = sched.reqs.get(it.rid)
            if req is None or it.prefix_len + len(it.token_ids) != req.fill_len:
                continue
            req.output_ids.append(1)
            if req.remaining_new_tokens == 0:
                sched.finish(req, {"type": "length"})
        if sched.admission is not None:  # a step costs 4 ms + 0.1 ms a row (every step a decode step)
            sched.admission.observe(len(d.items), 0, 0.004 + 0.0001 * len(d.items))
    raise AssertionError("no progress")


def _reqs(prefix: str, n: int, prompt: int, max_new: int, first_arrival: int = 0) -> list[Req]:
    return [Req(f"{prefix}{i}", [(first_arrival + i) * 7 % 50 + 1 + k % 3 for k in range(prompt)],
                SamplingParams(max_new_tokens=max_new), max_new, arrival=first_arrival + i) for i in range(n)]


def test_relative_target_leaves_a_burst_alone() -> None:
    """A burst into an idle server that takes several rounds to admit (a throughput benchmark, an
    offline batch) protects nothing until its last round: the same schedule as without any
    admission, step by step."""
    def run(budget: StepBudget | None) -> list[list[str]]:
        sched = Scheduler(KVManager(16384, 1, False), max_running_requests=128, enable_mixed_chunk=True,
                          chunked_prefill_size=64, admission=budget)
        return _run(sched, _reqs("b", 40, 16, 30))

    budget = StepBudget(AdmissionConfig(slowdown=1.05))
    assert run(budget) == run(None)
    assert budget.num_deferred == 0


def test_scheduler_protects_requests_that_start_with_nothing_waiting() -> None:
    """Streams admitted in one round with nothing left waiting are protected by the batch they
    started in; a burst admitted over several rounds is not, except its last round; the target
    then follows the smallest start batch of the active protected requests."""
    budget = StepBudget(AdmissionConfig(slowdown=1.5))  # loose: the burst is admitted, slowly
    sched = Scheduler(KVManager(16384, 1, False), max_running_requests=128, enable_mixed_chunk=True,
                      chunked_prefill_size=64, admission=budget)
    streams = _reqs("s", 3, 16, 60)
    burst = _reqs("b", 10, 16, 20, first_arrival=3)
    seen_base: list[int | None] = []
    for r in streams:
        sched.add(r)
    for step in range(200):
        if step == 5:
            for r in burst:
                sched.add(r)
        if not sched.has_work():
            break
        d = sched.schedule()
        seen_base.append(budget.base_rows)
        sched.commit(d)
        for it in d.items:
            req = sched.reqs.get(it.rid)
            if req is None or it.prefix_len + len(it.token_ids) != req.fill_len:
                continue
            req.output_ids.append(1)
            if req.remaining_new_tokens == 0:
                sched.finish(req, {"type": "length"})
        budget.observe(len(d.items), 0, 0.004 + 0.0001 * len(d.items))
    assert [r.slo_base_rows for r in streams] == [3, 3, 3]
    protected = [r for r in burst if r.slo_base_rows is not None]
    assert 0 < len(protected) < len(burst)  # only the round that emptied the queue
    assert all(r.slo_base_rows is not None and r.slo_base_rows > 3 for r in protected)
    assert seen_base[1] == 3  # the streams' start batch
    assert sched.schedule().mode == "idle" and budget.base_rows is None  # nothing once all ended
    assert budget.num_deferred > 0  # the streams' target held the burst back at times


@pytest.mark.parametrize("scale", [1.0, 1.5, 3.0])
def test_relative_row_limit_is_the_same_at_any_speed(scale: float) -> None:
    """The relative target sits on the fitted line: steps that all take longer (a slower device,
    longer contexts) admit the same rows; an absolute target set for scale 1 admits none."""
    def fed(cfg: AdmissionConfig) -> StepBudget:
        budget = StepBudget(cfg)
        budget.protect(8)
        for rows in (8, 16) * 20:
            budget.observe(rows, 0, scale * (0.004 + 0.0001 * rows))
        budget.credit = 1.0  # the credit is not what this test limits by
        return budget

    relative = fed(AdmissionConfig(slowdown=1.05, credit_cap_steps=0))
    # 1.05 * (4 + 0.8) ms = 5.04 ms on the line 4 + 0.1 * rows: 10 rows in all
    assert relative.target_s == pytest.approx(scale * 0.00504)
    assert relative.admit_limit(active=8, decoding=8) == 2
    assert relative.admit_limit(active=10, decoding=10) == 0
    absolute = fed(AdmissionConfig(target_s=0.00504, credit_cap_steps=0))
    assert absolute.admit_limit(active=8, decoding=8) == (2 if scale == 1.0 else 0)


def test_relative_target_with_nothing_protected_is_no_limit() -> None:
    budget = StepBudget(AdmissionConfig(slowdown=1.05))
    budget.observe(8, 0, 0.5)
    assert budget.target_s is None and budget.cap_s == 0.0
    assert budget.admit_limit(active=8, decoding=8) is None and budget.extend_affordable(8, 4)
    assert budget.credit == 0.0  # no target: no credit kept
    budget.protect(8)
    assert budget.target_s == pytest.approx(1.05 * 0.5)
    assert budget.admit_limit(active=8, decoding=8) == 4  # the probe past the one batch size measured
    budget.observe(8, 4, 2.0)  # a prefill step far over the target
    assert budget.credit < 0
    assert budget.admit_limit(active=8, decoding=8) == 0
    assert not budget.extend_affordable(8, 4)
    budget.protect(None)  # the protected requests ended
    assert budget.credit == 0.0 and budget.admit_limit(active=8, decoding=8) is None


def test_relative_config_and_resolve() -> None:
    for bad in (1.0, 0.5, math.inf, math.nan):
        with pytest.raises(ValueError):
            AdmissionConfig(slowdown=bad)
    with pytest.raises(ValueError):
        AdmissionConfig()  # neither
    with pytest.raises(ValueError):
        AdmissionConfig(target_s=0.005, slowdown=1.05)  # both
    from lmserver.config import ServerConfig
    from lmserver.runner.resolve import (
        DECODE_STEP_SLOWDOWN,
        ConfigError,
        resolve_decode_step_slowdown,
        step_budget,
    )

    assert resolve_decode_step_slowdown(None, "cuda") == DECODE_STEP_SLOWDOWN == 1.05
    assert resolve_decode_step_slowdown(None, "cpu") == 0.0  # CPU: off unless asked for
    assert resolve_decode_step_slowdown(0, "cuda") == 0.0
    assert resolve_decode_step_slowdown(1.2, "cpu") == 1.2
    for bad in (1.0, 0.5, -1.0, math.inf, math.nan):
        with pytest.raises(ConfigError):
            resolve_decode_step_slowdown(bad, "cuda")
    rc = ServerConfig(decode_step_slowdown=1.05, prefill_step_target_ms=60.0)
    budget = step_budget(rc)
    assert budget is not None and budget.relative and budget.config.max_step_s == pytest.approx(0.06)
    absolute = step_budget(rc.replace(decode_step_target_ms=5.0))  # an absolute target wins
    assert absolute is not None and not absolute.relative and absolute.config.target_s == pytest.approx(0.005)
    assert step_budget(rc.replace(decode_step_slowdown=0.0)) is None
