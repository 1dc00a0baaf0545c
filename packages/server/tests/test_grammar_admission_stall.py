"""The engine thread does no grammar walks when a compiled grammar is admitted (issue 27's storm
stalls), and grammar rows keep the overlap chain while the SLO admission holds requests.

The stalls: a pushdown index (`cfsm.GrammarIndex`) computes a parser configuration's mask on its
first use by walking the vocabulary from its stacks. At admission the engine jumps over the text
forced from the start and asks the configuration after it for tokens (`ReqGrammar.is_stuck`);
for some real-world schemas that configuration's key was not among the compile's precomputed
ones, and its walk (plus the index's counted chains, which the payload did not carry) took
50-500 ms inside the step that admitted the request. `compile_worker.warm_admission` now walks
those configurations where the compile runs (`GrammarIndex.warm`) and the payload carries the
chains (`GrammarIndex.payload`).

Oracles: counters on the walking methods of `GrammarIndex` (a walk on the engine thread is the
stall, whatever the machine's speed), masks against a freshly compiled index, and the engine's
greedy tokens of a plain stream against the same stream run alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import cfsm
from cfsm.grammar import index as grammar_index
from cfsm.testing import tiny_vocab
from lmserver.engine.constrained.compile_worker import (
    admission_configurations,
    compile_index,
    index_from_payload,
    index_payload,
    warm_admission,
    warm_index,
)
from lmserver.engine.overlap import chain_ready

VOCAB = tiny_vocab()
# forced `{"k": ` from the start, then a recursive value: the pushdown matcher
NESTED = 'root ::= "{\\"k\\": " value "}"\nvalue ::= "[" (value ("," [ ]{0,8} value)*)? "]" | "\\"" [a-z]{1,12} "\\""'
WALKS = ("_walk_tokens", "_walk_pairs", "_walk_pairs_many", "_walk_trie_many")


class WalkCounter:
    """Counts `GrammarIndex` vocabulary walks and counted-chain searches, per thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []  # (thread name, what)
        for name in WALKS:
            if hasattr(grammar_index.GrammarIndex, name):
                monkeypatch.setattr(grammar_index.GrammarIndex, name, self._wrap(name, getattr(grammar_index.GrammarIndex, name)))
        if hasattr(grammar_index, "_counted_chains"):
            monkeypatch.setattr(grammar_index, "_counted_chains", self._wrap("_counted_chains", grammar_index._counted_chains))

    def _wrap(self, what: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kw: Any) -> Any:
            self.calls.append((threading.current_thread().name, what))
            return fn(*args, **kw)

        return wrapped

    def take(self) -> list[tuple[str, str]]:
        out, self.calls = self.calls, []
        return out


def _unprecomputed(index: cfsm.GrammarIndex) -> dict[str, Any]:
    """The payload of `index` as a compile that did not precompute the keys of its admission
    configurations would give it (what the storm's schemas showed): without those one-frame keys
    and without the counted chains."""
    forget = {stack[-1:] for sid in admission_configurations(index)[1:] for stack in index.stacks(sid)}
    payload = index.payload()
    payload["keys"] = {k: v for k, v in payload["keys"].items() if k not in forget}
    del payload["chains"]
    return payload


def _admission_path(index: cfsm.GrammarIndex) -> list[np.ndarray]:
    """What `EngineCore._admit_constrained` reads of a fresh index: the start's tokens, the jump over
    the forced text, the tokens after it; returns the masks of those configurations."""
    guide = cfsm.Guide(index)
    assert guide.has_tokens()
    forced = guide.jump_forward()
    assert forced
    sid = index.walk(index.start, forced.rstrip(" ").encode())
    assert sid and index.has_tokens(sid)
    return [index.mask(index.start).copy(), index.mask(sid).copy()]


def test_a_warmed_payload_leaves_no_walk_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = cfsm.compile_ebnf(NESTED, VOCAB)
    assert isinstance(fresh, cfsm.GrammarIndex)
    expected = _admission_path(fresh)
    counter = WalkCounter(monkeypatch)

    # as before: a compile whose admission keys were not precomputed, rebuilt and warmed at the start only
    stripped = _unprecomputed(cfsm.compile_ebnf(NESTED, VOCAB))
    before = cfsm.GrammarIndex.from_payload(stripped, VOCAB)
    before.warm([before.start])
    counter.take()
    assert [np.array_equal(a, b) for a, b in zip(_admission_path(before), expected, strict=True)] == [True, True]
    assert counter.take(), "the set-up must reproduce a first-use walk at admission"

    # now: the worker warms the admission (its walks and the chains travel in the payload), the
    # dispatcher builds the rows from them
    worker_side = warm_admission(cfsm.GrammarIndex.from_payload(stripped, VOCAB))
    payload = index_payload(worker_side)
    assert payload[1]["chains"] == fresh.payload()["chains"]
    counter.take()
    rebuilt = warm_index(index_from_payload(payload, VOCAB))
    assert not [c for c in counter.take() if c[1] == "_counted_chains"]  # shipped, not recomputed
    masks = _admission_path(rebuilt)
    assert counter.take() == []  # nothing walked on the admitting thread
    assert [np.array_equal(a, b) for a, b in zip(masks, expected, strict=True)] == [True, True]
    assert rebuilt.payload()["chains"] == payload[1]["chains"]
    assert counter.take() == []  # the rebuilt index kept the shipped chains


def test_payloads_without_the_chains_still_load() -> None:
    """A payload without the chains (a compile that stopped before its first key walk, an older
    worker's) rebuilds to the same masks, the chains found again."""
    index = cfsm.compile_ebnf(NESTED, VOCAB)
    payload = index.payload()
    del payload["chains"]
    rebuilt = warm_index(index_from_payload(("grammar", payload), VOCAB))
    assert [np.array_equal(a, b) for a, b in zip(_admission_path(rebuilt), _admission_path(index), strict=True)] == [True, True]
    assert rebuilt.payload()["chains"] == index.payload()["chains"]
    dfa = compile_index("regex", "[0-9]{2,4}", VOCAB, cfsm.CfsmConfig())
    assert warm_admission(dfa) is dfa and warm_index(dfa) is dfa  # a DFA index: its own first-use tables


# --- the overlap chain while the SLO admission holds requests -----------------------------------------------


def _state(rid: str, grammar: bool) -> Any:
    params = SimpleNamespace(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, min_new_tokens=0,
                             stop=None, stop_regex=None)
    sreq = SimpleNamespace(rid=rid, sampling_params=params, output_ids=[1, 2], max_new_tokens=100)
    return SimpleNamespace(req=SimpleNamespace(rid=rid, return_logprob=False), sreq=sreq,
                           info=SimpleNamespace(stop_ids=[]), grammar=object() if grammar else None)


def _scheduler(free_row: bool, slo_refuses: bool) -> Any:
    running = [SimpleNamespace(rid="plain"), SimpleNamespace(rid="json")]
    kv = SimpleNamespace(slots_needed=lambda req, n: 1, allocator=SimpleNamespace(available=100))
    return SimpleNamespace(prefilling=[], running=running, waiting=[SimpleNamespace(rid="new")], kv=kv,
                           has_free_row=free_row, can_admit=free_row and not slo_refuses,
                           refresh_admission=lambda: None)


@pytest.mark.parametrize(("free_row", "slo_refuses", "chains"), [
    (True, True, True),  # rows free, the SLO admission refuses: a grammar row's possible finish changes nothing
    (True, False, False),  # admissible now: serial
    (False, False, False),  # every row taken and a grammar row may finish (freeing one): serial
])
def test_grammar_rows_chain_while_the_slo_admission_holds_requests(free_row: bool, slo_refuses: bool,
                                                                   chains: bool) -> None:
    states = {"plain": _state("plain", grammar=False), "json": _state("json", grammar=True)}
    prev = SimpleNamespace(row_of={"plain": 0, "json": 1})
    assert chain_ready(_scheduler(free_row, slo_refuses), prev, states, 0) is chains  # type: ignore[arg-type]


def test_rows_taken_and_nothing_may_finish_still_chains() -> None:
    states = {"plain": _state("plain", grammar=False), "json": _state("json", grammar=False)}
    prev = SimpleNamespace(row_of={"plain": 0, "json": 1})
    assert chain_ready(_scheduler(False, False), prev, states, 0) is True  # type: ignore[arg-type]
    assert chain_ready(_scheduler(True, True), prev, states, 1) is False  # type: ignore[arg-type]  # a compiled grammar waits


@pytest.mark.parametrize("seed", range(12))
def test_a_chain_allowed_by_the_admission_schedules_a_decode(seed: int) -> None:
    """A real scheduler with the relative SLO admission: protected streams (some ending while a
    burst waits) and grammar-like rows (each may finish). Whenever `chain_ready` allows a chained
    launch, the schedule that follows is a decode that admits nothing (the engine asserts it: a
    target lifted by a finished protected request once made it an extend)."""
    import random

    from lmserver.io_struct import SamplingParams
    from lmserver.scheduler import KVManager, Req, Scheduler
    from lmserver.scheduler.admission import AdmissionConfig, StepBudget

    rng = random.Random(seed)
    budget = StepBudget(AdmissionConfig(slowdown=1.05))
    sched = Scheduler(KVManager(16384, 1, False), max_running_requests=64, enable_mixed_chunk=True,
                      chunked_prefill_size=256, admission=budget)

    def req(rid: str, n: int, arrival: int) -> Req:
        return Req(rid, [arrival * 7 % 50 + 1 + k % 3 for k in range(8)], SamplingParams(max_new_tokens=n), n,
                   arrival=arrival)

    # protected streams: s0 alone first (its start batch of 1 row sets the target), three more later; s0
    # ends while the burst waits, which lifts the target to the others' start batch
    sched.add(req("s0", rng.randint(20, 60), 0))
    states: dict[str, Any] = {}
    chained = 0
    prev_rows: dict[str, int] = {}
    for step in range(2000):
        if step == 3:
            for i in range(1, 4):
                sched.add(req(f"s{i}", rng.randint(80, 120), i))
        if step == 6:
            for i in range(30):
                sched.add(req(f"b{i}", rng.randint(5, 40), 10 + i))
        if not sched.has_work():
            break
        for r in sched.running:
            states.setdefault(r.rid, _state(r.rid, grammar=r.rid.startswith("b")))
        prev = SimpleNamespace(row_of=prev_rows)
        ok = bool(sched.running) and chain_ready(sched, prev, states, 0)  # type: ignore[arg-type]
        d = sched.schedule()
        if ok:
            chained += 1
            assert d.mode == "decode" and not d.retracted, (step, d.mode)
        prev_rows = {it.rid: i for i, it in enumerate(d.items)} if d.mode == "decode" else {}
        sched.commit(d)
        for it in d.items:
            r = sched.reqs.get(it.rid)
            if r is None or it.prefix_len + len(it.token_ids) != r.fill_len:
                continue
            r.output_ids.append(1)
            if r.remaining_new_tokens == 0:
                sched.finish(r, {"type": "length"})
        rows = sum(1 for it in d.items if len(it.token_ids) == 1)
        # a step: 5 ms + 0.2 ms a row + 1 ms a prefill row, with noise (the credit goes negative at times)
        cost = (0.005 + 0.0002 * len(d.items) + 0.001 * (len(d.items) - rows)) * rng.uniform(0.8, 1.4)
        budget.observe(rows, len(d.items) - rows, cost)
    else:
        raise AssertionError("no progress")
    assert chained > 0 and budget.num_deferred > 0  # chains happened while the admission held requests


# --- a burst of compiles next to a plain stream (the engine on the embedded model) ------------------------------


def _grammar(i: int) -> str:
    """A distinct recursive grammar (the pushdown matcher, a forced prefix) per `i`."""
    return NESTED.replace('\\"k\\"', f'\\"k{i}\\"')


@pytest.fixture(scope="module")
def core() -> Iterator[Any]:
    from lmserver.config import ServerConfig
    from lmserver.engine.core import EngineCore

    c = EngineCore(ServerConfig(dtype="float32", max_total_tokens=4096, max_running_requests=16, step_trace=512,
                                grammar_compile_workers=0))  # compile threads: their walks are not the engine thread's
    yield c
    c.constrained.shutdown()


def _req(rid: str, prompt: str, params: dict[str, Any], core: Any) -> Any:
    from lmserver.io_struct import GenerateReq, SamplingParams

    return GenerateReq(rid=rid, input_ids=core.tokenizer.encode(prompt), sampling_params=SamplingParams(**params))


@pytest.mark.slow  # about 70 s on the loaded 2-core machine (the vocabulary, 64 CPU decode steps)
def test_a_burst_of_compiles_admits_without_walks_and_the_stream_keeps_its_tokens(
        core: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import lmserver.engine.core as core_module

    plain = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    core.add_request(_req("alone", "Once upon a time", plain, core))
    alone: list[int] = []
    while core.has_work():
        for out in core.step():
            alone += out.new_token_ids

    counter = WalkCounter(monkeypatch)
    admitting = threading.local()
    admit = core._admit_constrained

    def spy(outputs: list[Any]) -> Any:
        admitting.on = True
        counter.take()
        try:
            return admit(outputs)
        finally:
            admitting.on = False
            walked = [c for c in counter.take() if c[0] == threading.current_thread().name]
            assert walked == [], f"the engine thread walked while admitting: {walked}"

    monkeypatch.setattr(core, "_admit_constrained", spy)
    monkeypatch.setattr(core_module, "GRAMMAR_ADMIT_BUDGET_S", 0.0)  # one admission per step while requests run
    core.add_request(_req("stream", "Once upon a time", plain, core))
    stream: list[int] = []
    burst = [f"tree{i}" for i in range(6)]
    outs: dict[str, Any] = {}
    steps = 0
    while core.has_work():
        if steps == 2:  # the stream decodes: the burst arrives
            for i, rid in enumerate(burst):
                core.add_request(_req(rid, "A tree as JSON:", {"max_new_tokens": 16, "temperature": 0.0,
                                                               "ebnf": _grammar(i)}, core))
        for out in core.step():
            if out.rid == "stream":
                stream += out.new_token_ids
            elif out.finished:
                outs[out.rid] = out
        steps += 1
    assert stream == alone  # the burst changed nothing in the stream's tokens
    assert sorted(outs) == burst and all(o.error is None for o in outs.values())
    rows = core.get_step_trace()
    recs = [dict(zip(rows["fields"], r, strict=True)) for r in rows["records"]]
    admitted = [r for r in recs if r["admitted"]]
    assert admitted and all(r["admitted"] == 1 and r["admit_max_rid"] in burst for r in admitted
                            if r["decode_rows"])  # named, one per step while the stream ran
