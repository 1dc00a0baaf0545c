"""The overlap scheduler (engine/overlap.py) on the embedded SmolLM2 (CPU, float32).

Oracle: the serial path of the same engine (overlap off) on the same scripted workload, started
from the same state (empty radix cache, initial new-token ratio). The script reacts to outputs
only (an arrival once a request has some tokens, an abort at a token count), so both modes see
the same events at the same points of each request's output. KV accounting is checked after
every step: free + cached + request-owned slots == total.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lmserver.config import ServerConfig
from lmserver.engine import core as core_module
from lmserver.engine.core import EngineCore
from lmserver.engine.overlap import chain_ready
from lmserver.io_struct import GenerateReq, SamplingParams
from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV
from lmserver.scheduler.scheduler import NEW_TOKEN_RATIO_INIT

CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Script:
    """Requests at the start, one arriving when `trigger` has `after` tokens, one abort."""

    start: list[tuple[str, str, dict[str, Any]]]
    arrival: tuple[str, str, dict[str, Any]] | None = None
    trigger: tuple[str, int] = ("greedy-long", 3)
    abort: tuple[str, int] | None = ("aborted", 4)
    extra: dict[str, Any] = field(default_factory=dict)  # GenerateReq fields by request name


def _greedy(n: int, **kw: Any) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, **kw}


MIXED = Script(
    start=[
        ("greedy-long", "Once upon a time", _greedy(24, ignore_eos=True)),
        ("eos", CHAT, _greedy(40)),  # the answer ends with EOS well before 40 tokens
        ("short", "1, 2, 3, 4,", _greedy(3)),
        ("stop-token", "1, 2, 3, 4,", _greedy(20, stop_token_ids=[38])),  # stops at " 6"
        ("stop-string", "The quick brown fox", _greedy(20, stop=[" over"])),
        ("min-new", "List three colors:", _greedy(10, min_new_tokens=6, stop_token_ids=[28], logit_bias={"30": 2.0})),
        ("seeded", "My favourite food is", {"max_new_tokens": 14, "temperature": 0.9, "top_p": 0.9, "sampling_seed": 5}),
        ("penalty", "Water boils at", _greedy(9, repetition_penalty=1.3)),  # falls back to serial
        ("aborted", "def fibonacci(n):", _greedy(30)),
    ],
    arrival=("late", "The capital of France is", {"max_new_tokens": 12, "temperature": 0.7, "sampling_seed": 11}),
)
LOGPROBS = Script(
    start=[
        ("greedy-long", "Once upon a time", _greedy(12)),
        ("logprobs", "def fibonacci(n):", _greedy(8)),
    ],
    abort=None,
    extra={"logprobs": {"return_logprob": True, "top_logprobs_num": 2}},
)
TINY_KV = Script(  # 6 requests of ~15 + 24 tokens: 4 rows, 120 slots
    start=[(f"r{i}", p + " and then" * 3, _greedy(24, ignore_eos=True)) for i, p in enumerate(
        ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:", "1, 2, 3, 4,",
         "Water boils at"])],
    trigger=("r0", 2),
    abort=("r3", 5),
    arrival=("late", "The quick brown fox", _greedy(10)),
)


def _check_accounting(core: EngineCore) -> None:
    """Every usable slot is free, cached in the tree, or owned by exactly one live request."""
    kv = core.scheduler.kv
    owned = sum(len(r.kv) - r.cached_len for r in core.scheduler.reqs.values())
    assert kv.allocator.available + kv.cache.total_size + owned == kv.num_slots
    core.check_memory_invariant()


def _run(core: EngineCore, script: Script, overlap: bool, tag: str) -> dict[str, Any]:
    """Runs `script` from an empty cache; returns per-request tokens, text, finish reason."""
    core.step()  # lands a launch whose requests all ended (an aborted one's)
    assert core.flush_cache()
    core.scheduler.new_token_ratio = NEW_TOKEN_RATIO_INIT
    core.overlap = overlap
    tok = core.tokenizer
    rid = {name: f"{tag}-{name}" for name, _, _ in script.start}
    name_of: dict[str, str] = {}

    def add(name: str, prompt: str, params: dict[str, Any]) -> None:
        rid[name] = f"{tag}-{name}"
        name_of[rid[name]] = name
        core.add_request(GenerateReq(rid=rid[name], input_ids=list(tok(prompt)["input_ids"]),
                                     sampling_params=SamplingParams.from_dict(params), **script.extra.get(name, {})))

    for name, prompt, params in script.start:
        add(name, prompt, params)
    got: dict[str, dict[str, Any]] = {n: {"ids": [], "text": "", "reason": None, "lp": []} for n in rid}
    arrived = script.arrival is None
    aborted = script.abort is None
    while core.has_work():
        for out in core.step():
            g = got.setdefault(name_of[out.rid], {"ids": [], "text": "", "reason": None, "lp": []})
            g["ids"] += out.new_token_ids
            g["text"] += out.new_text
            g["lp"] += [(t, round(v, 4) if v is not None else None) for v, t, _ in out.output_token_logprobs]
            if out.finished:
                g["reason"] = out.finish_reason
        _check_accounting(core)
        if not arrived and len(got[script.trigger[0]]["ids"]) >= script.trigger[1]:
            assert script.arrival is not None
            add(*script.arrival)
            arrived = True
        if not aborted and script.abort is not None and len(got[script.abort[0]]["ids"]) >= script.abort[1]:
            core.abort_request(rid[script.abort[0]])
            aborted = True
    assert arrived and aborted
    _check_accounting(core)
    got["_cached_slots"] = core.scheduler.kv.cache.total_size  # the extra tokens were not cached
    return got


def _compare(core: EngineCore, script: Script) -> dict[str, Any]:
    before = core.get_stats()
    serial = _run(core, script, overlap=False, tag="serial")
    mid = core.get_stats()
    overlapped = _run(core, script, overlap=True, tag="overlap")
    after = core.get_stats()
    assert overlapped == serial
    assert mid["overlap_steps"] == before["overlap_steps"]
    assert after["overlap_steps"] > mid["overlap_steps"]  # it did overlap
    return {"serial": serial, "retractions": (mid["num_retractions"] - before["num_retractions"],
                                             after["num_retractions"] - mid["num_retractions"])}


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCore]:
    yield EngineCore(ServerConfig(dtype="float32", max_total_tokens=4096, max_running_requests=16,
                                  enable_overlap_schedule=True))


def test_mixed_workload_same_with_overlap_on_and_off(core: EngineCore) -> None:
    res = _compare(core, MIXED)["serial"]
    assert res["eos"]["reason"] == {"type": "stop", "matched": 2} and "Paris" in res["eos"]["text"]
    assert res["stop-token"]["reason"] == {"type": "stop", "matched": 38}
    assert res["short"]["reason"] == {"type": "length", "length": 3}
    assert res["aborted"]["reason"]["type"] == "abort" and len(res["aborted"]["ids"]) >= 4
    assert len(res["min-new"]["ids"]) >= 6
    assert len(res["late"]["ids"]) == 12 and len(res["greedy-long"]["ids"]) == 24


def test_logprob_requests_fall_back_and_stay_identical(core: EngineCore) -> None:
    res = _compare(core, LOGPROBS)["serial"]
    assert len(res["logprobs"]["lp"]) == len(res["logprobs"]["ids"]) == 8


def test_tiny_kv_cache_queue_retractions_and_eager_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 request rows for 7 requests (a standing queue) in 120 KV slots (retractions). Prefill-first
    rounds: mixed steps admit against the running requests' reserve after their decode slots, and
    this workload then never needs a retraction, the path under test."""
    # NOTE: eager graphs plan every replay for the full context (a graph's static upper bound): a short context keeps
    # the CPU's attention over it short
    monkeypatch.setenv(EAGER_GRAPHS_ENV, "1")
    small = EngineCore(ServerConfig(dtype="float32", max_total_tokens=120, max_running_requests=4, context_length=256,
                                    schedule_policy="fcfs", cuda_graph_max_bs=4, enable_overlap_schedule=True,
                                    enable_mixed_chunk=False))
    graphs = small.runner.cuda_graph
    assert graphs is not None
    chained_with_queue = []

    def spy(scheduler: Any, *args: Any) -> bool:
        ok = chain_ready(scheduler, *args)
        if ok and scheduler.waiting:
            chained_with_queue.append(len(scheduler.waiting))
        return ok

    monkeypatch.setattr(core_module, "chain_ready", spy)
    res = _compare(small, TINY_KV)
    assert res["retractions"][0] > 0 and res["retractions"][1] > 0
    assert graphs.num_replays > 0
    assert chained_with_queue  # overlapped while requests waited for a row


def test_eager_graphs_mixed_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EAGER_GRAPHS_ENV, "1")
    graphed = EngineCore(ServerConfig(dtype="float32", max_total_tokens=4096, max_running_requests=16,
                                      cuda_graph_max_bs=8, context_length=256))
    graphs = graphed.runner.cuda_graph
    assert graphs is not None
    _compare(graphed, MIXED)
    # greedy launches took the graph's argmax, the sampled and penalized ones the logits
    assert 0 < graphs.num_greedy_replays < graphs.num_replays


def test_overlap_default_resolves_by_device_and_a_config_field() -> None:
    from lmserver.models.config import ModelConfig
    from lmserver.runner.resolve import resolve_config

    assert ServerConfig().enable_overlap_schedule is None  # resolved: on with CUDA and TP 1
    assert ServerConfig(enable_overlap_schedule=True).replace(tp_size=1).enable_overlap_schedule
    mc = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
                                   "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                   "num_key_value_heads": 1, "max_position_embeddings": 64})
    cpu = ServerConfig(device="cpu", max_total_tokens=256)
    assert resolve_config(cpu, mc, "m").enable_overlap_schedule is False
    assert resolve_config(cpu.replace(enable_overlap_schedule=True), mc, "m").enable_overlap_schedule is True


@pytest.mark.gpu
def test_chained_launches_do_not_wait_for_the_gpu_and_match_serial(tmp_path: Path) -> None:
    """On CUDA with decode graphs: a chained launch (schedule, forward, device sampling, host
    copy) makes no synchronizing CUDA call, and greedy + seeded tokens equal the serial path's.
    A tiny random Llama (no embedded model needed on the GPU machine)."""
    import torch

    from lmserver.testing.tiny_llama import write_tiny_llama

    folder = str(write_tiny_llama(tmp_path / "tiny"))
    gpu = EngineCore(ServerConfig(model_path=folder, tokenizer_path=folder, dtype="float32", attention_backend="triton",
                                  cuda_graph_max_bs=4, max_total_tokens=8192, enable_overlap_schedule=True))
    assert gpu.runner.cuda_graph is not None
    launch = gpu._launch

    def no_sync(decision: Any, input_ids: Any = None, *rest: Any) -> Any:
        if input_ids is None:
            return launch(decision, input_ids, *rest)
        torch.cuda.set_sync_debug_mode("error")  # raises on any synchronizing call
        try:
            return launch(decision, input_ids, *rest)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    gpu._launch = no_sync  # type: ignore[method-assign]
    script = Script(start=[
        ("greedy-long", "w10 w11 w12 w13", _greedy(32, ignore_eos=True)),
        ("seeded", "w40 w41 w42 w43 w44", {"max_new_tokens": 24, "temperature": 0.9, "sampling_seed": 5}),
        ("bias", "w70 w71 w72", _greedy(16, logit_bias={"30": 2.0})),
    ], abort=None)
    _compare(gpu, script)


def test_offline_engine_is_idle_after_generate() -> None:
    """Engine.generate returns with nothing in flight (the last step's extra rows landed)."""
    from lmserver.engine.offline import Engine

    engine = Engine(dtype="float32", max_total_tokens=2048, enable_overlap_schedule=True)
    try:
        prompts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
        params = [_greedy(n) for n in (6, 9, 12)]
        outs = {}
        for overlap in (True, False):
            engine.core.overlap = overlap
            assert engine.flush_cache()
            got = engine.generate(prompts, params)
            assert isinstance(got, list)
            outs[overlap] = [o["output_ids"] for o in got]
            assert not engine.core.has_work()
            engine.core.check_memory_invariant()
        assert outs[True] == outs[False]
        assert engine.core.get_stats()["overlap_steps"] > 0
    finally:
        engine.shutdown()
