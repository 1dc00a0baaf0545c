"""The jump-forward policy (lmserver.engine.constrained.policy) and its use by ConstrainedDecoding.

Oracles: a round-by-round cost simulation with a fake clock (is the total request time lower
with the round's jumps than without?), the `regex` module (fullmatch of decoded text), the text
of the same requests without jump-forward (a policy changes when text is appended, never what),
a count of sampled tokens (metadata: jump-forward tokens = output tokens - sampled tokens), and
the radix-cache memory invariant. The engine loop is a small driver over the real Scheduler.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

import cfsm
from cfsm.testing import tiny_vocab
from lmserver.engine.constrained import ConstrainedDecoding, GrammarBackend, ReqGrammar
from lmserver.engine.constrained.policy import AUTO_MIN_TOKENS, JumpPolicy, parse_min_tokens
from lmserver.engine.detokenizer import IncrementalDetokenizer, OutputText
from lmserver.io_struct import SamplingParams
from lmserver.scheduler import KVManager, Req, ReqStatus, Scheduler

VOCAB = tiny_vocab()
TOKEN = {t: i for i, t in reversed(list(enumerate(VOCAB.tokens))) if t and i not in VOCAB.special_token_ids}


def _longest_match(text: str) -> list[int]:
    data, out, i = text.encode(), [], 0
    while i < len(data):
        k = next(k for k in range(min(8, len(data) - i), 0, -1) if data[i : i + k] in TOKEN)
        out.append(TOKEN[data[i : i + k]])
        i += k
    return out


# --- the decision -----------------------------------------------------------------------------


def _total_time(lengths: list[int], forced: list[int], extra: float, jump: bool) -> float:
    """Sum of completion times (fake clock) of requests that each decode `lengths[i]` more
    tokens, the first `forced[i]` of them forced. A decode round costs 1; a round carrying
    extends costs 1 + `extra`. With `jump`, the first round carries the forced tokens."""
    clock, total = 0.0, 0.0
    left = [n - f if jump else n for n, f in zip(lengths, forced, strict=True)]
    first = True
    while any(n > 0 for n in left):
        clock += 1 + (extra if first and jump and any(forced) else 0)
        first = False
        for i, n in enumerate(left):
            if n > 0:
                left[i] = n - 1
                if left[i] == 0:
                    total += clock
    return total


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.lists(st.tuples(st.integers(0, 16), st.integers(1, 30)), min_size=1, max_size=8))
def test_batch_decision_matches_the_cost_simulation(min_tokens: int, reqs: list[tuple[int, int]]) -> None:
    forced = [f for f, _ in reqs]
    lengths = [f + free for f, free in reqs]  # every request samples at least one free token after
    policy = JumpPolicy(min_tokens)
    made = policy.batch([f for f in forced if f], len(reqs), extend_pending=False)
    with_jumps = _total_time(lengths, forced, min_tokens - 1, jump=True)
    without = _total_time(lengths, forced, min_tokens - 1, jump=False)
    assert made == (any(forced) and with_jumps < without), (with_jumps, without)


def test_now_decisions() -> None:
    p = JumpPolicy(8)
    kw: dict[str, bool] = {"decoding": True, "ends_request": False, "extend_pending": False, "deferrable": True}
    assert p.now(20, **kw) == "defer"  # weighed with the round's other jumps at the next schedule
    assert p.now(1, **{**kw, "decoding": False}) == "jump"  # joins its own first prefill
    assert p.now(1, **{**kw, "ends_request": True}) == "jump"  # no forward follows
    assert p.now(1, **{**kw, "extend_pending": True}) == "jump"  # rides along
    assert p.now(7, **{**kw, "deferrable": False}) == "skip"
    assert p.now(8, **{**kw, "deferrable": False}) == "jump"
    always = JumpPolicy(1)
    assert all(always.now(1, **{**kw, "deferrable": d}) == "jump" for d in (True, False))
    assert always.batch([1], 64, extend_pending=False)
    assert not p.batch([], 1, extend_pending=True)
    assert p.batch([1], 64, extend_pending=True)
    assert p.batch([8], 1, extend_pending=False) and not p.batch([7], 1, extend_pending=False)
    assert p.batch([8] * 32, 32, extend_pending=False) and not p.batch([8] * 16, 32, extend_pending=False)


def test_min_tokens_option() -> None:
    assert parse_min_tokens("auto") is None and parse_min_tokens("3") == 3 and parse_min_tokens(2) == 2
    for bad in ("0", "-1", "x", 0, True):
        with pytest.raises(ValueError, match="jump_forward_min_tokens"):
            parse_min_tokens(bad)
    # "auto" is the device's measured value: on the CPU every jump pays (always), on CUDA short ones wait
    assert JumpPolicy.for_device("auto", "cpu").min_tokens == AUTO_MIN_TOKENS["cpu"]
    assert JumpPolicy.for_device("auto", "cpu").always
    assert JumpPolicy.for_device("auto", "cuda").min_tokens == AUTO_MIN_TOKENS["cuda"]
    assert not JumpPolicy.for_device("auto", "cuda").always
    assert JumpPolicy.for_device("auto", "rocm").min_tokens == AUTO_MIN_TOKENS["cuda"]  # other accelerators: CUDA's
    assert JumpPolicy.for_device("5", "cuda").min_tokens == 5
    with pytest.raises(ValueError, match="jump_forward_min_tokens"):
        ConstrainedDecoding(None, VOCAB.size, VOCAB.eos_token_ids, jump_forward_min_tokens="many")
    cd = ConstrainedDecoding(None, VOCAB.size, VOCAB.eos_token_ids, device="cuda")
    assert cd.policy.min_tokens == AUTO_MIN_TOKENS["cuda"]
    cd.jump_forward_min_tokens = 2  # changed live (the benchmark does)
    assert cd.policy.min_tokens == 2


# --- ConstrainedDecoding over the real scheduler -----------------------------------------------

LONG = r"[a-c]:qrstuvwxyz[0-9]"  # after the first letter, 11 forced one-byte tokens
SHORT = r"[a-c]:q[0-9]"  # 2 forced tokens
ENDS = r"[a-c]:qrs"  # the forced text completes the grammar
PATTERNS = [LONG, SHORT, ENDS, r"[a-c]{1,3}-(yes|no)-zz[0-9]{1,2}", r"ip 10\.[0-9]\.0\.[0-9]"]


class _Tok:
    def decode(self, ids: list[int], **kw: Any) -> str:
        return VOCAB.decode(ids).decode("utf-8", errors="replace")


@dataclass
class _State:
    """The duck-typed engine request state (EngineCore's `ReqState`)."""

    req: Any
    sreq: Req
    detok: IncrementalDetokenizer
    out: OutputText
    grammar: ReqGrammar | None
    seed: int
    sent_tokens: int = 0
    rollback_tokens: int = 0
    finished: bool = False
    sampled: int = 0
    reason: dict[str, Any] | None = field(default=None)


class _Loop:
    """EngineCore's step, reduced: schedule, commit, sample (a seeded pick among the tokens the
    guide allows; "a" for unconstrained rows), advance the grammar (may jump), finish."""

    def __init__(self, min_tokens: int | str, jump: bool = True, max_running: int = 8) -> None:
        self.cd = ConstrainedDecoding(None, VOCAB.size, VOCAB.eos_token_ids, jump_forward_min_tokens=min_tokens)
        self.cd.backend = GrammarBackend(None, VOCAB.size, VOCAB.eos_token_ids, vocab=VOCAB, encode=_longest_match,
                                         compile_workers=0)
        self.cd.jump_forward = jump
        self.sched = Scheduler(KVManager(4096), max_running_requests=max_running)
        self.states: list[_State] = []
        self.rounds = 0
        self.extend_rounds = 0

    def add(self, rid: str, pattern: str | None, seed: int, max_new: int = 40, stop: list[str] | None = None) -> _State:
        p = SamplingParams(stop=stop or [])
        prompt = _longest_match(f"q{rid}:")
        sreq = Req(rid, prompt, p, max_new, arrival=len(self.states) + 1)
        grammar = None
        if pattern is not None:
            grammar = self.cd.make_grammar(self.cd.backend.compile(cfsm_key(pattern)))
        s = _State(SimpleNamespace(rid=rid), sreq, IncrementalDetokenizer(_Tok(), prompt), OutputText(p.stop, []),
                   grammar, seed)
        self.states.append(s)
        if grammar is not None:
            s.reason = self.cd.advance_jump(self.sched, s)  # at admission, as EngineCore does
        if s.reason is not None:
            s.finished = True
        else:
            self.sched.add(sreq)
        return s

    def _sample(self, s: _State) -> int:
        if s.grammar is None:
            return TOKEN[b"a"]
        allowed = [int(t) for t in s.grammar.guide.allowed_token_ids() if len(VOCAB.tokens[t]) == 1]
        # NOTE: one-byte tokens, keyed by the text so far: a run that appends forced text at once
        # makes its free choices at the same texts, so it must write the same text
        return random.Random(f"{s.seed}:{_text(s)}").choice(sorted(allowed))

    def run(self) -> None:
        by_rid = {s.sreq.rid: s for s in self.states}
        for _ in range(500):
            d = self.cd.schedule(self.sched)
            if d.mode == "idle":
                break
            self.rounds += 1
            self.extend_rounds += d.mode == "extend"
            sampling = [by_rid[i.rid] for i in d.items
                        if i.prefix_len + len(i.token_ids) == by_rid[i.rid].sreq.fill_len]
            self.sched.commit(d)
            for s in sampling:
                tok = self._sample(s)
                s.sampled += 1
                s.sreq.output_ids.append(tok)
                reason = None
                matched = s.out.append(s.detok.add(tok))
                if matched is not None:
                    reason = {"type": "stop", "matched": matched}
                if reason is None and s.grammar is not None:
                    before = s.grammar.jump_forward_tokens
                    reason = self.cd.after_token(self.sched, s, tok)
                    assert s.grammar.jump_forward_tokens >= before  # a running total, never taken back
                if reason is None and len(s.sreq.output_ids) >= s.sreq.max_new_tokens:
                    reason = {"type": "length"}
                if reason is not None:
                    s.out.append(s.detok.flush(), check_stop=False)
                    self.sched.finish(s.sreq, reason)
                    s.finished, s.reason = True, reason
        assert all(s.finished for s in self.states)
        self.sched.check_memory_invariant()


def cfsm_key(pattern: str) -> Any:
    from lmserver.engine.constrained import GrammarKey

    return GrammarKey("regex", pattern)


def _sampled(loop: _Loop, s: _State, tok: int) -> dict[str, Any] | None:
    """What the engine does with a sampled token of a constrained request."""
    s.sreq.output_ids.append(tok)
    s.out.append(s.detok.add(tok))
    return loop.cd.after_token(loop.sched, s, tok)


def _text(s: _State) -> str:
    return VOCAB.decode(s.sreq.output_ids).decode()


def test_long_jump_waits_for_schedule_and_is_made() -> None:
    loop = _Loop(8)
    s = loop.add("r", LONG, seed=0)
    d = loop.cd.schedule(loop.sched)
    loop.sched.commit(d)
    assert _sampled(loop, s, TOKEN[b"b"]) is None
    assert s.sreq.output_ids == [TOKEN[b"b"]] and "r" in loop.cd._deferred  # not yet
    d = loop.cd.schedule(loop.sched)
    assert d.mode == "extend" and VOCAB.decode(d.items[0].token_ids).endswith(b":qrstuvwxyz")
    assert s.grammar is not None and s.grammar.jump_forward_tokens == 11
    assert loop.cd.stats["jump_forward_tokens"] == 11 and s.out.text == "b:qrstuvwxyz"


def test_short_jump_is_declined_alone_and_rides_along_with_a_prefill() -> None:
    loop = _Loop(8)
    s = loop.add("r", SHORT, seed=0)
    loop.sched.commit(loop.cd.schedule(loop.sched))
    _sampled(loop, s, TOKEN[b"a"])
    d = loop.cd.schedule(loop.sched)
    assert d.mode == "decode" and s.sreq.output_ids == [TOKEN[b"a"]]
    assert loop.cd.stats["jump_forward_declined"] == 1
    loop.sched.commit(d)
    s.sreq.output_ids.append(TOKEN[b":"])  # the model writes the forced text itself
    loop.cd.after_token(loop.sched, s, TOKEN[b":"])
    loop.add("new", None, seed=1)  # a prefill is coming anyway: the jump rides along
    d = loop.cd.schedule(loop.sched)
    assert d.mode == "extend" and {i.rid for i in d.items} == {"r", "new"}
    assert _text(s) == "a:q" and loop.cd.stats["jump_forward_tokens"] == 1


def test_jump_that_completes_the_grammar_is_made_at_once() -> None:
    loop = _Loop(8)
    s = loop.add("r", ENDS, seed=0)
    loop.sched.commit(loop.cd.schedule(loop.sched))
    assert _sampled(loop, s, TOKEN[b"c"]) == {"type": "stop", "matched": None}
    assert _text(s) == "c:qrs" and not loop.cd._deferred


def test_requests_with_stop_strings_decide_at_once() -> None:
    loop = _Loop(8)
    short = loop.add("s", SHORT, seed=0, stop=["zz"])
    long = loop.add("l", LONG, seed=0, stop=["zz"])
    loop.sched.commit(loop.cd.schedule(loop.sched))
    for s in (short, long):
        _sampled(loop, s, TOKEN[b"a"])
    assert not loop.cd._deferred
    assert short.sreq.output_ids == [TOKEN[b"a"]] and _text(long) == "a:qrstuvwxyz"


def test_deferred_jump_of_a_finished_or_aborted_request_is_dropped() -> None:
    loop = _Loop(8)
    s = loop.add("r", LONG, seed=0)
    t = loop.add("t", LONG, seed=0)
    loop.sched.commit(loop.cd.schedule(loop.sched))
    for x in (s, t):
        _sampled(loop, x, TOKEN[b"a"])
    assert set(loop.cd._deferred) == {"r", "t"}
    loop.sched.finish(s.sreq, {"type": "length"})
    loop.sched.abort("t")
    d = loop.cd.schedule(loop.sched)
    assert d.mode == "idle" and loop.cd.stats["jump_forward_tokens"] == 0 and not loop.cd._deferred


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([*PATTERNS, None]), st.integers(0, 99)), min_size=1, max_size=6),
       st.sampled_from([1, 2, 4, 8, 100]))
def test_policy_changes_when_text_is_appended_never_what(reqs: list[tuple[str | None, int]], m: int) -> None:
    runs = {}
    for key in ("off", m):
        loop = _Loop(m if key != "off" else 1, jump=key != "off")
        states = [loop.add(f"r{i}", pat, seed) for i, (pat, seed) in enumerate(reqs)]
        loop.run()
        runs[key] = (loop, states)
        for (pat, _), s in zip(reqs, states, strict=True):
            text = _text(s)
            if pat is not None:
                assert regex.fullmatch(pat, text), (pat, text)
                assert s.grammar is not None
                # metadata: every output token not sampled was added by jump-forward
                assert s.grammar.jump_forward_tokens == len(s.sreq.output_ids) - s.sampled
            assert s.out.text == text
    loop_on, on = runs[m]
    loop_off, off = runs["off"]
    assert [_text(s) for s in on] == [_text(s) for s in off]
    assert loop_on.rounds <= loop_off.rounds  # jumping never needs more rounds than decoding
    if m == 100:  # no jump pays its own round: only those at admission or ending the request
        assert all(s.grammar is None or s.grammar.num_jumps <= 2 for s in on)


def test_min_tokens_one_is_the_unconditional_jump() -> None:
    loop = _Loop(1)
    s = loop.add("r", SHORT, seed=3)
    loop.run()
    assert s.grammar is not None and s.grammar.jump_forward_tokens == 2 and loop.cd.stats["jump_forward_declined"] == 0
    assert regex.fullmatch(SHORT, _text(s))


def test_guide_state_never_desyncs_under_deferral() -> None:
    loop = _Loop(4)
    states = [loop.add(f"r{i}", PATTERNS[i % len(PATTERNS)], i) for i in range(10)]
    loop.run()
    for s in states:
        assert s.grammar is not None and s.grammar.guide.num_tokens == len(s.sreq.output_ids)
        assert s.sreq.status == ReqStatus.FINISHED
    assert loop.cd.stats["jump_forward_declined"] > 0 and loop.cd.stats["jump_forward_steps"] > 0


def test_index_cache_is_shared() -> None:
    loop = _Loop(2)
    a = loop.cd.backend.compile(cfsm_key(LONG))
    assert isinstance(a, cfsm.Index) and loop.cd.backend.compile(cfsm_key(LONG)) is a


def _count_plans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the output length at every ReqGrammar.plan_jump call (the call itself unchanged)."""
    plans: list[int] = []
    real = ReqGrammar.plan_jump

    def counting(self: ReqGrammar, output_ids: Any, max_new: int) -> Any:
        plans.append(len(output_ids))
        return real(self, output_ids, max_new)

    monkeypatch.setattr(ReqGrammar, "plan_jump", counting)
    return plans


def test_declined_forced_text_is_not_retokenized_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = _Loop(100)
    s = loop.add("r", LONG, seed=0)
    plans = _count_plans(monkeypatch)
    loop.sched.commit(loop.cd.schedule(loop.sched))
    _sampled(loop, s, TOKEN[b"a"])
    assert plans == [1] and loop.cd._deferred["r"][2] == 11  # planned once, deferred
    for tok in (b":", b"q", b"r"):  # declined: the model writes the forced text itself
        loop.sched.commit(loop.cd.schedule(loop.sched))
        _sampled(loop, s, TOKEN[tok])
    assert plans == [1] and loop.cd._deferred["r"][1] is None and loop.cd._deferred["r"][2] == 8  # estimated
    loop.add("new", None, seed=1)  # a prefill comes: the rest rides along, planned now
    d = loop.cd.schedule(loop.sched)
    assert plans == [1, 4] and d.mode == "extend"
    assert _text(s) == "a:qrstuvwxyz" and s.grammar is not None and s.grammar.jump_forward_tokens == 8
    assert s.grammar.declined is None


def test_same_forced_text_is_planned_once_across_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = _Loop(100)
    reqs = [loop.add(f"r{i}", LONG, seed=0) for i in range(3)]
    plans = _count_plans(monkeypatch)
    loop.sched.commit(loop.cd.schedule(loop.sched))
    for s in reqs:
        _sampled(loop, s, TOKEN[b"b"])
    assert plans == [1] and [loop.cd._deferred[s.sreq.rid][2] for s in reqs] == [11, 11, 11]
    loop.cd.jump_forward_min_tokens = 4  # 33 > 3 * 3: made, each planned in its own context now
    d = loop.cd.schedule(loop.sched)
    assert d.mode == "extend" and plans == [1, 1, 1] and all(_text(s) == "b:qrstuvwxyz" for s in reqs)


def test_slo_credit_that_cannot_pay_keeps_jumps_out_of_the_deferred_set() -> None:
    """With the SLO admission's credit short of an extend round, a running request's jump is not
    deferred (a deferred jump stops the overlap chain; declined anyway, it was deferred again at
    every forced token): the text is written token by token. With credit, the jump waits for
    `schedule()` and is made, as without the admission. The text is the same either way."""
    from lmserver.scheduler.admission import AdmissionConfig, StepBudget

    texts = []
    for credit in (-1.0, 1.0):
        loop = _Loop(8)
        budget = StepBudget(AdmissionConfig(target_s=0.005))
        budget.observe(1, 0, 0.004)  # a decode step measured: a prefill step is predicted
        budget.credit = credit
        loop.sched.admission = budget
        s = loop.add("r", LONG, seed=0)
        loop.sched.commit(loop.cd.schedule(loop.sched))
        assert _sampled(loop, s, TOKEN[b"b"]) is None
        if credit < 0:
            assert not loop.cd._deferred and s.grammar is not None and s.grammar.jump_forward_tokens == 0
            for _ in range(3):  # the forced text, one token a step, never deferred
                d = loop.cd.schedule(loop.sched)
                assert d.mode == "decode"
                loop.sched.commit(d)
                _sampled(loop, s, loop._sample(s))
                assert not loop.cd._deferred
        else:
            assert "r" in loop.cd._deferred
        loop.run()  # with credit: the deferred jump is made at the next schedule
        assert s.grammar is not None and s.grammar.jump_forward_tokens == (0 if credit < 0 else 11)
        texts.append(_text(s))
    assert texts[0] == texts[1]
