"""The overlap scheduler against the serial path on random workloads (hypothesis).

A tiny random-weight Llama (64-token vocabulary, so EOS and stop tokens come often) runs random
scripts: requests with random lengths, stop tokens, min-new-tokens, greedy or seeded sampling;
arrivals and aborts fired by other requests' progress; a few request rows and KV slots (queues,
retractions). Oracle: the same engine with overlap off on the same script from the same state.
KV slot accounting is checked after every step.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lmserver.config import ServerConfig
from lmserver.engine.core import EngineCore
from lmserver.io_struct import GenerateReq, SamplingParams
from lmserver.models.default_model import default_model_path
from lmserver.scheduler.scheduler import NEW_TOKEN_RATIO_INIT

VOCAB, EOS = 64, 2
TINY = dict(
    architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=EOS,
)
CONFIGS = {  # name -> ServerConfig fields
    "roomy": {"max_total_tokens": 2048, "max_running_requests": 8},
    "queue": {"max_total_tokens": 2048, "max_running_requests": 2},
    "tight": {"max_total_tokens": 72, "max_running_requests": 4, "schedule_policy": "fcfs"},
}


@pytest.fixture(scope="module")
def cores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineCore]]:
    folder: Path = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY))
    tok = str(default_model_path())
    yield {name: EngineCore(ServerConfig(model_path=str(folder), tokenizer_path=tok, load_format="dummy",
                                         dtype="float32", random_seed=1, enable_overlap_schedule=True, **cfg))
           for name, cfg in CONFIGS.items()}


REQ = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=12),
    "max_new_tokens": st.integers(1, 14),
    "temperature": st.sampled_from([0.0, 0.0, 1.0]),
    "sampling_seed": st.integers(0, 3),
    "stop_token_ids": st.lists(st.integers(3, VOCAB - 1), max_size=2),
    "min_new_tokens": st.integers(0, 3),
    "ignore_eos": st.booleans(),
})
# an event fires once start request `who` has `after` tokens (or has finished): ("add", ..., request)
# adds one; ("abort", ...) aborts `who` itself (unless it finished). NOTE: events key on one
# request's own progress; how requests' outputs interleave differs between the modes.
EVENT = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 7), st.integers(0, 6), REQ),
    st.tuples(st.just("abort"), st.integers(0, 7), st.integers(1, 6)),
)


def _accounting(core: EngineCore) -> None:
    kv = core.scheduler.kv
    owned = sum(len(r.kv) - r.cached_len for r in core.scheduler.reqs.values())
    assert kv.allocator.available + kv.cache.total_size + owned == kv.num_slots
    core.check_memory_invariant()


def _run(core: EngineCore, reqs: list[dict[str, Any]], events: list[tuple[Any, ...]], overlap: bool) -> dict[str, Any]:
    for rid in list(core.states):  # a failed example may leave requests behind
        core.abort_request(rid)
    core.step()  # lands a launch whose requests all ended (an aborted one's)
    while core.has_work():
        core.step()
    assert core.flush_cache()
    core.scheduler.new_token_ratio = NEW_TOKEN_RATIO_INIT
    core.overlap = overlap
    tag = "on" if overlap else "off"
    got: dict[str, dict[str, Any]] = {}
    trace: list[tuple[str, list[tuple[str, int, int]]]] = []  # every forward: mode, (request, position, tokens)
    forward = core.runner.forward

    def traced(decision: Any, input_ids: Any = None) -> Any:
        trace.append((decision.mode, [(i.rid.split("-", 1)[1], i.prefix_len, len(i.token_ids)) for i in decision.items]))
        return forward(decision, input_ids=input_ids)

    def add(i: str, spec: dict[str, Any]) -> None:
        got[i] = {"ids": [], "reason": None}
        params = {k: v for k, v in spec.items() if k != "prompt"}
        params["min_new_tokens"] = min(params["min_new_tokens"], params["max_new_tokens"])
        core.add_request(GenerateReq(rid=f"{tag}-{i}", input_ids=spec["prompt"],
                                     sampling_params=SamplingParams.from_dict(params)))

    for i, spec in enumerate(reqs):
        add(str(i), spec)
    pending = list(enumerate(events))
    core.runner.forward = traced  # type: ignore[method-assign]
    try:
        _drive(core, reqs, pending, got, add, tag)
    finally:
        del core.runner.forward
    _accounting(core)
    # rows past a request's last token (the overlap's thrown-away rows) and forwards left empty
    total = {k: len(v["prompt"]) for k, v in zip(map(str, range(len(reqs))), reqs, strict=True)}
    total.update({f"e{j}": len(ev[3]["prompt"]) for j, ev in enumerate(events) if ev[0] == "add"})
    kept = [(mode, [it for it in items if mode != "decode" or it[1] + 1 < total[it[0]] + len(got[it[0]]["ids"])])
            for mode, items in trace]
    sched = core.scheduler
    return {**got, "cached_slots": sched.kv.cache.total_size,
            "trace": ([k for k in kept if k[1]], sched.new_token_ratio - NEW_TOKEN_RATIO_INIT)}


def _drive(core: EngineCore, reqs: list[dict[str, Any]], pending: list[tuple[int, tuple[Any, ...]]],
           got: dict[str, dict[str, Any]], add: Any, tag: str) -> None:
    while core.has_work():
        for out in core.step():
            g = got[out.rid.split("-", 1)[1]]
            g["ids"] += out.new_token_ids
            if out.finished:
                g["reason"] = out.finish_reason
        _accounting(core)
        for j, ev in list(pending):
            who = str(ev[1] % len(reqs))
            if len(got[who]["ids"]) < ev[2] and got[who]["reason"] is None:
                continue
            pending.remove((j, ev))
            if ev[0] == "add":
                add(f"e{j}", ev[3])
            elif got[who]["reason"] is None:
                core.abort_request(f"{tag}-{who}")


_GREEDY = {"temperature": 0.0, "sampling_seed": 0, "stop_token_ids": [], "min_new_tokens": 0}
EXAMPLES: list[tuple[str, list[dict[str, Any]], list[tuple[Any, ...]]]] = [
    # three requests that do not fit the "tight" pool together: retractions while steps are chained
    ("tight", [{"prompt": list(range(3 + i, 15 + i)), "max_new_tokens": 14, **_GREEDY, "ignore_eos": True}
               for i in range(3)], []),
    # CI's failing case: an abort at step 2 and an arrival, under cache pressure
    ("tight", [{"prompt": p, "max_new_tokens": n, **_GREEDY, "ignore_eos": False}
               for p, n in (([5, 3, 3, 3], 3), ([3] * 10, 1), ([3], 13), ([3, 4], 13), ([4] + [3] * 11, 13))],
     [("abort", 0, 2), ("add", 0, 0, {"prompt": [3], "max_new_tokens": 11, **_GREEDY, "ignore_eos": False})]),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=st.sampled_from(sorted(CONFIGS)), reqs=st.lists(REQ, min_size=1, max_size=6),
       events=st.lists(EVENT, max_size=3))
@example(config=EXAMPLES[0][0], reqs=EXAMPLES[0][1], events=EXAMPLES[0][2])
@example(config=EXAMPLES[1][0], reqs=EXAMPLES[1][1], events=EXAMPLES[1][2])
def test_overlap_equals_serial_on_random_scripts(cores: dict[str, EngineCore], config: str,
                                                 reqs: list[dict[str, Any]], events: list[tuple[Any, ...]]) -> None:
    core = cores[config]
    serial = _run(core, reqs, events, overlap=False)
    overlapped = _run(core, reqs, events, overlap=True)
    if events:  # the modes see an event at different points of the other requests' progress
        serial.pop("trace"), overlapped.pop("trace")
        # NOTE: an abort reaches the overlap path one step later, when the request's next token is
        # already computed: the radix cache may then keep one slot fewer or more (found by CI:
        # 53 vs 54 in "tight"); slot accounting stays exact (_accounting) and no output changes.
        serial.pop("cached_slots"), overlapped.pop("cached_slots")
    assert overlapped == serial


def test_the_examples_overlap_and_retract(cores: dict[str, EngineCore]) -> None:
    """The explicit examples exercise what the comparison above is for: chained (overlapped) steps in
    each, and retractions under the tight pool (self-contained: runs them again in any test order)."""
    seen = []
    for config, reqs, events in EXAMPLES:
        core = cores[config]
        before = core.get_stats()
        _run(core, reqs, events, overlap=True)
        after = core.get_stats()
        seen.append((after["overlap_steps"] - before["overlap_steps"], after["num_retractions"] - before["num_retractions"]))
    assert all(steps > 0 for steps, _ in seen), seen
    assert any(steps > 0 and retractions > 0 for steps, retractions in seen), seen
