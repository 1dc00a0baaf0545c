"""StepTrace (engine/step_trace.py): gaps between token-giving steps and what filled them, against
a plain list of the same steps; and the trace and the SLO admission inside an EngineCore on the CPU."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.engine.step_trace import TOP_GAPS, StepTrace


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(0, 3), st.booleans()),
                      min_size=1, max_size=60))
def test_gaps_match_a_plain_list(steps: list[tuple[float, float, int, bool]]) -> None:
    """Each step: (pause before it, its duration, rows given a token, idle before it)."""
    trace = StepTrace(keep=1000)
    t = 0.0
    last: float | None = None
    expected: list[tuple[float, float, int]] = []  # (gap, steps in it, rows)
    in_gap = 0
    for pause, dur, rows, idle in steps:
        if idle:
            trace.idle()
            last, in_gap = None, 0
        start = t + pause
        end = start + dur
        t = end
        trace.step(start, end, rows)
        in_gap += 1
        if rows > 0:
            if last is not None:
                expected.append((end - last, in_gap, rows))
            last, in_gap = end, 0
    got = [(r.gap_s, r.steps, r.decode_rows) for r in trace.records]
    assert got == expected
    assert trace.max_gap_s == max((g for g, _, _ in expected), default=0.0)
    top = [r.gap_s for r in trace.top()]
    assert top == sorted((g for g, _, _ in expected), reverse=True)[:TOP_GAPS]


def test_cause_names_the_largest_part() -> None:
    trace = StepTrace()
    trace.step(0.0, 0.001, 4)  # starts the clock
    trace.add_request(0.050)  # the serving loop adds 96 requests: 50 ms
    trace.admission(3, 0.010)
    trace.forward(0.005, prefill_rows=3, prefill_tokens=36)
    rec = trace.step(0.051, 0.070, 4)
    assert rec is not None
    assert rec.gap_s == 0.070 - 0.001
    assert rec.cause == "add-request"
    assert (rec.admitted, rec.extend_forwards, rec.prefill_rows, rec.prefill_tokens) == (3, 1, 3, 36)
    assert abs(rec.outside_s - (rec.gap_s - rec.step_s - rec.add_s)) < 1e-12
    trace.forward(0.040, prefill_rows=0, prefill_tokens=0)
    rec = trace.step(0.071, 0.115, 4)
    assert rec is not None and rec.cause == "forward-decode"
    rec = trace.step(0.300, 0.301, 4)  # 185 ms outside any step (another thread held the interpreter)
    assert rec is not None and rec.cause == "outside-step"
    assert [r.gap_s for r in trace.top()][0] == rec.gap_s
    stats = trace.stats()
    assert stats["step_gaps"] == 3 and stats["step_gaps_top"][0]["cause"] == "outside-step"
    assert trace.rows()["records"] == []  # keep=0


def _run_late_arrivals(core, budget):  # type: ignore[no-untyped-def]
    """One request decodes; two more arrive once it has 3 tokens. Returns (tokens per request,
    the order in which requests got their first token and finished)."""
    from lmserver.io_struct import GenerateReq, SamplingParams

    core.scheduler.admission = budget
    tok = core.tokenizer
    tokens: dict[str, list[int]] = {}
    events: list[str] = []

    def add(rid: str, text: str) -> None:
        core.add_request(GenerateReq(rid=rid, input_ids=list(tok(text)["input_ids"]),
                                     sampling_params=SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)))

    add("first", "The capital of France is")
    added = False
    while core.has_work():
        for out in core.step():
            if out.new_token_ids and out.rid not in tokens:
                events.append(f"start {out.rid}")
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finished:
                events.append(f"end {out.rid}")
        if not added and len(tokens.get("first", [])) >= 3:
            add("second", "One, two, three,")
            add("third", "def fibonacci(n):")
            added = True
    core.scheduler.admission = None
    return tokens, events


def test_engine_admission_holds_new_requests_and_keeps_tokens() -> None:
    """With a target no step can meet, requests arriving while one decodes wait for it to finish
    (then start together); without it they join at once. Greedy tokens are the same either way,
    and the trace saw the first request's gaps."""
    from lmserver.config import ServerConfig
    from lmserver.engine.core import EngineCore
    from lmserver.scheduler.admission import AdmissionConfig, StepBudget

    core = EngineCore(ServerConfig(dtype="float32", max_total_tokens=2048, max_running_requests=4, step_trace=64))
    free_tokens, free_events = _run_late_arrivals(core, None)
    budget = StepBudget(AdmissionConfig(target_s=1e-9))
    held_tokens, held_events = _run_late_arrivals(core, budget)
    assert held_tokens == free_tokens
    assert free_events.index("start second") < free_events.index("end first")
    assert held_events.index("start second") > held_events.index("end first")
    assert held_events.index("start third") > held_events.index("end first")
    assert budget.num_observed > 0 and budget.num_deferred > 0
    assert core.get_stats()["step_gaps"] > 0
    rows = core.get_step_trace()
    recs = [dict(zip(rows["fields"], r, strict=True)) for r in rows["records"]]
    assert recs and all(r["gap_s"] > 0 and r["decode_rows"] >= 1 for r in recs)


def test_garbage_collections_are_counted_in_their_gap() -> None:
    import gc

    trace = StepTrace(keep=10)
    ours = gc.callbacks[-1]
    trace.step(0.0, 0.001, 2)
    gc.collect()  # a full collection inside the gap
    rec = trace.step(0.002, 0.003, 2)
    assert rec is not None and rec.gc_full >= 1 and rec.gc_s > 0.0
    assert trace.stats()["gc_full_collections"] >= 1
    rec = trace.step(0.004, 0.005, 2)
    assert rec is not None and rec.gc_full == 0  # none in this one
    del trace, rec
    gc.collect()  # the callback of a trace that is gone removes itself
    gc.collect()
    assert ours not in gc.callbacks
