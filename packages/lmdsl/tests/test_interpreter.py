"""The primitives and ProgramState against MockBackend: text, variables, roles, fork/join, streaming, batches, errors."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest

import lmdsl as sgl
from lmdsl.backend.base import Prompt
from lmdsl.ir import REGEX_INT, SamplingParams
from lmdsl.testing import MockBackend


def test_gen_appends_text_and_sets_variables() -> None:
    backend = MockBackend({"Name:": " Alice\nAge: 3", "Age:": " 30\nJob: x"})

    @sgl.function
    def card(s, who):
        s += "Describe " + who + ".\n"
        s += "Name:" + sgl.gen("name", stop="\n") + "\nAge:" + sgl.gen("age", stop="\n")

    state = card.run(who="Alice", backend=backend)
    assert state.error() is None
    assert state["name"] == " Alice"
    assert state["age"] == " 30"
    assert state.text() == "Describe Alice.\nName: Alice\nAge: 30"
    prompts = [c.prompt.text for c in backend.calls_of("generate")]
    assert prompts == ["Describe Alice.\nName:", "Describe Alice.\nName: Alice\nAge:"]
    meta = state.get_meta_info("age")
    assert meta["completion_tokens"] == 1 and meta["finish_reason"] == {"type": "stop"}
    assert state.usage() == sgl.Usage(num_api_calls=2, prompt_tokens=3 + 5, completion_tokens=2)


def test_run_sampling_defaults_are_overridden_per_gen() -> None:
    backend = MockBackend(default="a b c d e f")

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a") + sgl.gen("b", max_tokens=2, temperature=0.7)

    state = prog.run(backend=backend, temperature=0.0, max_new_tokens=4, top_p=0.5)
    first, second = (c.params for c in backend.calls_of("generate"))
    assert (first.temperature, first.max_new_tokens, first.top_p) == (0.0, 4, 0.5)
    assert (second.temperature, second.max_new_tokens, second.top_p) == (0.7, 2, 0.5)
    assert state["a"] == "a b c d" and state["b"] == "a b"
    assert second.to_native() == {
        "max_new_tokens": 2, "min_new_tokens": 0, "n": 1, "temperature": 0.7, "top_p": 0.5, "top_k": -1,
        "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False,
    }


def test_constraints_reach_the_backend_and_are_validated() -> None:
    backend = MockBackend({"n=": "42", "j=": '{"a": 1}', "s=": '"hi"'})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    @sgl.function
    def prog(s):
        s += "n=" + sgl.gen_int("n")
        s += " s=" + sgl.gen_string("s")
        s += " j=" + sgl.gen("j", json_schema=schema)
        s += " r=" + sgl.gen("r", regex=r"(yes|no)")
        s += " e=" + sgl.gen("e", ebnf='root ::= "[" (root ("," root)*)? "]"')

    state = prog.run(backend=backend)
    calls = backend.calls_of("generate")
    assert calls[0].params.to_native()["regex"] == REGEX_INT and re.fullmatch(REGEX_INT, state["n"])
    assert re.fullmatch(calls[1].params.constraint_regex(), state["s"])
    assert json.loads(calls[2].params.to_native()["json_schema"]) == schema
    assert calls[3].params.to_native()["regex"] == "(yes|no)"
    assert calls[4].params.to_native()["ebnf"] == 'root ::= "[" (root ("," root)*)? "]"'
    with pytest.raises(ValueError, match="at most one"):
        sgl.gen("x", regex="a", dtype=int)
    with pytest.raises(ValueError, match="at most one"):
        sgl.gen("x", ebnf="root ::= 'a'", json_schema={})
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=list)


def test_n_greater_than_one_gives_a_list() -> None:
    backend = MockBackend({"Q:": [" a", " b", " c"]})

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("x", n=3)

    state = prog.run(backend=backend)
    assert state["x"] == [" a", " b", " c"]
    assert state.text() == "Q: a"


def test_chat_roles_render_with_chatml_for_smollm_and_build_messages() -> None:
    backend = MockBackend({"assistant\n": "Paris"}, model_name="/models/SmolLM2-135M-Instruct")
    assert backend.get_chat_template().name == "chatml"

    @sgl.function
    def chat(s, question):
        s += sgl.system("Be brief.")
        with s.user():
            s += question
        s += sgl.assistant(sgl.gen("answer", max_tokens=8))
        s += sgl.user_begin() + "Thanks" + sgl.user_end()

    state = chat.run(question="Capital of France?", backend=backend)
    assert state.text() == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
    )
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "Thanks"},
    ]
    prompt = backend.calls_of("generate")[0].prompt
    assert prompt.open_role == "assistant" and prompt.messages[-1] == {"role": "assistant", "content": ""}


def test_template_default_system_prompt_and_model_name_matching() -> None:
    assert sgl.get_chat_template_by_model_path("meta-llama/Meta-Llama-3-8B-Instruct").name == "llama-3-instruct"
    assert sgl.get_chat_template_by_model_path("Qwen/Qwen2-7B-Instruct").name == "qwen"
    assert sgl.get_chat_template_by_model_path("mistralai/Mistral-7B-Instruct-v0.3").name == "mistral"
    assert sgl.get_chat_template_by_model_path("something-else").name == "default"
    backend = MockBackend(model_name="Qwen2-0.5B")

    @sgl.function
    def prog(s):
        s += sgl.user("hi")

    assert prog.run(backend=backend).text() == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    with pytest.raises(sgl.ChatTemplateError, match="unknown chat template"):
        sgl.get_chat_template("nope")


def test_nested_roles_are_recorded_errors_and_role_bodies_hold_primitives() -> None:
    backend = MockBackend({"user\nPick:": " x"}, model_name="SmolLM2")

    @sgl.function
    def ok(s):
        s += sgl.user("Pick:" + sgl.gen("g", max_tokens=2) + " then " + sgl.select("c", ["red", "blue"]))

    state = ok.run(backend=backend)
    assert state.messages() == [{"role": "user", "content": "Pick: x then red"}]

    @sgl.function
    def nested(s):
        with s.user():
            s += "a"
            with s.assistant():
                s += sgl.gen("never")

    state = nested.run(backend=backend)
    assert isinstance(state.error(), sgl.ProgramError)
    assert isinstance(state.error().__cause__, sgl.ChatTemplateError)
    with pytest.raises(sgl.ProgramError, match="inside the open 'user' turn"):
        state["never"]


def test_primitives_do_not_block_the_program() -> None:
    release = threading.Event()

    def respond(prompt: Prompt, params: SamplingParams) -> str:
        assert release.wait(10)
        return " done"

    backend = MockBackend(respond=respond)
    seen = []

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("x")
        seen.append("after gen")  # reached while the backend call is still blocked
        release.set()
        seen.append(s["x"])

    prog.run(backend=backend)
    assert seen == ["after gen", " done"]


def test_fork_join_gathers_variables_and_sends_a_prefix_hint() -> None:
    arrived = threading.Barrier(3, timeout=10)

    def respond(prompt: Prompt, params: SamplingParams) -> str:
        arrived.wait()  # all three branches are in the backend at once
        return " tip for " + prompt.text.rsplit("#", 1)[1].split(":")[0]

    backend = MockBackend(respond=respond)

    @sgl.function
    def tips(s):
        s += "Tips:\n"
        forks = s.fork(3)
        forks += lambda i: f"#{i}:"
        forks += sgl.gen("tip", stop="\n")
        forks += [" a", " b", " c"]
        forks.join()
        s += "Summary."

    state = tips.run(backend=backend)
    assert state.error() is None
    assert state["tip"] == [" tip for 0", " tip for 1", " tip for 2"]
    assert state.text() == "Tips:\nSummary."
    assert [c.prompt.text for c in backend.calls_of("cache_prefix")] == ["Tips:\n"]


def test_fork_join_concate_and_append() -> None:
    backend = MockBackend()

    @sgl.function
    def prog(s):
        s += "P."
        forks = s.fork(2)
        forks += [" one", " two"]
        forks.join("concate_and_append")
        s += " end"

    state = prog.run(backend=backend)
    assert state.text() == "P. one two end"
    assert backend.calls_of("concatenate")[0].result == ["P. one", "P. two"]
    with pytest.raises(ValueError, match="join"):
        state.fork(2).join("bogus")


def test_var_scope_and_set_var() -> None:
    backend = MockBackend({"A:": " 1"})

    @sgl.function
    def prog(s):
        with s.var_scope("block"):
            s += "A:" + sgl.gen("a")
        s["manual"] = 5
        s += " tail"

    state = prog.run(backend=backend)
    assert state["block"] == "A: 1"
    assert state["manual"] == 5
    assert "a" in state and "missing" not in state
    with pytest.raises(KeyError, match="no variable 'missing'"):
        state["missing"]


def test_streaming_yields_chunks_in_program_order() -> None:
    backend = MockBackend({"Q1:": " one two three", "Q2:": " four five"}, delay_s=0.001)

    @sgl.function
    def prog(s):
        s += "Q1:" + sgl.gen("a") + " Q2:" + sgl.gen("b")

    state = prog.run(backend=backend, stream=True)
    chunks = list(state.text_iter())
    assert "".join(chunks) == "Q1: one two three Q2: four five" == state.text()
    assert chunks[:4] == ["Q1:", " one", " two", " three"]
    state = prog.run(backend=backend, stream=True)
    assert list(state.text_iter("b")) == [" four", " five"]

    async def collect() -> list[str]:
        state = prog.run(backend=backend, stream=True)
        return [c async for c in state.text_async_iter("a")]

    assert asyncio.run(collect()) == [" one", " two", " three"]


def test_run_batch_keeps_order_and_hints_the_constant_prefix() -> None:
    backend = MockBackend(respond=lambda p, _: " " + p.text.split()[-2].upper())

    @sgl.function
    def shout(s, word):
        s += "Shout the word. Word: " + word
        s += " ->" + sgl.gen("out", max_tokens=3)

    words = ["a", "b", "c", "d", "e"]
    with pytest.raises(sgl.NoBackendError, match="set_default_backend"):
        shout.run_batch([{"word": w} for w in words])
    states = shout.run_batch([{"word": w} for w in words], backend=backend, num_threads=3)
    assert [s["out"] for s in states] == [" " + w.upper() for w in words]
    assert [c.prompt.text for c in backend.calls_of("cache_prefix")] == ["Shout the word. Word: "]
    gen_states = shout.run_batch([{"word": "z"}], backend=backend, generator_style=True)
    assert [s.text() for s in gen_states] == ["Shout the word. Word: z -> Z"]


class _NoHintsWanted(MockBackend):
    @property
    def wants_prefix_hints(self) -> bool:
        return False


@pytest.mark.parametrize(("wanted", "mode", "forks", "batch"), [
    (True, "auto", True, True), (False, "auto", False, True), (False, "always", True, True), (True, "never", False, False),
])
def test_prefix_hints_follow_the_config_and_the_backend(wanted: bool, mode: str, forks: bool, batch: bool) -> None:
    """Fork hints: "auto" sends them where the backend wants them, "always" and "never" override;
    run_batch's one constant-prefix hint: unless "never"; an explicit `cache()` is always sent."""
    backend = (MockBackend if wanted else _NoHintsWanted)(respond=lambda p, _: " ok")

    @sgl.function
    def prog(s, word):
        s += "Constant prefix. " + word
        forks = s.fork(2)
        forks += sgl.gen("x", max_tokens=2)
        forks.join()

    # NOTE: hints waited for, so a hint cannot be dropped as still queued when its (instant) program ends
    prog.config = prog.config.with_(prefix_hints=mode, wait_for_prefix_hints=True)
    states = prog.run_batch([{"word": "a"}, {"word": "b"}], backend=backend)
    assert all(st.error() is None for st in states)
    hints = [c.prompt.text for c in backend.calls_of("cache_prefix")]
    assert sorted(hints) == sorted(["Constant prefix. "] * batch + ["Constant prefix. a", "Constant prefix. b"] * forks)
    assert len(backend.calls_of("generate")) == 4
    prog.cache(backend)
    assert len(backend.calls_of("cache_prefix")) == len(hints) + 1
    with pytest.raises(ValueError, match="prefix_hints"):
        prog.config.with_(prefix_hints="sometimes")


def test_backend_failure_is_recorded_with_its_cause_and_raised_on_read() -> None:
    boom = ConnectionError("endpoint down")
    backend = MockBackend({"A:": " fine", "B:": boom})

    @sgl.function
    def prog(s):
        s += "A:" + sgl.gen("a") + " B:" + sgl.gen("b") + " C:" + sgl.gen("c")

    state = prog.run(backend=backend)
    error = state.error()
    assert isinstance(error, sgl.ProgramError) and error.__cause__ is boom
    assert "gen 'b'" in str(error) and "endpoint down" in str(error)
    assert state["a"] == " fine"
    for name in ("b", "c"):
        with pytest.raises(sgl.ProgramError) as info:
            state[name]
        assert info.value is error
    assert len(backend.calls_of("generate")) == 2  # nothing runs after the failure
    assert state.text() == "A: fine B:"


def test_fork_failure_reaches_the_parent() -> None:
    backend = MockBackend({"#1": ValueError("bad branch")})

    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks += lambda i: f"#{i}" + sgl.gen("x")
        forks.join()

    state = prog.run(backend=backend)
    assert isinstance(state.error().__cause__, ValueError)
    with pytest.raises(sgl.ProgramError):
        state["x"]


def test_program_body_exceptions_propagate_and_bad_input_is_typed() -> None:
    @sgl.function
    def bad(s):
        s += object()

    with pytest.raises(TypeError, match="cannot add a object"):
        bad.run(backend=MockBackend())

    @sgl.function
    def raises_in_stream(s):
        s += "x"
        raise RuntimeError("user bug")

    state = raises_in_stream.run(backend=MockBackend(), stream=True)
    with pytest.raises(sgl.ProgramError, match="user bug"):
        list(state.text_iter())
    with pytest.raises(TypeError, match="unexpected keyword"):
        raises_in_stream.run(backend=MockBackend(), nope=1)
    with pytest.raises(ValueError, match="non-empty"):
        sgl.select("x", [])


def test_default_backend_bind_and_context_scoping() -> None:
    backend = MockBackend({"Hi ": "there"})

    @sgl.function
    def greet(s, name, punct):
        s += "Hi " + sgl.gen("w", max_tokens=1) + " " + name + punct

    bound = greet.bind(punct="!")
    with sgl.use_backend(backend):
        assert sgl.get_default_backend() is backend
        assert bound.run(name="Bo").text() == "Hi there Bo!"
        states = bound.run_batch([{"name": "A"}, {"name": "B"}])
        assert [s.text() for s in states] == ["Hi there A!", "Hi there B!"]
    assert sgl.get_default_backend() is None
    with pytest.raises(sgl.NoBackendError):
        bound.run(name="x")
    with pytest.raises(TypeError, match="unknown arguments"):
        greet.bind(nope=1)


def test_image_in_a_user_turn_becomes_a_content_part() -> None:
    backend = MockBackend(model_name="SmolLM2")

    @sgl.function
    def prog(s, path):
        s += sgl.user("Look: " + sgl.image(path) + " what is it?")

    state = prog.run(path="cat.png", backend=backend)
    assert state.text() == "<|im_start|>user\nLook: <image> what is it?<|im_end|>\n"
    assert state.messages() == [{"role": "user", "content": [
        {"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": "cat.png"}},
        {"type": "text", "text": " what is it?"}]}]
    assert backend.calls_of("end")[0].prompt.images == ("cat.png",)


def test_calling_a_function_runs_it_or_inlines_it() -> None:
    backend = MockBackend({"Q:": " A"})

    @sgl.function
    def inner(s, q):
        s += q + sgl.gen("a", max_tokens=1)

    @sgl.function
    def outer(s):
        s += "Start. "
        inner(s, "Q:")
        s += " End."

    assert outer(backend=backend).text() == "Start. Q: A End."
    assert inner("Q:", backend=backend)["a"] == " A"
    assert str(outer.trace()).splitlines()[1:] == ["  const 'Start. '", "  const 'Q:'", "  gen 'a' (max_new_tokens=1)",
                                                   "  const ' End.'"]


def test_run_batch_shares_one_executor_pool() -> None:
    backend = MockBackend(default=" x")

    @sgl.function
    def one(s, i):
        s += str(i) + sgl.gen("a", max_tokens=1)

    states = one.run_batch([{"i": i} for i in range(40)], backend=backend, num_threads=4)
    pools = {id(s.stream_executor.pool) for s in states}
    assert len(pools) == 1 and [s["a"] for s in states] == [" x"] * 40


def test_chat_speculation_guards() -> None:
    backend = MockBackend({"": "A: 1\nB: 2"}, is_chat_model=True)

    @sgl.function(num_api_spec_tokens=16)
    def early_read(s):
        with s.assistant():
            s += "A:" + sgl.gen("a", stop="\n")
            s["a"]

    with pytest.raises(sgl.SpeculationError, match="after the turn ends"):
        early_read.run(backend=backend)

    @sgl.function(num_api_spec_tokens=16)
    def with_select(s):
        s += sgl.assistant("A:" + sgl.gen("a", stop="\n") + sgl.select("b", ["x", "y"]))

    state = with_select.run(backend=backend)
    assert isinstance(state.error().__cause__, sgl.SpeculationError)

    @sgl.function(num_api_spec_tokens=16)
    def good(s):
        s += sgl.assistant("A:" + sgl.gen("a", stop="\n") + "\nB:" + sgl.gen("b"))

    state = good.run(backend=backend)
    assert (state["a"], state["b"]) == (" 1", " 2")
    assert len(backend.calls_of("generate")) == 1


@pytest.mark.parametrize("wait_for_hints", [False, True])
def test_fork_waits_for_its_prefix_hint_only_when_configured(wait_for_hints: bool) -> None:
    """Default: the children run while the hint is in flight (the hint answers only once a child's
    request has arrived); `wait_for_prefix_hints=True` (SGLang's interpreter): no child runs before
    the hint is answered. Either way the program ends after the hint."""
    hint_started = threading.Event()
    child_arrived = threading.Event()
    seen: list[bool] = []

    class SlowHintBackend(MockBackend):
        def cache_prefix(self, prefix_str: str) -> None:
            hint_started.set()
            # Waiting mode: no child can arrive, so a short wait suffices; otherwise a child
            # arrives as soon as it runs (long timeout: robust on a busy machine).
            seen.append(child_arrived.wait(timeout=0.5 if wait_for_hints else 30))
            super().cache_prefix(prefix_str)

    def respond(prompt: Prompt, params: SamplingParams) -> str:
        # A hint not yet started when its program ends is dropped by design; holding the
        # children until it starts keeps the test about ordering, not about thread start-up.
        hint_started.wait(timeout=30)
        child_arrived.set()
        return " ok"

    backend = SlowHintBackend(respond=respond)

    def two(s):  # type: ignore[no-untyped-def]
        s += "Q: "
        forks = s.fork(2)
        forks += sgl.gen("a", max_tokens=2)
        forks.join()

    program = sgl.function(two)
    program.config = program.config.with_(wait_for_prefix_hints=wait_for_hints)
    state = program.run(backend=backend)
    assert state.error() is None
    assert state["a"] == [" ok", " ok"]
    assert seen == [not wait_for_hints]
    kinds = [c.kind for c in backend.calls]
    assert kinds.index("cache_prefix") < kinds.index("end")


def test_program_end_drops_queued_hints_and_waits_for_running_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hint still queued when its program ends is never sent; one in flight is waited for."""
    from concurrent.futures import ThreadPoolExecutor

    from lmdsl.interpreter import PrefixHints

    release = threading.Event()
    started = threading.Event()
    sent: list[str] = []

    class SlowBackend(MockBackend):
        def cache_prefix(self, prefix_str: str) -> None:
            started.set()
            release.wait(timeout=5)
            sent.append(prefix_str)

    pool = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(PrefixHints, "_pool", pool)
    backend = SlowBackend(respond=lambda prompt, params: " ok")
    hints = PrefixHints()
    hints.send(backend, Prompt(text="first"))
    assert started.wait(timeout=5)
    hints.send(backend, Prompt(text="second"))  # queued behind the first: the pool has one worker
    threading.Timer(0.2, release.set).start()
    hints.wait()
    assert sent == ["first"]  # the running hint finished before wait() returned; the queued one was dropped
    pool.shutdown(wait=True)
    assert sent == ["first"]
