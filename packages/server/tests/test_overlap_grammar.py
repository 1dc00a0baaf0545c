"""Grammar rows in the overlap schedule (engine/overlap.py: delayed sampling) on the embedded
SmolLM2 (CPU, float32).

Oracles: the serial path of the same engine (overlap off) on the same requests, the `regex`
module (fullmatch) and `jsonschema` for every constrained output, and the KV accounting after
every step (free + cached + request-owned slots == total).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import regex

from lmserver.config import ServerConfig
from lmserver.engine.constrained import GrammarKey
from lmserver.engine.constrained.backend import GrammarTicket
from lmserver.engine.core import EngineCore
from lmserver.io_struct import GenerateReq, SamplingParams
from lmserver.scheduler.scheduler import NEW_TOKEN_RATIO_INIT

DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]( and 20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9])*"
ITEM = {  # an order line (any small object will do)
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 50},
        "gift": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
    },
    "required": ["sku", "qty", "gift", "size"],
}
REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("plain", "Once upon a time", {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}),
    ("item", "A person as JSON:", {"max_new_tokens": 40, "temperature": 0.0, "json_schema": json.dumps(ITEM)}),
    ("dates", "Two dates:", {"max_new_tokens": 16, "temperature": 0.0, "regex": DATE}),
    ("seeded", "Another person:", {"max_new_tokens": 24, "temperature": 0.8, "sampling_seed": 3,
                                   "json_schema": json.dumps(ITEM)}),
    ("plain-sampled", "The weather today", {"max_new_tokens": 8, "temperature": 0.7, "sampling_seed": 9}),
]


def _check_accounting(core: EngineCore) -> None:
    kv = core.scheduler.kv
    owned = sum(len(r.kv) - r.cached_len for r in core.scheduler.reqs.values())
    assert kv.allocator.available + kv.cache.total_size + owned == kv.num_slots


def _run(core: EngineCore, overlap: bool, tag: str) -> dict[str, dict[str, Any]]:
    core.step()
    assert core.flush_cache()
    core.scheduler.new_token_ratio = NEW_TOKEN_RATIO_INIT
    core.overlap = overlap
    # NOTE: compiled before (the cache): each grammar request is admitted at the same step in both modes
    for _, _, params in REQUESTS:
        key = core.constrained.grammar_key(SamplingParams.from_dict(params))
        if key is not None:
            core.constrained.backend.compile(key)
    names = {f"{tag}-{name}": name for name, _, _ in REQUESTS}
    for name, prompt, params in REQUESTS:
        core.add_request(GenerateReq(rid=f"{tag}-{name}", input_ids=list(core.tokenizer(prompt)["input_ids"]),
                                     sampling_params=SamplingParams.from_dict(params)))
    got: dict[str, dict[str, Any]] = {n: {"ids": [], "text": "", "reason": None} for n in names.values()}
    while core.has_work():
        for out in core.step():
            g = got[names[out.rid]]
            g["ids"] += out.new_token_ids
            g["text"] += out.new_text
            if out.finished:
                g["reason"] = out.finish_reason
        _check_accounting(core)
    core.check_memory_invariant()
    return got


def _check_languages(got: dict[str, dict[str, Any]]) -> None:
    for name in ("item", "seeded"):
        out = got[name]
        if out["reason"]["type"] == "stop":
            jsonschema.validate(json.loads(out["text"]), ITEM)
        else:  # out of tokens: a prefix of a document (never an invalid character)
            assert out["reason"]["type"] == "length", out
    dates = got["dates"]
    assert regex.fullmatch(DATE, dates["text"], partial=dates["reason"]["type"] != "stop"), dates


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCore]:
    yield EngineCore(ServerConfig(dtype="float32", max_total_tokens=4096, max_running_requests=16,
                                  enable_overlap_schedule=True))


@pytest.fixture
def no_jump(core: EngineCore) -> Iterator[EngineCore]:
    core.constrained.jump_forward = False  # what --disable-jump-forward sets (read per new request)
    try:
        yield core
    finally:
        core.constrained.jump_forward = True


@pytest.fixture
def jump(core: EngineCore) -> EngineCore:
    assert core.constrained.jump_forward
    return core


def test_grammar_rows_chain_and_match_serial_without_jump_forward(no_jump: EngineCore) -> None:
    before = no_jump.get_stats()
    serial = _run(no_jump, overlap=False, tag="serial")
    mid = no_jump.get_stats()
    overlapped = _run(no_jump, overlap=True, tag="overlap")
    after = no_jump.get_stats()
    assert overlapped == serial
    assert mid["overlap_grammar_steps"] == before["overlap_grammar_steps"]
    assert after["overlap_grammar_steps"] > mid["overlap_grammar_steps"]  # grammar rows chained
    _check_languages(overlapped)


@pytest.mark.slow
def test_grammar_rows_chain_with_jump_forward_and_stay_in_the_language(jump: EngineCore) -> None:
    """Jumps are declined while a chained launch holds the rows: the tokens may differ from the
    serial path's, the outputs stay in their grammars and plain requests are unchanged."""
    before = jump.get_stats()
    serial = _run(jump, overlap=False, tag="serial")
    mid = jump.get_stats()
    overlapped = _run(jump, overlap=True, tag="overlap")
    after = jump.get_stats()
    assert after["overlap_grammar_steps"] > mid["overlap_grammar_steps"]
    assert mid["jump_forward_steps"] > before["jump_forward_steps"]  # the serial run jumped
    _check_languages(serial)
    _check_languages(overlapped)
    assert overlapped["plain"] == serial["plain"]


def test_a_running_compile_does_not_stop_chaining(jump: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain rows keep chaining while a grammar compiles (its end is an arrival); once it is
    ready the next schedule admits it, and its output is in its language."""
    core = jump
    core.step()
    core.overlap = True
    key = GrammarKey("regex", DATE)
    index = core.constrained.backend.compile(key)
    pending: cf.Future[Any] = cf.Future()
    monkeypatch.setattr(core.constrained.backend, "submit",
                        lambda k: GrammarTicket(k, pending, core.constrained.backend.clock() + 600.0))
    tok = core.tokenizer
    core.add_request(GenerateReq(rid="long", input_ids=list(tok("Once upon a time")["input_ids"]),
                                 sampling_params=SamplingParams.from_dict(
                                     {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True})))
    for _ in range(4):  # prefill, then decoding
        core.step()
    core.add_request(GenerateReq(rid="late", input_ids=list(tok("Two dates:")["input_ids"]),
                                 sampling_params=SamplingParams.from_dict(
                                     {"max_new_tokens": 12, "temperature": 0.0, "regex": DATE})))
    start = core.get_stats()["overlap_steps"]
    for _ in range(6):
        core.step()
        _check_accounting(core)
    assert core.constrained.num_waiting == 1 and core.constrained.num_chain_blockers() == 0
    assert core.get_stats()["overlap_steps"] >= start + 5  # chained while the compile ran
    pending.set_result(index)
    assert core.constrained.num_chain_blockers() == 1
    text = {"long": "", "late": ""}
    while core.has_work():
        for out in core.step():
            text[out.rid] += out.new_text
        _check_accounting(core)
    assert core.constrained.num_waiting == 0
    assert regex.fullmatch(DATE, text["late"], partial=True)
    core.check_memory_invariant()
