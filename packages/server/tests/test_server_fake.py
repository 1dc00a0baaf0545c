"""The HTTP server end to end (real process model, ZMQ, uvicorn) over the deterministic fake core.

The fake core echoes the prompt (see `lmserver.testing`), so every expected output is computed
here from the tokenizer: `expected_text`. One server for the whole module, with an API key.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lmserver.config import ServerConfig
from lmserver.testing import (
    BAD_NATIVE,
    BAD_OPENAI,
    FAIL_ADD_KEY,
    FakeEngineCore,
    ServerProcess,
    fake_logprob,
    fuzz_generate_bodies,
    fuzz_openai_bodies,
)

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."


@pytest.fixture(scope="module")
def server() -> Any:
    srv = ServerProcess(["--api-key", KEY, "--max-running-requests", "64", "--log-interval-s", "1"], core="slow")
    srv.start()
    yield srv
    # after every test of the module, whatever their order: the KV memory invariant once idle
    with httpx.Client(base_url=srv.base_url, headers=AUTH, timeout=60) as client:
        _wait_idle(client)
        r = client.get("/check_memory_invariant")
    code = srv.stop()
    assert r.status_code == 200 and r.json() == {"ok": True}, r.text
    assert code == 0, srv.log_tail()


@pytest.fixture(scope="module")
def fake() -> FakeEngineCore:
    return FakeEngineCore(ServerConfig())


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Any:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


def expected_text(fake: FakeEngineCore, ids: list[int], n: int) -> str:
    return str(fake.tokenizer.decode(fake.expected_output_ids(ids, n), skip_special_tokens=True))


def sse_events(text: str) -> list[Any]:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assert_still_serves(http: httpx.Client, fake: FakeEngineCore) -> None:
    r = http.post("/generate", json={"text": "ok then", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == expected_text(fake, fake.tokenizer.encode("ok then"), 3)


# -- native /generate ---------------------------------------------------------------------------
def test_generate_single_matches_the_oracle(http: httpx.Client, fake: FakeEngineCore) -> None:
    ids = fake.tokenizer.encode(PROMPT)
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 7, "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == expected_text(fake, ids, 7)
    assert out["output_ids"] == fake.expected_output_ids(ids, 7)
    meta = out["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 7)
    assert meta["finish_reason"]["type"] == "length" and meta["e2e_latency"] > 0


def test_generate_batch_with_per_prompt_params_and_rids(http: httpx.Client, fake: FakeEngineCore) -> None:
    texts = ["one two three", "alpha beta", "red green blue yellow"]
    body = {"text": texts, "rid": ["a1", "a2", "a3"],
            "sampling_params": [{"max_new_tokens": k, "temperature": 0} for k in (2, 4, 6)]}
    outs = http.post("/generate", json=body).json()
    assert [o["meta_info"]["id"] for o in outs] == ["a1", "a2", "a3"]
    assert [o["text"] for o in outs] == [expected_text(fake, fake.tokenizer.encode(t), k)
                                         for t, k in zip(texts, (2, 4, 6), strict=True)]


def test_generate_input_ids_and_max_new_tokens_zero(http: httpx.Client, fake: FakeEngineCore) -> None:
    ids = fake.tokenizer.encode(PROMPT)
    out = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0}}).json()
    assert out["text"] == "" and out["output_ids"] == []
    assert (out["meta_info"]["prompt_tokens"], out["meta_info"]["completion_tokens"]) == (len(ids), 0)
    batch = http.post("/generate", json={"input_ids": [ids, ids[:3]], "sampling_params": {"max_new_tokens": 2,
                                                                                         "temperature": 0}}).json()
    assert [o["text"] for o in batch] == [expected_text(fake, ids, 2), expected_text(fake, ids[:3], 2)]


def test_token_id_prompts_with_non_integers_are_refused_as_such(http: httpx.Client) -> None:
    """A bool (or float) among a prompt's token ids: 400 on both APIs, the message naming the rule (not "out of the
    vocabulary", which is for integers outside it)."""
    for path, body in (("/v1/completions", {"model": "m", "prompt": [5, True, 7], "max_tokens": 2}),
                       ("/v1/completions", {"model": "m", "prompt": [5, 7.0], "max_tokens": 2}),
                       ("/generate", {"input_ids": [5, True, 7], "sampling_params": {"max_new_tokens": 2}})):
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        message = r.json()["error"]["message"]
        assert "integer" in message or "list of token ids" in message, (path, message)
        assert "vocabulary" not in message, (path, message)
    r = http.post("/v1/completions", json={"model": "m", "prompt": [5, 10**9], "max_tokens": 2})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


def test_generate_stream_is_cumulative_and_ends_with_done(http: httpx.Client, fake: FakeEngineCore) -> None:
    body = {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 9, "temperature": 0}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert texts[-1] == expected_text(fake, fake.tokenizer.encode(PROMPT), 9)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_generate_batch_stream_with_n_tags_each_event_with_its_index(http: httpx.Client,
                                                                     fake: FakeEngineCore) -> None:
    body = {"text": ["one two three", "alpha beta"], "stream": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2}}
    events = sse_events(http.post("/generate", json=body).text)
    final = {e["index"]: e["text"] for e in events if e["meta_info"]["finish_reason"]}
    expected = [expected_text(fake, fake.tokenizer.encode(t), 4) for t in ("one two three", "alpha beta")]
    assert final == {0: expected[0], 1: expected[0], 2: expected[1], 3: expected[1]}


def test_generate_logprobs_with_logprob_start_len(http: httpx.Client, fake: FakeEngineCore) -> None:
    ids = fake.tokenizer.encode(PROMPT)
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[3:]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx([fake_logprob(t) for t in ids[3:]])
    assert all(isinstance(e[2], str) for e in meta["input_token_logprobs"])
    out_ids = fake.expected_output_ids(ids, 4)
    assert [e[1] for e in meta["output_token_logprobs"]] == out_ids
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx([fake_logprob(t) for t in out_ids])
    assert [len(t) for t in meta["output_top_logprobs"]] == [2] * 4
    # logprob_start_len 0: the first prompt token has no logprob
    meta0 = http.post("/generate", json={**body, "logprob_start_len": 0}).json()["meta_info"]
    assert meta0["input_token_logprobs"][0][0] is None and len(meta0["input_token_logprobs"]) == len(ids)


def test_generate_n_gives_n_seeded_samples(http: httpx.Client) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "n": 3, "temperature": 1.0,
                                                "sampling_seed": 11}}
    first = http.post("/generate", json=body).json()
    again = http.post("/generate", json=body).json()
    assert len(first) == 3 and [o["text"] for o in first] == [o["text"] for o in again]
    assert len({o["text"] for o in first}) > 1


def test_stop_string_is_trimmed_and_reported(http: httpx.Client, fake: FakeEngineCore) -> None:
    full = expected_text(fake, fake.tokenizer.encode(PROMPT), 12)
    stop = " capital of Italy"
    assert stop in full
    for stream in (False, True):
        body = {"text": PROMPT, "stream": stream, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                      "stop": stop}}
        r = http.post("/generate", json=body)
        out = sse_events(r.text)[-1] if stream else r.json()
        assert out["text"] == full[:full.index(stop)]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        if stream:
            assert all(stop[:4] not in e["text"][len(out["text"]):] for e in sse_events(r.text))


def test_a_failing_prompt_in_a_batch_cancels_the_others(http: httpx.Client) -> None:
    # the second prompt is refused by the core (constrained decoding), the first must not keep running
    body = {"text": [PROMPT, PROMPT], "sampling_params": [{"max_new_tokens": 400}, {"regex": "a+"}]}
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and "constrained decoding" in r.json()["error"]["message"]
    assert _wait_idle(http, timeout_s=3.0)["num_used_tokens"] == 0
    dup = http.post("/generate", json={"text": ["a", "b"], "rid": ["x", "x"]})
    assert dup.status_code == 400 and "unique" in dup.json()["error"]["message"]


def test_null_fields_mean_defaults_as_sglang_clients_send_them(http: httpx.Client, fake: FakeEngineCore) -> None:
    body = {"text": PROMPT, "lora_path": None, "return_logprob": None, "logprob_start_len": None,
            "sampling_params": {"max_new_tokens": None, "temperature": 0, "regex": None, "json_schema": None,
                                "stop_token_ids": None, "custom_params": None}}
    out = http.post("/generate", json=body).json()
    assert out["text"] == expected_text(fake, fake.tokenizer.encode(PROMPT), 128)


# -- OpenAI API ---------------------------------------------------------------------------------
def test_openai_models_and_model_check(oai: openai.OpenAI) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert oai.models.retrieve("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.models.retrieve("gpt-17")
    # another model name is served by this model, as SGLang does (--strict-model-name: 404)
    reply = oai.completions.create(model="gpt-3.5-turbo-instruct", prompt="hi", max_tokens=1)
    assert reply.model == "SmolLM2-135M-Instruct"


def test_openai_completions_prompt_forms(oai: openai.OpenAI, fake: FakeEngineCore) -> None:
    ids = fake.tokenizer.encode(PROMPT)
    r = oai.completions.create(model="default", prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.choices[0].text == expected_text(fake, ids, 5) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 5)
    r = oai.completions.create(model="default", prompt=["a b c", "x y"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [expected_text(fake, fake.tokenizer.encode(p), 3)
                                           for p in ("a b c", "a b c", "x y", "x y")]
    r = oai.completions.create(model="default", prompt=ids, max_tokens=4, temperature=0, stop=[" France"])
    full = expected_text(fake, ids, 4)
    assert r.choices[0].text == full.split(" France")[0] and r.choices[0].finish_reason == "stop"


def test_openai_completions_echo_logprobs_for_scoring(oai: openai.OpenAI, fake: FakeEngineCore) -> None:
    ids = fake.tokenizer.encode(PROMPT)
    r = oai.completions.create(model="default", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT
    assert "".join(lp.tokens) == PROMPT and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([fake_logprob(t) for t in ids[1:]])
    assert lp.text_offset[0] == 0 and len(lp.top_logprobs) == len(ids)


def test_openai_completions_stream(oai: openai.OpenAI, fake: FakeEngineCore) -> None:
    chunks = list(oai.completions.create(model="default", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(fake, fake.tokenizer.encode(PROMPT), 8)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def _chat_ids(fake: FakeEngineCore, content: str) -> list[int]:
    text = fake.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                              add_generation_prompt=True)
    return list(fake.tokenizer.encode(text, add_special_tokens=False))


def test_openai_chat_template_usage_and_cached_tokens(oai: openai.OpenAI, fake: FakeEngineCore) -> None:
    question = "What is the capital of France? Answer briefly please."
    ids = _chat_ids(fake, question)
    r1 = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": question}],
                                     max_tokens=6, temperature=0)
    assert r1.choices[0].message.content == expected_text(fake, ids, 6)
    assert r1.choices[0].message.role == "assistant"
    assert r1.usage.prompt_tokens == len(ids)
    r2 = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": question}],
                                     max_tokens=6, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens == len(ids) - 1


def test_openai_chat_stream_n_and_logprobs(oai: openai.OpenAI, fake: FakeEngineCore) -> None:
    ids = _chat_ids(fake, "hello there")
    chunks = list(oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hello there"}], max_tokens=5, temperature=0,
        stream=True, n=2, logprobs=True, top_logprobs=3, stream_options={"include_usage": True}))
    by_index: dict[int, str] = {0: "", 1: ""}
    lps: dict[int, list[Any]] = {0: [], 1: []}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] += ch.delta.content or ""
            if ch.logprobs and ch.logprobs.content:
                lps[ch.index].extend(ch.logprobs.content)
    assert by_index[0] == by_index[1] == expected_text(fake, ids, 5)
    out_ids = fake.expected_output_ids(ids, 5)
    assert [e.logprob for e in lps[0]] == pytest.approx([fake_logprob(t) for t in out_ids])
    assert all(len(e.top_logprobs) == 3 for e in lps[0])
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["length", "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_openai_chat_extra_body_and_response_format(oai: openai.OpenAI, http: httpx.Client) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = oai.chat.completions.create(model="default", messages=msgs, max_tokens=3, seed=5,
                                    extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1})
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="constrained decoding"):  # the ebnf reaches the core
        oai.chat.completions.create(model="default", messages=msgs, extra_body={"ebnf": "root ::= 'a'"})
    # the json_schema reaches the engine core (the fake core refuses constrained decoding)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="constrained decoding"):
        oai.chat.completions.create(model="default", messages=msgs, response_format=fmt)  # type: ignore[arg-type]


# -- bad input: each followed by a valid request ------------------------------------------------
@pytest.mark.parametrize("name, body, message", BAD_NATIVE, ids=[b[0] for b in BAD_NATIVE])
def test_bad_native_input_gives_400_then_serves(http: httpx.Client, fake: FakeEngineCore, name: str,
                                                body: Any, message: str) -> None:
    if isinstance(body, bytes):
        r = http.post("/generate", content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"
    assert_still_serves(http, fake)


@pytest.mark.parametrize("name, path, body, status, message", BAD_OPENAI, ids=[b[0] for b in BAD_OPENAI])
def test_bad_openai_input_gives_4xx_then_serves(http: httpx.Client, fake: FakeEngineCore, name: str, path: str,
                                                body: Any, status: int, message: str) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert_still_serves(http, fake)


def test_an_engine_error_in_add_request_fails_only_that_request(http: httpx.Client, fake: FakeEngineCore) -> None:
    r = http.post("/generate", json={"text": "a", "extra_key": FAIL_ADD_KEY})
    assert r.status_code == 400 and "the engine rejected the request: KeyError" in r.json()["error"]["message"]
    assert_still_serves(http, fake)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=fuzz_generate_bodies())
def test_fuzzed_generate_bodies_never_give_a_server_error(http: httpx.Client, body: Any) -> None:
    r = http.post("/generate", json=body)
    event(f"status {r.status_code}")
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["message"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=fuzz_openai_bodies(),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), fill=st.booleans())
def test_fuzzed_openai_bodies_never_give_a_server_error(http: httpx.Client, body: Any, path: str,
                                                        fill: bool) -> None:
    body.setdefault("max_tokens", 2)
    if fill:  # a valid prompt, so that the other fields get exercised too
        body.pop("prompt" if path == "/v1/completions" else "messages", None)
        if path == "/v1/completions":
            body["prompt"] = "hello"
        else:
            body["messages"] = [{"role": "user", "content": "hello"}]
    r = http.post(path, json=body)
    event(f"status {r.status_code}")
    assert r.status_code in (200, 400, 404), r.text


# -- auth, utility endpoints --------------------------------------------------------------------
def test_api_key_required_except_health(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as anon:
        assert anon.get("/health").status_code == 200
        for method, path in (("POST", "/generate"), ("GET", "/v1/models"), ("GET", "/metrics"),
                             ("GET", "/get_server_info"), ("GET", "/health_generate")):
            r = anon.request(method, path, json={"text": "a"})
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        r = anon.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401


def test_tokenize_detokenize_round_trip(http: httpx.Client, fake: FakeEngineCore) -> None:
    out = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert out["tokens"] == fake.tokenizer.encode(PROMPT) and out["count"] == len(out["tokens"])
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json()["text"] == PROMPT
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_info_endpoints(http: httpx.Client) -> None:
    info = http.get("/get_model_info").json()
    assert info["model_path"] == "SmolLM2-135M-Instruct" and info["is_generation"] is True
    assert info["prefix_hints_useful"] is False  # the scheduler dedups a batch's shared prefixes itself
    server_info = http.get("/server_info").json()
    assert server_info["context_length"] == 2048 and server_info["api_key"] == "***"  # never the key itself
    assert {"num_running_reqs", "num_waiting_reqs", "cache_hit_rate"} <= set(server_info["scheduler"])
    assert http.get("/health_generate").status_code == 200


def _wait_idle(http: httpx.Client, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        sched = http.get("/get_server_info").json()["scheduler"]
        if sched["num_running_reqs"] == 0 and sched["num_waiting_reqs"] == 0 or time.monotonic() > deadline:
            return dict(sched)
        time.sleep(0.05)


def test_flush_cache_refused_while_busy(http: httpx.Client, server: ServerProcess) -> None:
    assert http.post("/flush_cache").status_code == 200
    result: dict[str, Any] = {}

    def long_request() -> None:
        with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as c:
            result["r"] = c.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 60}})

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.3)
    r = http.post("/flush_cache")
    t.join()
    assert r.status_code == 400 and "running" in r.json()["error"]["message"]
    assert result["r"].status_code == 200
    _wait_idle(http)
    assert http.post("/flush_cache").status_code == 200


def test_abort_request_finishes_it_with_abort(http: httpx.Client, server: ServerProcess) -> None:
    result: dict[str, Any] = {}

    def long_request() -> None:
        with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as c:
            result["r"] = c.post("/generate", json={"text": PROMPT, "rid": "to-abort",
                                                    "sampling_params": {"max_new_tokens": 500}})

    t = threading.Thread(target=long_request)
    t.start()
    # abort once the request is running and has had time to decode (a fixed sleep raced a loaded machine)
    deadline = time.monotonic() + 20
    while http.get("/get_server_info").json()["scheduler"]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline and t.is_alive(), "the request never started running"
        time.sleep(0.02)
    time.sleep(0.2)
    while not http.post("/abort_request", json={"rid": "to-abort"}).json()["aborted"]:
        assert time.monotonic() < deadline and t.is_alive(), "the request was never running to be aborted"
        time.sleep(0.05)
    t.join(10)
    out = result["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out["meta_info"]["completion_tokens"] < 500
    assert _wait_idle(http)["num_used_tokens"] == 0


def _aborted_count(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('lmserver_requests_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_client_disconnect_mid_stream_frees_kv(http: httpx.Client, server: ServerProcess, fake: FakeEngineCore) -> None:
    aborted = _aborted_count(http)
    body = {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 1000}}
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as c, \
            c.stream("POST", "/generate", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    # the connection is closed; the core must drop the request and its tokens
    sched = _wait_idle(http)
    assert sched["num_running_reqs"] == 0 and sched["num_used_tokens"] == 0
    # and a non-streaming request whose client goes away is aborted too
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.base_url, headers=AUTH, timeout=0.5) as c:
        c.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 1000}})
    sched = _wait_idle(http)
    assert sched["num_running_reqs"] == 0 and sched["num_used_tokens"] == 0
    assert _aborted_count(http) == aborted + 2  # both disconnects are counted in /metrics
    assert_still_serves(http, fake)


@pytest.mark.slow
def test_200_concurrent_requests_all_correct(server: ServerProcess, fake: FakeEngineCore) -> None:
    prompts = [f"request number {i} says hello" for i in range(200)]

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(c.post("/generate", json={
                "text": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}) for p in prompts))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 200
    assert [r.json()["text"] for r in responses] == [
        expected_text(fake, fake.tokenizer.encode(p), 8) for p in prompts]


def test_metrics_exposition(http: httpx.Client, server: ServerProcess) -> None:
    http.post("/generate", json={"text": "a b", "sampling_params": {"max_new_tokens": 2}})
    assert http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": -1}}).status_code == 400
    assert httpx.post(server.base_url + "/generate", json={"text": "a"}, timeout=30).status_code == 401
    text = http.get("/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['lmserver_requests_total{finish_reason="length"}'] >= 1
    assert values["lmserver_generation_tokens_total"] >= 2
    assert values["lmserver_time_to_first_token_seconds_count"] >= 1
    assert values["lmserver_e2e_request_latency_seconds_count"] >= 1
    assert "lmserver_num_running_reqs" in values and "lmserver_cache_hit_rate" in values
    assert values['lmserver_http_requests_total{path="/generate",status="200"}'] >= 1
    assert values['lmserver_http_requests_total{path="/generate",status="400"}'] >= 1
    assert values['lmserver_http_requests_total{path="/generate",status="401"}'] >= 1


def test_memory_invariant_when_idle_and_stats_logged(http: httpx.Client, server: ServerProcess) -> None:
    """Any time the server is idle (the fixture checks it again after the module's last test)."""
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 8}})
    assert r.status_code == 200, r.text
    _wait_idle(http)
    r = http.get("/check_memory_invariant")
    assert r.status_code == 200 and r.json() == {"ok": True}
    deadline = time.monotonic() + 10  # --log-interval-s 1: the stats line follows the tokens
    while not any("gen throughput" in line for line in server.lines):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.1)
