"""The real server (engine core on the embedded SmolLM2, CPU) driven by real clients: the `openai`
client, raw HTTP on the native API, and lmdsl's RuntimeEndpoint. Oracles: HF transformers run on
the same model folder (greedy tokens and log-probabilities), the `regex` module and `jsonschema`
for constrained outputs."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

import lmdsl as sgl
from lmserver.testing import ServerProcess

QUESTION = "What is the capital of France?"
PROMPT = "The capital of France is"
# NOTE: one torch thread per process: the CI machine has 2 cores shared by the server, its core
# process and the test process.
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(idle_invariant: Any) -> Any:
    srv = ServerProcess(["--context-length", "2048"], core=None, env=ENV)
    srv.start(timeout_s=900)
    yield srv
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        idle_invariant(client)  # after the module's tests, in whatever order they ran
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def hf(http: httpx.Client) -> Any:
    """HF transformers on the folder the server loaded: (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = http.get("/get_model_info").json()["model_path"]
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def hf_logprobs(hf: Any, ids: list[int]) -> Any:
    import torch

    with torch.no_grad():
        logits = hf[0](torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # (len(ids), vocab)


def hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(hf_logprobs(hf, out)[-1].argmax()))
    return out[len(ids):]


def chat_ids(hf: Any, content: str) -> list[int]:
    text = hf[1].apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return list(hf[1].encode(text, add_special_tokens=False))


def test_openai_chat_answers_and_counts_cached_tokens(oai: openai.OpenAI, hf: Any) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    r = oai.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert "Paris" in r.choices[0].message.content
    ids = chat_ids(hf, QUESTION)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == hf[1].decode(hf_greedy(hf, ids, r.usage.completion_tokens),
                                                        skip_special_tokens=True)
    again = oai.chat.completions.create(model="default", messages=messages, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    assert again.usage.prompt_tokens_details.cached_tokens >= len(ids) - 1


def test_openai_chat_stream_matches_non_stream(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    full = oai.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    chunks = list(oai.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                              stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_openai_n2_seeded_samples_and_chat_logprobs(oai: openai.OpenAI, hf: Any) -> None:
    messages = [{"role": "user", "content": "Tell me a word."}]
    kw: dict[str, Any] = dict(model="default", messages=messages, max_tokens=6, temperature=1.0, n=2, seed=3)
    a, b = oai.chat.completions.create(**kw), oai.chat.completions.create(**kw)
    assert len(a.choices) == 2
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    g = oai.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                    logprobs=True, top_logprobs=3)
    content = g.choices[0].logprobs.content
    ids = chat_ids(hf, "Tell me a word.")
    out = hf_greedy(hf, ids, len(content))
    ref = hf_logprobs(hf, ids + out)
    for i, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(ref[len(ids) - 1 + i, out[i]]), abs=2e-3)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def test_openai_completions_greedy_and_echo_scoring(oai: openai.OpenAI, hf: Any) -> None:
    ids = list(hf[1].encode(PROMPT))
    served = oai.models.list().data[0].id
    assert served.rstrip("/").endswith("SmolLM2-135M-Instruct")
    r = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.choices[0].text == hf[1].decode(hf_greedy(hf, ids, 6)) and r.model == served
    scored = oai.completions.create(model="default", prompt=PROMPT + " Paris", max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    lp = scored.choices[0].logprobs
    full = list(hf[1].encode(PROMPT + " Paris"))
    ref = hf_logprobs(hf, full)
    assert lp.token_logprobs[0] is None and "".join(lp.tokens) == PROMPT + " Paris"
    assert lp.token_logprobs[1:] == pytest.approx([float(ref[i - 1, t]) for i, t in enumerate(full) if i], abs=2e-3)
    r = oai.completions.create(model="default", prompt=[ids, ids[:3]], max_tokens=3, temperature=0, stop=["\n"])
    assert [c.index for c in r.choices] == [0, 1]


def test_native_generate_batch_stream_logprobs_and_prefill_only(http: httpx.Client, hf: Any) -> None:
    ids = list(hf[1].encode(PROMPT))
    single = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert single.json()["output_ids"] == hf_greedy(hf, ids, 5)
    batch = http.post("/generate", json={"text": [PROMPT, "Hello"], "sampling_params": {"max_new_tokens": 3,
                                                                                       "temperature": 0}}).json()
    assert batch[0]["text"] == hf[1].decode(hf_greedy(hf, ids, 3)) and len(batch) == 2
    events = [json.loads(line[6:]) for line in http.post("/generate", json={
        "text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).text.split("\n")
        if line.startswith("data: {")]
    assert events[-1]["text"] == single.json()["text"]
    prefill = http.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 1,
                                           "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 0}})
    meta = prefill.json()["meta_info"]
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == len(ids)
    ref = hf_logprobs(hf, ids)
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[1:]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(
        [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))], abs=2e-3)


# -- lmdsl programs through RuntimeEndpoint -----------------------------------------------------
@sgl.function
def few_shot(s: Any, country: str) -> None:
    s += "France: Paris\nJapan: Tokyo\nItaly: Rome\n" + country + ":"
    s += sgl.gen("capital", max_tokens=8, stop="\n", temperature=0)


@sgl.function
def pick(s: Any) -> None:
    s += "Q: Which city is the capital of France?\nA:"
    s += sgl.select("city", choices=[" Paris", " Berlin", " Madrid"])


@sgl.function
def two_tips(s: Any) -> None:
    s += "Here are two tips for staying healthy: 1. Balanced Diet. 2. Regular Exercise.\n\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into a short sentence:"
        f += sgl.gen("detail", max_tokens=8, stop="\n", temperature=0)
    s += "Tip 1:" + forks[0]["detail"] + "\nTip 2:" + forks[1]["detail"] + "\n"


def test_lmdsl_programs(server: ServerProcess) -> None:
    backend = sgl.RuntimeEndpoint(server.base_url)
    state = few_shot.run(country="Germany", backend=backend)
    assert state.error() is None and "Berlin" in state["capital"] and "\n" not in state["capital"]
    assert pick.run(backend=backend)["city"] == " Paris"
    tips = two_tips.run(backend=backend)
    assert tips.error() is None and tips.text().count("Tip ") == 2
    batch = few_shot.run_batch([{"country": c} for c in ["Germany", "Spain"] * 8], backend=backend)
    assert len(batch) == 16 and all(s.error() is None for s in batch)
    assert {s["capital"] for s in batch[::2]} == {state["capital"]}
    streamed = few_shot.run(country="Germany", backend=backend, stream=True)
    assert "".join(streamed.text_iter("capital")) == state["capital"]


# -- constrained decoding (cfsm through the engine) ---------------------------------------------
@sgl.function
def card(s: Any) -> None:
    s += "Name: Alice\nAge:" + sgl.gen_int("age", max_tokens=4)
    s += "\nZip code:" + sgl.gen("zip", regex=r" [0-9]{5}", max_tokens=8)


def test_regex_through_lmdsl_native_and_openai(server: ServerProcess, http: httpx.Client, oai: Any) -> None:
    import regex

    state = card.run(backend=sgl.RuntimeEndpoint(server.base_url), temperature=0)
    assert state.error() is None
    assert regex.fullmatch(r"[-+]?[0-9]+", state["age"]) and regex.fullmatch(r" [0-9]{5}", state["zip"])
    pattern = r"(yes|no), because [a-z ]{3,20}\."
    events = [json.loads(line[6:]) for line in http.post("/generate", json={
        "text": "Is Paris in France? Answer:", "stream": True,
        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "regex": pattern}}).text.split("\n")
        if line.startswith("data: {")]
    assert regex.fullmatch(pattern, events[-1]["text"]), events[-1]["text"]
    r = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "Pick a color."}],
                                    max_tokens=10, temperature=0, extra_body={"regex": "(red|green|blue)"})
    assert r.choices[0].message.content in ("red", "green", "blue")


def test_response_format_json_schema(oai: Any) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    r = oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert r.choices[0].finish_reason == "stop"


def test_memory_invariant_when_idle(http: httpx.Client, idle_invariant: Any) -> None:
    assert idle_invariant(http)["num_running_reqs"] == 0
