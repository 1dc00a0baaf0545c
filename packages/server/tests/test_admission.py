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
             stream_tokens: int = 600, storm_tokens: int = 24, max_rows: int = 128) -> dict[str, object]:
    """Runs the streams, then the storm, to the end. Returns the streams' gaps while any storm
    request was unfinished, every step's (decode rows, prompt rows, seconds), and the finished ids."""
    kv = KVManager(16384, 1, False)
    sched = Scheduler(kv, max_running_requests=max_rows, enable_mixed_chunk=True, admission=budget)
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
    for _ in range(100_000):
        if not sched.has_work():
            break
        if not stormed and len(sched.running) == streams and all(len(r.output_ids) >= 20 for r in sched.running):
            for j in range(storm):
                add(f"g{j}", 12, storm_tokens)
            stormed = True
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
    if b < 0:
        assert coef[1] == 0.0
        return
    assert coef[1] == pytest.approx(b, rel=1e-6, abs=1e-9)
    assert coef[0] == pytest.approx(a, rel=1e-6, abs=1e-9)


def test_config_rejects_bad_values() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            AdmissionConfig(target_s=bad)
    with pytest.raises(ValueError):
        AdmissionConfig(target_s=0.01, forget=1.0)
