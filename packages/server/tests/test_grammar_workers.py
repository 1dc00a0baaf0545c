"""Grammar compiles in worker processes (`lmserver.engine.constrained.workers`, `compile_worker`) through `GrammarBackend`.

Oracles: an in-process `cfsm.compile_*` of the same grammar (every array equal), the pool's
process ids (`/proc` says whether a killed worker is gone), and the futures' outcomes. Slow
grammars are real ones (`(a|b)*a(a|b){16}`: a DFA of 131k states, seconds of compile); time
moves by an injected clock, and the tests wait for conditions (never for a fixed time).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import cfsm
from cfsm.testing import tiny_vocab
from lmserver.engine.constrained import (
    GrammarBackend,
    GrammarError,
    GrammarKey,
    GrammarQueueFullError,
    grammar_key,
)
from lmserver.engine.constrained.compile_worker import index_from_payload, index_payload
from lmserver.io_struct import SamplingParams

VOCAB = tiny_vocab()
SLOW = r"(a|b)*a(a|b){16}"  # seconds of compile (131,072 DFA states)
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}  # over-approximated by cfsm


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _until(cond: Callable[[], object], timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        time.sleep(0.01)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _backend(**kw: object) -> GrammarBackend:
    return GrammarBackend(None, VOCAB.size, VOCAB.eos_token_ids, vocab=VOCAB, **kw)  # type: ignore[arg-type]


EBNF = 'root ::= "(" (root | [0-9]+) ")"'


def _same(a: cfsm.Index | cfsm.GrammarIndex, b: cfsm.Index | cfsm.GrammarIndex) -> None:
    if isinstance(a, cfsm.GrammarIndex) or isinstance(b, cfsm.GrammarIndex):
        assert isinstance(a, cfsm.GrammarIndex) and isinstance(b, cfsm.GrammarIndex)
        assert np.array_equal(a.pda.trans, b.pda.trans) and a.pda.calls == b.pda.calls
        assert np.array_equal(a.mask(a.start), b.mask(b.start)) and a.grammar == b.grammar
        return
    assert np.array_equal(a.dfa.transitions, b.dfa.transitions)
    assert np.array_equal(a.dfa.accepting, b.dfa.accepting) and a.dfa.start == b.dfa.start
    assert np.array_equal(a.masks, b.masks) and np.array_equal(a.mask_row, b.mask_row)
    assert a.grammar == b.grammar and a.approximations == b.approximations


@pytest.fixture(scope="module")
def backend() -> Iterator[GrammarBackend]:
    b = _backend(compile_workers=2)
    yield b
    pids = b.worker_pids()
    b.shutdown()
    assert all(_gone(p) for p in pids)


def test_workers_start_with_the_first_grammar_and_match_an_in_process_compile(backend: GrammarBackend) -> None:
    assert backend.worker_pids() == []  # nothing started before the first grammar
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    cases = [(GrammarKey("regex", r"[0-9]{2,4}(ab|c)?"), cfsm.compile_regex(r"[0-9]{2,4}(ab|c)?", VOCAB)),
             (GrammarKey("json_schema", json.dumps(schema)), cfsm.compile_json_schema(json.dumps(schema), VOCAB)),
             (GrammarKey("json_object", ""), cfsm.compile_json_object(VOCAB, object_only=True)),
             (GrammarKey("ebnf", EBNF), cfsm.compile_ebnf(EBNF, VOCAB)),
             (GrammarKey("json_schema", json.dumps(UNIQUE)), cfsm.compile_json_schema(UNIQUE, VOCAB))]
    for key, expected in cases:
        got = backend.compile(key)
        _same(got, expected)
        assert got.vocab is VOCAB  # the engine's own vocabulary, never a copy sent back
    assert len(backend.worker_pids()) == 2 and all(p != os.getpid() for p in backend.worker_pids())
    assert backend.compile(cases[-1][0]).approximations[0].keyword == "uniqueItems"
    stats = backend.pool_stats
    assert stats is not None and stats.compiled >= 4 and stats.max_receive_s < 1.0


def test_payload_round_trip_keeps_every_array() -> None:
    index = cfsm.compile_json_schema(UNIQUE, VOCAB)
    _same(index_from_payload(index_payload(index), VOCAB), index)


def test_cache_hits_and_shared_compiles(backend: GrammarBackend) -> None:
    key = GrammarKey("regex", "(x|y)+z")
    hits, misses = backend.hits, backend.misses
    t1, t2 = backend.submit(key), backend.submit(key)  # concurrent requests share one compile
    assert t1.future is t2.future
    index = backend.compile(key)  # done now: a cache hit that costs nothing
    assert backend.result(t1) is index and backend.result(t2) is index
    assert (backend.hits - hits, backend.misses - misses) == (2, 1)
    strict = backend.compile(GrammarKey("regex", "(x|y)+z", strict=True))  # another key, another entry
    assert strict is not index


def test_failed_compile_is_retried_not_cached(backend: GrammarBackend) -> None:
    key = GrammarKey("regex", "(ab")
    misses = backend.misses
    for _ in range(2):
        with pytest.raises(GrammarError, match="invalid regex grammar"):
            backend.compile(key)
    assert backend.misses - misses == 2
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        backend.compile(GrammarKey("nope", "x"))


def test_long_schemas_are_parsed_by_the_worker(backend: GrammarBackend) -> None:
    from lmserver.engine.constrained.backend import CANONICAL_MAX_LENGTH

    padded = json.dumps({"type": "integer", "description": "x" * CANONICAL_MAX_LENGTH}, indent=1)
    key = grammar_key(SamplingParams(json_schema=padded))
    assert key == GrammarKey("json_schema", padded)  # kept as sent: the engine thread does not parse it
    _same(backend.compile(key), cfsm.compile_json_schema(padded, VOCAB))
    for text, message in [("{" + " " * CANONICAL_MAX_LENGTH, "invalid json_schema grammar"),
                          ("[" * 40_000 + "]" * 40_000, "invalid json_schema grammar")]:
        with pytest.raises(GrammarError, match=message):
            backend.compile(grammar_key(SamplingParams(json_schema=text)))  # type: ignore[arg-type]
    assert len(backend.worker_pids()) == 2


def test_strict_refuses_an_approximation_naming_keyword_and_path(backend: GrammarBackend) -> None:
    loose = backend.compile(GrammarKey("json_schema", json.dumps(UNIQUE)))
    # the worker reports what cfsm reports in this process (the defaults narrow uniqueItems: a subset)
    assert [str(a) for a in loose.approximations] == [
        str(a) for a in cfsm.compile_json_schema(json.dumps(UNIQUE), VOCAB).approximations]
    assert [(a.keyword, a.path, a.kind) for a in loose.approximations] == [("uniqueItems", "#/uniqueItems", "subset")]
    with pytest.raises(GrammarError, match=r"'uniqueItems' at #/uniqueItems.*strict"):
        backend.compile(GrammarKey("json_schema", json.dumps(UNIQUE), strict=True))


def test_grammar_key_strict_default_per_request_and_limits() -> None:
    text = json.dumps(UNIQUE)
    assert grammar_key(SamplingParams(json_schema=text)).strict is False  # type: ignore[union-attr]
    assert grammar_key(SamplingParams(json_schema=text), strict=True).strict is True  # type: ignore[union-attr]
    p = SamplingParams(json_schema=text, json_schema_strict=False)
    assert grammar_key(p, strict=True).strict is False  # type: ignore[union-attr]
    assert grammar_key(SamplingParams(regex="a+"), strict=True) == GrammarKey("regex", "a+")
    with pytest.raises(GrammarError, match="at most 100"):
        grammar_key(SamplingParams(json_schema=" " * 101), max_length=100)
    with pytest.raises(GrammarError, match="nests too deeply"):
        grammar_key(SamplingParams(json_schema="[" * 10_000 + "]" * 10_000))
    with pytest.raises(ValueError, match="json_schema_strict needs json_schema"):
        SamplingParams(regex="a", json_schema_strict=True).validate()


def test_a_worker_takes_its_next_job_before_the_last_result_is_rebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker, two queued compiles: while the engine side rebuilds the first result's index
    (GIL time in the engine process), the worker already compiles the second."""
    from lmserver.engine.constrained import workers

    seen: list[dict[int, str]] = []
    warm = workers.warm_index

    def spy(index: Any) -> Any:
        if not seen:
            seen.append(b._pool.busy() if b._pool is not None else {})
        return warm(index)

    monkeypatch.setattr(workers, "warm_index", spy)
    b = _backend(compile_workers=1)
    try:
        first = b.submit(GrammarKey("regex", "[0-9]{1,3}"))
        second = b.submit(GrammarKey("regex", "[a-c]+x"))
        cf.wait([first.future, second.future], timeout=120)
        assert len(seen) == 1 and list(seen[0].values()) == ["regex"]  # the second was running
        for t, pattern in ((first, "[0-9]{1,3}"), (second, "[a-c]+x")):
            _same(b.result(t), cfsm.compile_regex(pattern, VOCAB))  # type: ignore[arg-type]
    finally:
        b.shutdown()


def test_quick_compiles_do_not_queue_behind_a_long_one() -> None:
    """One worker busy with a long compile while another job waits: an extra worker starts and
    compiles it; once idle with nothing queued the extra worker exits."""
    from lmserver.engine.constrained.workers import CompilePool

    pool = CompilePool(1, lambda: VOCAB, on_error=lambda kind, msg: GrammarError(msg),
                       on_timeout=lambda job: GrammarError("timeout"), long_job_s=0.2)
    try:
        _, slow = pool.submit("regex", SLOW, cfsm.CfsmConfig(), time.monotonic() + 600)
        _until(lambda: pool.busy(), what="the slow compile running")
        _, quick = pool.submit("regex", "[a-c]+x", cfsm.CfsmConfig(), time.monotonic() + 600)
        _until(quick.done, timeout_s=120, what="the quick compile")
        cf.wait([slow], timeout=300)
        assert pool.stats.extra_started == 1 and pool.stats.started == 2
        _same(quick.result(), cfsm.compile_regex("[a-c]+x", VOCAB))
        _same(slow.result(), cfsm.compile_regex(SLOW, VOCAB))
        _until(lambda: len(pool.worker_pids()) == 1, timeout_s=60, what="the extra worker's exit")
        assert pool.stats.retired == 1
    finally:
        pool.shutdown()


def test_auto_workers_follow_the_cpus_this_process_may_use() -> None:
    from lmserver.engine.constrained.backend import auto_compile_workers, available_cpus, cgroup_cpu_limit

    assert cgroup_cpu_limit("max 100000") is None and cgroup_cpu_limit("") is None
    assert cgroup_cpu_limit("400000 100000") == 4.0 and cgroup_cpu_limit("50000 100000") == 0.5
    assert cgroup_cpu_limit("x 1") is None and cgroup_cpu_limit("0 100000") is None
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))
    assert [auto_compile_workers(n) for n in (1, 4, 16, 64)] == [2, 2, 4, 8]


@pytest.mark.parametrize(("cpus", "workers", "most"), [(2, 2, 2), (3, 2, 2), (4, 2, 3), (16, 4, 8), (16, 1, 2)])
def test_extra_workers_leave_the_engine_a_cpu(monkeypatch: pytest.MonkeyPatch, cpus: int, workers: int,
                                              most: int) -> None:
    from lmserver.engine.constrained import backend as backend_module

    monkeypatch.setattr(backend_module, "available_cpus", lambda: cpus)
    b = _backend(compile_workers=workers)  # NOTE: the pool starts no process before its first job
    try:
        assert b._pool is not None and b._pool.max_workers == most
    finally:
        b.shutdown()


def test_bounded_queue_refuses_new_grammars_with_503() -> None:
    b = _backend(compile_workers=1, max_pending=1)
    try:
        slow = b.submit(GrammarKey("regex", SLOW))
        full = b.submit(GrammarKey("regex", "abc"))
        with pytest.raises(GrammarQueueFullError, match="compiling 1 grammars already") as err:
            b.result(full)
        assert err.value.status == 503 and b.rejected == 1
        assert b.submit(GrammarKey("regex", SLOW)).future is slow.future  # joining a running compile is fine
    finally:
        b.shutdown()
    with pytest.raises(GrammarError, match="shut down"):
        b.result(slow)


def test_timeout_kills_the_worker_only_when_no_request_waits() -> None:
    clock = Clock()
    b = _backend(compile_workers=2, compile_timeout_s=10.0, clock=clock)
    try:
        b.compile(GrammarKey("regex", "warm"))  # the workers are ready (the injected clock stands still)
        first = b.submit(GrammarKey("regex", SLOW))  # deadline 10
        _until(lambda: b._pool is not None and b._pool.busy(), what="the slow compile to start")
        pid = next(iter(b._pool.busy()))  # type: ignore[union-attr]
        clock.now = 5.0
        second = b.submit(GrammarKey("regex", SLOW))  # joins it; deadline 15
        assert second.future is first.future
        clock.now = 12.0
        stats = b.pool_stats
        assert stats is not None
        rounds = stats.rounds
        _until(lambda: stats.rounds >= rounds + 2, what="two dispatcher rounds")
        with pytest.raises(GrammarError, match="longer than 10 s"):
            b.result(first)  # its own deadline passed ...
        assert b.result(second) is None and not _gone(pid) and stats.killed == 0  # ... the other still waits
        clock.now = 16.0
        _until(lambda: first.future.done(), what="the kill")
        with pytest.raises(GrammarError, match="longer than 10 s"):
            b.result(second)
        assert stats.killed == 1
        _until(lambda: _gone(pid), what=f"worker {pid} to exit")
        # a new compile works; the pool is back to two workers, the killed one replaced
        _same(b.compile(GrammarKey("regex", "ab+")), cfsm.compile_regex("ab+", VOCAB))
        _until(lambda: len(b.worker_pids()) == 2, what="a replacement worker")
        assert pid not in b.worker_pids()
        # the timed-out grammar is compiled again when asked again (a failure is not cached)
        again = b.submit(GrammarKey("regex", SLOW))
        assert again.future is not first.future
    finally:
        b.shutdown()


def test_a_worker_that_dies_fails_its_grammar_only() -> None:
    b = _backend(compile_workers=1)
    try:
        b.compile(GrammarKey("regex", "warm"))
        slow = b.submit(GrammarKey("regex", SLOW))
        _until(lambda: b._pool is not None and b._pool.busy(), what="the slow compile to start")
        pid = next(iter(b._pool.busy()))  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)  # e.g. the kernel's OOM killer
        cf.wait([slow.future], timeout=60)
        with pytest.raises(GrammarError, match="worker exited while compiling it"):
            b.result(slow)
        _same(b.compile(GrammarKey("regex", "a|b")), cfsm.compile_regex("a|b", VOCAB))
    finally:
        b.shutdown()


def test_a_full_queue_is_a_503_through_the_http_layer() -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from lmserver.edge.api.errors import install_error_handlers
    from lmserver.engine.constrained import ConstrainedDecoding
    from lmserver.io_struct import InvalidRequestError, OverloadedError, request_error

    cd = ConstrainedDecoding(None, VOCAB.size, VOCAB.eos_token_ids, max_pending_compiles=1)
    cd.backend = _backend(compile_workers=1, max_pending=1)
    try:
        cd.submit("slow", GrammarKey("regex", SLOW))
        cd.submit("refused", GrammarKey("regex", "abc"))
        refused = dict(cd.poll())["refused"]
        assert isinstance(refused, GrammarQueueFullError)
    finally:
        cd.shutdown()
    out = cd.error_output("refused", refused)
    assert out.error_status == 503 and out.error is not None and "--grammar-max-pending" in out.error
    err = request_error(out.error, out.error_status)  # what the front end raises for it
    assert type(err) is OverloadedError and err.status == 503
    assert type(request_error("bad grammar")) is InvalidRequestError

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/x")
    async def x() -> None:
        raise err

    r = TestClient(app).get("/x")
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert "retry later" in r.json()["error"]["message"]


_UNGUARDED = """
import sys
from cfsm.testing import tiny_vocab
from lmserver.engine.constrained import GrammarBackend, GrammarKey
print("top level ran", flush=True)
v = tiny_vocab()
b = GrammarBackend(None, v.size, v.eos_token_ids, vocab=v, compile_workers=1)
print("states", b.compile(GrammarKey("regex", "a+b")).dfa.num_states, flush=True)
b.shutdown()
"""


def test_a_script_without_a_main_guard_runs_once(tmp_path: object) -> None:
    # multiprocessing's spawn would run this script again in each worker; the workers never do
    script = os.path.join(str(tmp_path), "unguarded.py")
    with open(script, "w") as f:
        f.write(_UNGUARDED)
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("top level ran") == 1 and "states 3" in done.stdout, done.stdout


_ORPHAN = """
import sys, time
from cfsm.testing import tiny_vocab
from lmserver.engine.constrained import GrammarBackend, GrammarKey
v = tiny_vocab()
b = GrammarBackend(None, v.size, v.eos_token_ids, vocab=v, compile_workers=2)
b.compile(GrammarKey("regex", "a+"))
b.submit(GrammarKey("regex", sys.argv[1]))
print(" ".join(map(str, b.worker_pids())), flush=True)
time.sleep(600)
"""


def test_workers_exit_when_the_engine_process_is_killed() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN, SLOW], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
    finally:
        proc.kill()  # SIGKILL: no atexit, no shutdown()
        proc.wait()
    _until(lambda: all(_gone(p) for p in pids), timeout_s=30, what="the orphaned workers to exit")
