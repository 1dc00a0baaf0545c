"""lmserver.engine.constrained without a model: grammar keys, the compile stage (cache, errors,
timeout), batch masks, jump-forward planning and the scheduler rewind.

Oracles: the `regex` module (fullmatch of decoded text), `Guide.advance` on a copy (which
tokens a mask must allow), bit-exact comparison for unconstrained rows, and the radix-cache
memory invariant.
"""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest
import regex
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cfsm
from cfsm.testing import allowed_by_advance, tiny_vocab
from lmserver.engine.constrained import (
    BatchMasker,
    ConstrainedDecoding,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    ReqGrammar,
    grammar_key,
)
from lmserver.io_struct import InvalidRequestError, SamplingParams
from lmserver.scheduler import KVManager, Req, ReqStatus, Scheduler

VOCAB = tiny_vocab()


def _longest_match(text: str) -> list[int]:
    """Reference tokenizer over the tiny vocabulary (longest match, like a BPE's merges would)."""
    table: dict[bytes, int] = {}
    for i, t in enumerate(VOCAB.tokens):
        if t and i not in VOCAB.special_token_ids:
            table.setdefault(t, i)
    data, out, i = text.encode(), [], 0
    while i < len(data):
        for k in range(min(8, len(data) - i), 0, -1):
            if data[i : i + k] in table:
                out.append(table[data[i : i + k]])
                i += k
                break
        else:
            raise AssertionError(f"untokenizable byte {data[i]}")
    return out


def _backend(**kw: object) -> GrammarBackend:
    # NOTE: compiles in threads here (these tests replace `_build`); test_grammar_workers.py covers the processes
    kw.setdefault("compile_workers", 0)
    return GrammarBackend(None, VOCAB.size, VOCAB.eos_token_ids, vocab=VOCAB, encode=_longest_match, **kw)  # type: ignore[arg-type]


# --- grammar keys -------------------------------------------------------------------------------


def test_grammar_key_kinds_and_errors() -> None:
    assert grammar_key(SamplingParams()) is None
    assert grammar_key(SamplingParams(regex="a+")) == GrammarKey("regex", "a+")
    assert grammar_key(SamplingParams(json_schema='{"type": "object"}')) == GrammarKey("json_object", "")
    key = grammar_key(SamplingParams(json_schema='{"type": "integer",  "minimum": 1}'))
    assert key == GrammarKey("json_schema", '{"type":"integer","minimum":1}')
    assert grammar_key(SamplingParams(ebnf="root ::= 'a'")) == GrammarKey("ebnf", "root ::= 'a'")
    with pytest.raises(GrammarError, match="the ebnf is 12 characters long"):
        grammar_key(SamplingParams(ebnf="root ::= 'a'"), max_length=5)
    with pytest.raises(InvalidRequestError, match="json_schema is not valid JSON"):
        grammar_key(SamplingParams(json_schema="{nope"))


# --- compile stage --------------------------------------------------------------------------------


def test_backend_caches_by_kind_and_text() -> None:
    b = _backend()
    i1 = b.compile(GrammarKey("regex", "[0-9]+"))
    i2 = b.compile(GrammarKey("regex", "[0-9]+"))
    assert i1 is i2 and b.hits == 1 and b.misses == 1
    i3 = b.compile(GrammarKey("json_schema", '{"type":"integer"}'))
    assert i3 is not i1 and b.misses == 2
    g = cfsm.Guide(i1)
    g.advance_many(_longest_match("123"))
    assert g.can_stop()
    b.shutdown()


@pytest.mark.parametrize(("key", "message"), [
    (GrammarKey("regex", "(ab"), "invalid regex grammar"),
    (GrammarKey("regex", r"(a)\1"), "invalid regex grammar"),
    (GrammarKey("json_schema", '{"type":"integer","minimum":5,"maximum":1}'), "invalid json_schema grammar"),
    (GrammarKey("nope", "x"), "unknown grammar kind"),
])
def test_backend_compile_errors_are_grammar_errors(key: GrammarKey, message: str) -> None:
    b = _backend()
    with pytest.raises(GrammarError, match=message):
        b.compile(key)
    b.shutdown()


def test_backend_timeout_does_not_block_other_grammars() -> None:
    now = [0.0]
    b = _backend(compile_timeout_s=5.0, clock=lambda: now[0])
    release = threading.Event()
    real_build = b._build

    def build(key: GrammarKey) -> cfsm.Index:
        if key.text == "slow":
            release.wait(10)
        return real_build(key)

    b._build = build  # type: ignore[method-assign]
    slow = b.submit(GrammarKey("regex", "slow"))
    fast = b.submit(GrammarKey("regex", "fast"))
    fast.future.result(timeout=10)  # a free worker compiles the other grammar meanwhile
    assert b.result(fast) is not None
    assert b.result(slow) is None  # still compiling, before the deadline
    now[0] = 5.0
    with pytest.raises(GrammarError, match="longer than 5 s"):
        b.result(slow)
    release.set()
    slow.future.result(timeout=10)
    assert b.result(b.submit(GrammarKey("regex", "slow"))) is not None  # the late result is cached
    b.shutdown()


def test_constrained_stage_poll_reports_ready_and_failed() -> None:
    cd = ConstrainedDecoding(None, VOCAB.size, VOCAB.eos_token_ids)
    cd.backend = _backend()
    cd.submit("ok", GrammarKey("regex", "ab|cd"))
    cd.submit("bad", GrammarKey("regex", "a{3,1}"))
    cd.submit("gone", GrammarKey("regex", "x"))
    cd.drop("gone")
    got: dict[str, object] = {}
    for _ in range(200):
        got.update(dict(cd.poll(wait_s=0.05)))
        if len(got) == 2:
            break
    assert set(got) == {"ok", "bad"} and cd.num_waiting == 0
    assert isinstance(got["ok"], cfsm.Index)
    assert isinstance(got["bad"], GrammarError)
    out = cd.error_output("bad", got["bad"])  # type: ignore[arg-type]
    assert out.finished and out.error and "invalid regex grammar" in out.error
    assert cd.stats["grammar_errors"] == 1


# --- masks ------------------------------------------------------------------------------------------




def test_batch_mask_constrained_rows_only() -> None:
    b = _backend()
    g1 = ReqGrammar(b.compile(GrammarKey("regex", r'\{"name":"[a-c]+"\}')), _longest_match)
    g2 = ReqGrammar(b.compile(GrammarKey("regex", "(true|false|12)")), _longest_match)
    g2.accept(_longest_match("1")[0])
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB.size)
    before = logits.clone()
    masker = BatchMasker(VOCAB.size)
    masker.apply(logits, [g1, None, g2, None])
    for row in (1, 3):
        assert torch.equal(logits[row], before[row])
    for row, g in ((0, g1), (2, g2)):
        finite = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
        assert finite == allowed_by_advance(g.guide, VOCAB.size)
        kept = sorted(finite)
        assert torch.equal(logits[row, kept], before[row, kept])
    assert masker.num_masked_rows == 2
    with pytest.raises(ValueError, match="columns"):
        masker.apply(torch.zeros(1, VOCAB.size + 1), [g1])
    b.shutdown()


# --- jump-forward -------------------------------------------------------------------------------------

PATTERNS = [
    r'\{"name":"[a-c]+","age":[0-9]{1,3}\}',
    r"(true|false|null)",
    r"ip 10\.[0-9]\.0\.[0-9]",
    r'\[1(,1)*\], "e"',
    r"(abc|abd)e+",
]


def _walk(pattern: str, seed: int, jump: bool) -> tuple[list[int], ReqGrammar, int]:
    """Random allowed tokens (the masked sampler), with jump-forward after each one."""
    rng = random.Random(seed)
    index = cfsm.compile_regex(pattern, VOCAB)
    g = ReqGrammar(index, _longest_match, jump_forward=jump)
    out: list[int] = []
    forwards = 0
    for _ in range(60):
        j = g.plan_jump(out, 1000)
        if j is not None:
            before = VOCAB.decode(out)
            kept = len(out) - j.num_rollback
            g.apply_jump(j)
            out = out[:kept] + list(j.token_ids)
            assert VOCAB.decode(out) == before + j.text.encode()  # retokenized, same bytes + forced
        if g.is_finished() or (g.guide.can_stop() and rng.random() < 0.3):
            break
        choices = [int(t) for t in g.guide.allowed_token_ids() if t not in VOCAB.eos_token_ids]
        if not choices:
            break
        tok = rng.choice(choices)
        assert g.accept(tok)
        out.append(tok)
        forwards += 1
    assert g.guide.num_tokens == len(out)  # guide and output never desync
    return out, g, forwards


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(PATTERNS), st.integers(0, 10_000))
def test_jump_forward_walk_stays_in_the_language(pattern: str, seed: int) -> None:
    out, g, _ = _walk(pattern, seed, jump=True)
    text = VOCAB.decode(out).decode()
    if g.guide.can_stop():
        assert regex.fullmatch(pattern, text), text
    else:
        assert regex.fullmatch(pattern, text, partial=True), text


def test_jump_forward_saves_forwards_on_forced_text() -> None:
    pattern = r'\{"name":"[a-c]+","age":[0-9]{1,3}\}'
    _, g_on, steps_on = _walk(pattern, 1, jump=True)
    assert g_on.jump_forward_tokens >= 4 and g_on.num_jumps >= 2
    _, g_off, steps_off = _walk(pattern, 1, jump=False)
    assert g_off.jump_forward_tokens == 0 and steps_off > steps_on


def test_plan_jump_respects_max_new_tokens_and_rejects_bad_retokenization() -> None:
    index = cfsm.compile_regex("abcabcabc", VOCAB)
    g = ReqGrammar(index, _longest_match)
    full = g.plan_jump([], 100)
    assert full is not None and VOCAB.decode(full.token_ids) == b"abcabcabc"
    short = g.plan_jump([], 1)
    assert short is not None and len(short.token_ids) == 1
    assert g.plan_jump([], 0) is None
    bad = ReqGrammar(index, lambda text: [VOCAB.tokens.index(b"x")] * len(text))
    assert bad.plan_jump([], 100) is not None  # cfsm falls back to its own tokens
    off = ReqGrammar(index, _longest_match, jump_forward=False)
    assert off.plan_jump([], 100) is None


# --- scheduler rewind ----------------------------------------------------------------------------------


def _running_req(sched: Scheduler, prompt: list[int], outputs: list[int]) -> Req:
    req = Req("r", prompt, SamplingParams(), 32, arrival=1)
    sched.add(req)
    d = sched.schedule()
    assert d.mode == "extend"
    sched.commit(d)
    req.output_ids.append(outputs[0])
    for t in outputs[1:]:
        d = sched.schedule()
        assert d.mode == "decode"
        sched.commit(d)
        req.output_ids.append(t)
    assert req.status == ReqStatus.RUNNING
    return req


@pytest.mark.parametrize(("new", "reused"), [([50, 51, 7, 8, 9], 6), ([50, 60, 61], 5), ([70], 4)])
def test_rewind_reuses_the_kept_prefix(new: list[int], reused: int) -> None:
    kv = KVManager(64)
    sched = Scheduler(kv, max_running_requests=2)
    req = _running_req(sched, [1, 2, 3, 4], [50, 51, 52])  # 52 sampled, not in the KV yet
    out_ref = req.output_ids
    sched.rewind(req, new)
    assert req.output_ids is out_ref and req.output_ids == new  # the sampler's list is shared
    assert req.status == ReqStatus.PREFILLING and req in sched.prefilling and req not in sched.running
    assert req.kv_len == reused
    d = sched.schedule()
    assert d.mode == "extend"
    (item,) = d.items
    assert item.prefix_len == reused and item.token_ids == ([1, 2, 3, 4] + new)[reused:]
    assert item.table_start == 0 and len(item.table_slots) == 4 + len(new)
    assert sched.commit(d) == [req] and req.status == ReqStatus.RUNNING
    sched.finish(req, {"type": "stop"})
    sched.check_memory_invariant()


def test_rewind_of_a_waiting_request_only_sets_tokens() -> None:
    req = Req("w", [1, 2], SamplingParams(), 8, arrival=1)
    sched = Scheduler(KVManager(16), max_running_requests=1)
    sched.rewind(req, [5, 6])
    assert req.output_ids == [5, 6] and req.status == ReqStatus.WAITING and req.kv_len == 0


def test_schema_grammar_walk_validates() -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "enum": ["abc", "the"]},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    # NOTE: compact whitespace: a uniform random walk under the default (flexible) spends its
    # steps on whitespace
    b = _backend(cfsm_config=cfsm.CfsmConfig(whitespace="compact"))
    index = b.compile(GrammarKey("json_schema", json.dumps(schema)))
    g = ReqGrammar(index, _longest_match)
    rng = np.random.default_rng(0)
    out: list[int] = []
    for _ in range(40):
        j = g.plan_jump(out, 100)
        if j is not None:
            g.apply_jump(j)
            out = out[: len(out) - j.num_rollback] + list(j.token_ids)
        if g.guide.can_stop():
            break
        choices = [int(t) for t in g.guide.allowed_token_ids() if t not in VOCAB.eos_token_ids]
        tok = int(rng.choice(choices))
        assert g.accept(tok)
        out.append(tok)
    import jsonschema

    jsonschema.validate(json.loads(VOCAB.decode(out)), schema)
    assert g.jump_forward_tokens > 0
    b.shutdown()


def test_jump_stops_before_trailing_spaces() -> None:
    index = cfsm.compile_regex("Name: [A-Z][a-z]+", VOCAB)
    g = ReqGrammar(index, _longest_match)
    j = g.plan_jump([], 100)
    assert j is not None and j.text == "Name:" and VOCAB.decode(j.token_ids) == b"Name:"
    g.apply_jump(j)
    assert g.plan_jump(list(j.token_ids), 100) is None  # only " " is forced now: the model writes it
    spaces = ReqGrammar(cfsm.compile_regex("   x?", VOCAB), _longest_match)
    assert spaces.plan_jump([], 100) is None


def test_unexpected_compile_failure_fails_the_request_only() -> None:
    b = _backend()

    def boom(key: GrammarKey) -> cfsm.Index:
        raise MemoryError("out of memory in the DFA")

    b._build = boom  # type: ignore[method-assign]
    with pytest.raises(GrammarError, match="grammar failed: MemoryError: out of memory"):
        b.compile(GrammarKey("regex", "a"))
    b.shutdown()


@pytest.mark.gpu
def test_batch_mask_cuda_kernel_matches_cpu() -> None:
    b = _backend()
    g1 = ReqGrammar(b.compile(GrammarKey("regex", r'\{"name":"[a-c]+"\}')), _longest_match)
    g2 = ReqGrammar(b.compile(GrammarKey("regex", "(true|false|12)")), _longest_match)
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB.size)
    rows = [g1, None, g2, None, g1]
    cpu = BatchMasker(VOCAB.size).apply(logits.clone(), rows)
    gpu = BatchMasker(VOCAB.size).apply(logits.cuda(), rows).cpu()
    assert torch.equal(cpu, gpu)
    assert torch.equal(gpu[1], logits[1]) and torch.equal(gpu[3], logits[3])
    b.shutdown()


def test_jump_forward_extend_rides_along_with_decodes() -> None:
    kv = KVManager(128)
    sched = Scheduler(kv, max_running_requests=4)
    a = Req("a", [1, 2, 3], SamplingParams(), 32, arrival=1)
    b = Req("b", [4, 5, 6, 7], SamplingParams(), 32, arrival=2)
    sched.add(a)
    sched.add(b)
    sched.commit(sched.schedule())
    a.output_ids.append(10)
    b.output_ids.append(20)
    cd = ConstrainedDecoding(None, VOCAB.size, VOCAB.eos_token_ids)
    sched.rewind(a, [10, 11, 12, 13])
    cd._rewound.add("a")
    d = cd.schedule(sched)
    assert d.mode == "extend" and not sched.enable_mixed_chunk
    items = {i.rid: i for i in d.items}
    assert items["a"].token_ids == [10, 11, 12, 13] and items["b"].token_ids == [20]  # b decodes meanwhile
    sched.commit(d)
    assert a.status == ReqStatus.RUNNING and cd.schedule(sched).mode == "decode" and not cd._rewound


def test_an_outgrown_pushdown_index_is_compiled_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import lmserver.engine.constrained.backend as backend_mod

    backend = _backend(compile_workers=0)
    key = GrammarKey("ebnf", 'root ::= "(" root? ")"')
    first = backend.compile(key)
    assert isinstance(first, cfsm.GrammarIndex) and backend.compile(key) is first
    monkeypatch.setattr(backend_mod, "MAX_GRAMMAR_CONFIGURATIONS", first.num_configurations - 1)
    again = backend.compile(key)
    assert again is not first and isinstance(again, cfsm.GrammarIndex)
    backend.shutdown()
