"""lmdsl's in-process backend (`lmserver.edge.lmdsl_backend`) against lmdsl's HTTP backend.

Oracle: the same lmdsl programs through `RuntimeEndpoint` against a real `lmserver serve` of the
same model and options (embedded SmolLM2, CPU, float32): equal greedy texts, equal select
decisions and scores (1e-4), equal streamed texts; constrained outputs also checked with the
`regex` and `jsonschema` packages. Images: a tiny random LLaVA folder, the program's output
against `Engine.generate` with the same rendered prompt and image.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import regex

import lmdsl as sgl
from lmserver import Engine
from lmserver.edge.lmdsl_backend import EngineBackend, Runtime
from lmserver.testing import ServerProcess

OPTIONS = {"dtype": "float32", "max_total_tokens": 4096, "context_length": 2048}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def backends() -> Iterator[tuple[Runtime, sgl.RuntimeEndpoint]]:
    """(in-process runtime, HTTP endpoint) on the same model and options; the server starts while
    the in-process engine loads."""
    args = [a for k, v in OPTIONS.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    srv = ServerProcess(args, core=None).start(wait=False)
    try:
        runtime = Runtime(**OPTIONS)  # type: ignore[arg-type]
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(srv.base_url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert srv.proc.poll() is None and time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.2)
        yield runtime, sgl.RuntimeEndpoint(srv.base_url)
        runtime.engine.core.check_memory_invariant()
        runtime.shutdown()
    finally:
        assert srv.stop() == 0, srv.log_tail()


@sgl.function
def chat_qa(s, question):
    s += sgl.system("You are a concise assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=16, stop=["\n", "."]))
    s += sgl.user("Is your answer correct?")
    s += sgl.assistant(sgl.select("verdict", choices=["yes", "no", "maybe"]))
    s += sgl.user("Give the year of the event.")
    s += sgl.assistant(sgl.gen("year", max_tokens=6, regex=r"(1[5-9]|20)[0-9]{2}"))


@sgl.function
def structured(s):
    s += "A person record.\nJSON: " + sgl.gen("person", max_tokens=32, json_schema=json.dumps(SCHEMA))
    s += "\nFavourite color: " + sgl.gen("color", max_tokens=4, ebnf='root ::= "red" | "green" | "blue"')


@sgl.function
def branches(s, topic):
    s += f"Three short facts about {topic}.\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Fact {i + 1}:" + sgl.gen("fact", max_tokens=8, stop="\n")
    forks.join()


@sgl.function
def pick(s, method):
    s += "The color of the clear daytime sky is" + sgl.select(
        "color", choices=[" blue", " green", " a deep shade of red"], choices_method=method)


@sgl.function
def complete(s, prompt):
    s += prompt + sgl.gen("out", max_tokens=8)


def _both(program: sgl.Function, backends: tuple[Any, Any], **kwargs: Any) -> tuple[Any, Any]:
    states = [program.run(backend=b, temperature=0, **kwargs) for b in backends]
    for state in states:
        assert state.error() is None, state.error()
    return states[0], states[1]


def _approx_lists(a: list[list[float]], b: list[list[float]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, abs=1e-4)


def test_chat_gen_select_and_regex_equal_http(backends: tuple[Runtime, sgl.RuntimeEndpoint]) -> None:
    ours, http = _both(chat_qa, backends, question="When did the Berlin Wall fall?")
    assert ours.text() == http.text()
    assert ours["verdict"] == http["verdict"]
    a, b = ours.get_meta_info("verdict"), http.get_meta_info("verdict")
    assert a["normalized_prompt_logprobs"] == pytest.approx(b["normalized_prompt_logprobs"], abs=1e-4)
    _approx_lists(a["choice_token_logprobs"], b["choice_token_logprobs"])
    assert regex.fullmatch(r"(1[5-9]|20)[0-9]{2}", ours["year"])
    assert ours.get_meta_info("answer")["completion_tokens"] == http.get_meta_info("answer")["completion_tokens"]


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized])
def test_select_methods_equal_http(backends: tuple[Runtime, sgl.RuntimeEndpoint], method: Any) -> None:
    ours, http = _both(pick, backends, method=method)
    assert ours["color"] == http["color"]
    a, b = ours.get_meta_info("color"), http.get_meta_info("color")
    assert len(a["choice_token_logprobs"]) == 3
    _approx_lists(a["choice_token_logprobs"], b["choice_token_logprobs"])


@pytest.mark.slow  # two grammar compiles over the whole vocabulary per backend; regex is in the default tier
def test_json_schema_and_ebnf_equal_http(backends: tuple[Runtime, sgl.RuntimeEndpoint]) -> None:
    ours, http = _both(structured, backends)
    assert ours.text() == http.text()
    jsonschema.validate(json.loads(ours["person"]), SCHEMA)
    assert ours["color"] in ("red", "green", "blue")


def test_fork_join_equals_http(backends: tuple[Runtime, sgl.RuntimeEndpoint]) -> None:
    ours, http = _both(branches, backends, topic="the Moon")
    assert ours["fact"] == http["fact"] and len(ours["fact"]) == 3


def test_streaming_equals_http(backends: tuple[Runtime, sgl.RuntimeEndpoint]) -> None:
    texts = []
    for backend in backends:
        state = complete.run(backend=backend, temperature=0, stream=True, prompt="The largest animal is")
        chunks = list(state.text_iter())
        assert len(chunks) > 3 and state.error() is None
        texts.append(("".join(chunks), state.text()))
    assert texts[0] == texts[1] and texts[0][0] == texts[0][1]


def test_prefix_reuse_through_the_radix_cache(backends: tuple[Runtime, sgl.RuntimeEndpoint]) -> None:
    """A second run of a program finds its prompt in the cache (after a flush, as much as over HTTP)."""
    prompt = "Water is made of hydrogen and oxygen. The ocean covers most of the Earth. Its water is"
    cached = []
    for backend in backends:
        assert backend.flush_cache() in (True, {"success": True, "message": "cache flushed"})
        runs = [complete.run(backend=backend, temperature=0, prompt=prompt) for _ in range(2)]
        assert runs[0]["out"] == runs[1]["out"]
        cached.append([r.get_meta_info("out")["cached_tokens"] for r in runs])
    ours, http = cached
    assert ours[0] == 0 and ours[1] >= 15, ours
    assert ours == http


def test_sampling_temperature_and_bad_requests(backends: tuple[Runtime, sgl.RuntimeEndpoint]) -> None:
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("rest", max_tokens=6, temperature=1.5, top_p=0.9)

    states = story.run_batch([{}] * 4, backend=backends[0])
    assert all(s.get_meta_info("rest")["completion_tokens"] <= 6 for s in states)
    assert len({s["rest"] for s in states}) > 1  # sampled, not greedy

    @sgl.function
    def bad(s):
        s += "x" + sgl.gen("y", max_tokens=4, regex="(unclosed")

    for backend in backends:
        error = bad.run(backend=backend).error()
        assert error is not None and isinstance(error.__cause__, sgl.BackendError), error
        assert error.__cause__.status_code == 400 and "regex" in str(error.__cause__), error


def test_images_reach_the_engine(tmp_path: Path) -> None:
    """A tiny random LLaVA: the program's prompt holds the model's image placeholder and its output
    equals `Engine.generate` of that prompt with the image."""
    import numpy as np
    from PIL import Image

    from lmserver.testing.multimodal import make_tiny_llava_folder

    folder = make_tiny_llava_folder(tmp_path / "llava", "llava", seed=3)
    image = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 40, 3), dtype=np.uint8)).save(image)

    @sgl.function
    def describe(s, path):
        s += "USER: " + sgl.image(path) + "\nWhat is it? ASSISTANT:" + sgl.gen("out", max_tokens=6, ignore_eos=True)

    with Engine(str(folder), dtype="float32", device="cpu", max_total_tokens=4096) as engine:
        backend = EngineBackend(engine)
        assert backend.get_chat_template().image_token == backend.model_info["image_token"] == "<image>"
        state = describe.run(path=str(image), backend=backend, temperature=0)
        assert state.error() is None, state.error()
        prompt = state.text()[: -len(state["out"])]
        assert "<image>" in prompt
        direct = engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                                 image_data=str(image))
        assert isinstance(direct, dict) and state["out"] == direct["text"]
        without = engine.generate(prompt.replace("<image>", ""), {"max_new_tokens": 6, "temperature": 0,
                                                                  "ignore_eos": True})
        assert isinstance(without, dict) and without["output_ids"] != direct["output_ids"]
