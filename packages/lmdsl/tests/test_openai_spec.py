"""The OpenAI backend and API speculative execution, driven by the real `openai` client against a
local fake OpenAI-compatible server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import lmdsl as sgl
from lmdsl.backend.openai_backend import OpenAI
from lmdsl.testing.fake_lm import TranscriptLM
from lmdsl.testing.fake_openai import CharTokenizer, FakeOpenAIServer
from lmdsl.testing.mock import mock_tokens

PREAMBLE = "Fill the card of a famous person.\n"
FOLLOWS = PREAMBLE + "Name: Alice\nBirthday: May 4\nJob: engineer\n"
DIVERGES = PREAMBLE + "Name: Alice\nAge: 30\nJob: engineer\n"


def card_body(s):
    s += PREAMBLE
    s += "Name:" + sgl.gen("name", max_tokens=16, stop="\n")
    s += "\nBirthday:" + sgl.gen("birthday", max_tokens=16, stop="\n")
    s += "\nJob:" + sgl.gen("job", max_tokens=16, stop="\n") + "\n"


card_plain = sgl.function(card_body)
card_spec = sgl.function(num_api_spec_tokens=64)(card_body)


@pytest.fixture()
def serve() -> Iterator[object]:
    servers: list[FakeOpenAIServer] = []

    def start(lm: TranscriptLM, **kw: object) -> FakeOpenAIServer:
        servers.append(FakeOpenAIServer(lm, **kw).start())  # type: ignore[arg-type]
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def completion_backend(server: FakeOpenAIServer, **kw: object) -> OpenAI:
    return OpenAI("gpt-3.5-turbo-instruct", base_url=server.url + "/v1", api_key="k", max_retries=0, **kw)


def chat_backend(server: FakeOpenAIServer, **kw: object) -> OpenAI:
    return OpenAI("gpt-4o-mini", base_url=server.url + "/v1", api_key="k", max_retries=0, **kw)


def test_speculative_run_matches_plain_with_fewer_calls_and_prompt_tokens(serve) -> None:
    server = serve(TranscriptLM(FOLLOWS, fallback=" unknown\n"))
    backend = completion_backend(server)
    assert backend.is_chat_model is False
    plain = card_plain.run(backend=backend, temperature=0)
    plain_requests = server.requests_to("/v1/completions")
    spec = card_spec.run(backend=backend, temperature=0)
    spec_requests = server.requests_to("/v1/completions")[len(plain_requests):]
    names = ("name", "birthday", "job")
    assert [plain[n] for n in names] == [" Alice", " May 4", " engineer"]
    assert [spec[n] for n in names] == [plain[n] for n in names]
    assert spec.text() == plain.text() == FOLLOWS
    # Plain: one call per gen, each resending the growing prompt. Speculative: one call.
    prompts = [PREAMBLE + "Name:", PREAMBLE + "Name: Alice\nBirthday:", PREAMBLE + "Name: Alice\nBirthday: May 4\nJob:"]
    assert [r["prompt"] for r in plain_requests] == prompts
    assert [r["prompt"] for r in spec_requests] == prompts[:1]
    assert spec_requests[0]["max_tokens"] == 64 and "stop" not in spec_requests[0]
    assert plain.usage().num_api_calls == 3 and spec.usage().num_api_calls == 1
    assert plain.usage().prompt_tokens == sum(len(mock_tokens(p)) for p in prompts)
    assert spec.usage().prompt_tokens == len(mock_tokens(prompts[0]))
    assert spec.usage().prompt_tokens < plain.usage().prompt_tokens


def test_speculation_mismatch_falls_back_to_a_correct_call(serve) -> None:
    server = serve(TranscriptLM(DIVERGES, fallback=" unknown\n"))
    backend = completion_backend(server)
    plain = card_plain.run(backend=backend, temperature=0)
    spec = card_spec.run(backend=backend, temperature=0)
    names = ("name", "birthday", "job")
    assert [plain[n] for n in names] == [" Alice", " unknown", " engineer"]
    assert [spec[n] for n in names] == [plain[n] for n in names]
    assert spec.text() == plain.text()
    # the continuation said "Age:", the program wrote "Birthday:": the buffer is dropped and new calls made
    assert spec.usage().num_api_calls == 3
    assert spec.get_meta_info("birthday")["speculative"] is True


def test_speculation_respects_a_small_max_tokens(serve) -> None:
    server = serve(TranscriptLM(PREAMBLE + "Name: Alice Beatrice Carol Dana\nJob: x\n"))
    backend = completion_backend(server)

    @sgl.function(num_api_spec_tokens=32)
    def short(s):
        s += PREAMBLE + "Name:" + sgl.gen("name", max_tokens=2, stop="\n")

    state = short.run(backend=backend)
    assert state["name"] == " Alice Beatrice"  # an exact call, not the longer speculative text
    assert state.usage().num_api_calls == 2


def test_chat_speculation_makes_one_call_per_assistant_turn(serve) -> None:
    server = serve(TranscriptLM(""), chat=["Name: Alice\nAge: 30\n"])
    backend = chat_backend(server)

    @sgl.function(num_api_spec_tokens=64)
    def chat_card(s):
        s += sgl.system("You fill forms.")
        s += sgl.user("Describe Alice.")
        s += sgl.assistant("Name:" + sgl.gen("name", stop="\n") + "\nAge:" + sgl.gen("age", stop="\n"))

    state = chat_card.run(backend=backend)
    assert state.error() is None
    assert (state["name"], state["age"]) == (" Alice", " 30")
    assert state.messages()[-1] == {"role": "assistant", "content": "Name: Alice\nAge: 30"}
    requests = server.requests_to("/v1/chat/completions")
    assert len(requests) == 1 and state.usage().num_api_calls == 1
    assert requests[0]["messages"] == [{"role": "system", "content": "You fill forms."},
                                       {"role": "user", "content": "Describe Alice."}]
    assert requests[0]["max_tokens"] == 64


def test_chat_speculation_retries_then_reports(serve) -> None:
    @sgl.function(num_api_spec_tokens=64)
    def chat_card(s):
        s += sgl.user("Describe Bob.")
        s += sgl.assistant("Name:" + sgl.gen("name", stop="\n") + "\nAge:" + sgl.gen("age"))

    server = serve(TranscriptLM(""), chat=["Bob is 41.", "Name: Bob\nAge: 41"])
    state = chat_card.run(backend=chat_backend(server))
    assert (state["name"], state["age"]) == (" Bob", " 41")
    assert state.usage().num_api_calls == 2

    server = serve(TranscriptLM(""), chat=["I will not fill forms."])
    state = chat_card.run(backend=chat_backend(server))
    assert isinstance(state.error().__cause__, sgl.SpeculationError)
    assert len(server.requests_to("/v1/chat/completions")) == 3
    with pytest.raises(sgl.ProgramError, match="3 replies did not follow"):
        state["name"]
    state = chat_card.run(backend=chat_backend(server), temperature=0)  # greedy: one try
    assert isinstance(state.error().__cause__, sgl.SpeculationError)
    assert len(server.requests_to("/v1/chat/completions")) == 4


def test_chat_without_speculation_needs_gen_right_after_assistant(serve) -> None:
    server = serve(TranscriptLM(""), chat=["Paris."])
    backend = chat_backend(server)

    @sgl.function
    def ok(s):
        s += sgl.user("Capital of France?") + sgl.assistant(sgl.gen("a", max_tokens=8))

    @sgl.function
    def bad(s):
        s += sgl.user("Capital of France?") + sgl.assistant("It is" + sgl.gen("a", max_tokens=8))

    assert ok.run(backend=backend)["a"] == "Paris."
    with pytest.raises(sgl.ProgramError, match="num_api_spec_tokens"):
        bad.run(backend=backend)["a"]
    state = ok.run(backend=backend, stream=True)
    assert list(state.text_iter("a")) == ["Paris."]


def test_completion_select_by_echo_logprobs_and_by_logit_bias(serve) -> None:
    table = {" engineer": -0.5, " doctor": -0.2, " en": -3.0}
    lm = TranscriptLM(PREAMBLE + "Job: engineer\n", logprob=lambda ctx, tok: table.get(tok, -1.0))

    @sgl.function
    def job(s):
        s += PREAMBLE + "Job: " + sgl.select("job", ["engineer", "doctor"])

    server = serve(lm)
    state = job.run(backend=completion_backend(server))
    assert state["job"] == "doctor"  # higher echoed logprob (-0.2 > -0.5)
    assert state.get_meta_info("job")["choice_token_logprobs"] == [[-0.5], [-0.2]]
    assert server.requests_to("/v1/completions")[0]["echo"] is True

    server = serve(lm, supports_echo_logprobs=False)
    backend = completion_backend(server, tokenizer=CharTokenizer())
    state = job.run(backend=backend)
    assert state.error() is None, state.error()
    assert state["job"] == "engineer"  # the model's own continuation, token by token under logit_bias
    biased = [r for r in server.requests_to("/v1/completions") if "logit_bias" in r]
    assert biased[0]["logit_bias"] == {str(ord("e")): 100, str(ord("d")): 100}
    assert backend.select_method == "logit_bias"
    no_tokenizer = completion_backend(server, select_method="logit_bias")
    with pytest.raises(sgl.ProgramError, match="tokenizer"):
        job.run(backend=no_tokenizer)["job"]


def test_constraints_need_an_endpoint_that_accepts_them(serve, tmp_path: Path) -> None:
    server = serve(TranscriptLM(PREAMBLE + "Age: 30 years\n"), chat=["dark red, surely"])

    @sgl.function
    def age(s):
        s += PREAMBLE + "Age:" + sgl.gen("age", regex=r" [0-9]+", max_tokens=8)

    state = age.run(backend=completion_backend(server))
    assert isinstance(state.error().__cause__, sgl.ConstraintNotSupportedError)
    assert "constrained_decoding=True" in str(state.error())
    state = age.run(backend=completion_backend(server, constrained_decoding=True))
    assert state["age"] == " 30"
    assert server.requests_to("/v1/completions")[-1]["regex"] == r" [0-9]+"

    @sgl.function
    def age_ebnf(s):
        s += PREAMBLE + "Age:" + sgl.gen("age", ebnf='root ::= " " [0-9]+', max_tokens=8)

    state = age_ebnf.run(backend=completion_backend(server))
    assert isinstance(state.error().__cause__, sgl.ConstraintNotSupportedError)
    age_ebnf.run(backend=completion_backend(server, constrained_decoding=True))
    assert server.requests_to("/v1/completions")[-1]["ebnf"] == 'root ::= " " [0-9]+'

    picture = tmp_path / "p.png"
    picture.write_bytes(b"png")

    @sgl.function
    def color(s):
        s += sgl.user(sgl.image(str(picture)) + "Which color?")
        s += sgl.assistant(sgl.select("c", ["red", "dark red"]))

    state = color.run(backend=chat_backend(server))
    assert isinstance(state.error().__cause__, sgl.ConstraintNotSupportedError)
    state = color.run(backend=chat_backend(server, constrained_decoding=True))
    assert state["c"] == "dark red"
    sent = server.requests_to("/v1/chat/completions")[-1]
    assert sent["regex"] == "(red|dark\\ red)"
    assert sent["messages"][0]["content"][0] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,cG5n"}}

    @sgl.function
    def structured(s):
        s += sgl.user("JSON please") + sgl.assistant(sgl.gen("j", json_schema={"type": "object"}, max_tokens=4))

    structured.run(backend=chat_backend(server))
    assert server.requests_to("/v1/chat/completions")[-1]["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}


def test_http_errors_become_backend_errors(serve) -> None:
    server = serve(TranscriptLM("x"))
    server.fail_status = 500
    state = card_plain.run(backend=completion_backend(server))
    cause = state.error().__cause__
    assert isinstance(cause, sgl.BackendError) and cause.status_code == 500
