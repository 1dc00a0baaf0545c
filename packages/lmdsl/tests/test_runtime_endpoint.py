"""RuntimeEndpoint against a local fake server that follows the native API contract."""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterator
from pathlib import Path

import pytest

import lmdsl as sgl
from lmdsl.backend.runtime_endpoint import RuntimeEndpoint, choice_token_logprobs
from lmdsl.testing.fake_lm import TranscriptLM
from lmdsl.testing.fake_native import FakeNativeServer
from lmdsl.testing.mock import mock_tokens

TABLE = {" red": -1.0, " dark": -0.3, " very": -0.5}


def table_logprob(context: str, token: str) -> float:
    return TABLE.get(token, -2.0)


@pytest.fixture()
def server() -> Iterator[FakeNativeServer]:
    lm = TranscriptLM("Name: Alice\nAge: 30\n", fallback=" fallback text", logprob=table_logprob)
    with FakeNativeServer(lm, api_key="secret") as srv:
        yield srv  # type: ignore[misc]


@pytest.fixture()
def backend(server: FakeNativeServer) -> RuntimeEndpoint:
    return RuntimeEndpoint(server.url, api_key="secret")


@sgl.function
def forked_names(s):
    s += "Intro. "
    forks = s.fork(2)
    forks += "Name:" + sgl.gen("name", stop="\n")
    forks.join()


@pytest.mark.parametrize(("useful", "mode", "hints"), [
    (False, "auto", 0), (False, "always", 1), (None, "auto", 1), (None, "never", 0),
])
def test_prefix_hints_follow_the_servers_model_info(useful: bool | None, mode: str, hints: int) -> None:
    """lmserver reports `prefix_hints_useful: false` (its batches share prefixes by themselves): "auto"
    then sends no fork hint; a server without the field (SGLang) gets one."""
    lm = TranscriptLM("Name: Alice\n", fallback=" x")
    with FakeNativeServer(lm, model_info={} if useful is None else {"prefix_hints_useful": useful}) as srv:
        backend = RuntimeEndpoint(srv.url)
        assert backend.wants_prefix_hints is (useful is not False)

        prog = copy.copy(forked_names)
        prog.config = prog.config.with_(prefix_hints=mode, wait_for_prefix_hints=True)  # no hint dropped as queued
        state = prog.run(backend=backend)
        assert state["name"] == [" Alice", " Alice"]
        requests = srv.requests_to("/generate")
        assert sum(r["sampling_params"].get("max_new_tokens") == 0 for r in requests) == hints
        assert len(requests) == 2 + hints


def test_model_info_picks_chatml_for_smollm(backend: RuntimeEndpoint, server: FakeNativeServer) -> None:
    assert backend.get_model_name() == "/models/SmolLM2-135M-Instruct"
    assert backend.get_chat_template().name == "chatml"
    assert RuntimeEndpoint(server.url, "secret", chat_template="llama-3-instruct").get_chat_template().name == (
        "llama-3-instruct")
    with pytest.raises(sgl.BackendError, match="401") as info:
        RuntimeEndpoint(server.url, api_key="wrong")
    assert info.value.status_code == 401


def test_gen_sends_the_contract_request(backend: RuntimeEndpoint, server: FakeNativeServer) -> None:
    @sgl.function
    def card(s):
        s += "Name:" + sgl.gen("name", max_tokens=8, stop="\n") + "\nAge:" + sgl.gen_int("age", max_tokens=4)

    state = card.run(backend=backend, temperature=0)
    assert state.error() is None
    assert state["name"] == " Alice"
    requests = server.requests_to("/generate")
    assert requests[0] == {"text": "Name:", "sampling_params": {
        "max_new_tokens": 8, "min_new_tokens": 0, "n": 1, "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False, "stop": ["\n", "<|im_end|>"]}}
    assert requests[1]["text"] == "Name: Alice\nAge:"
    assert requests[1]["sampling_params"]["regex"] == r"[-+]?[0-9]+"
    assert state.get_meta_info("name")["prompt_tokens"] == 1
    assert state.usage().num_api_calls == 2


def test_select_follows_the_protocol_and_matches_an_oracle(backend: RuntimeEndpoint, server: FakeNativeServer) -> None:
    choices = ["red", "dark red", "very dark red"]
    expected = {}
    for method in ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized"):
        @sgl.function
        def pick(s, method=method):
            s += "Color: " + sgl.select("c", choices, choices_method=method)

        state = pick.run(backend=backend)
        assert state.error() is None, state.error()
        expected[method] = state["c"]
        requests = server.requests_to("/generate")
        assert requests[-3 if method.startswith("uncond") else -2] == {
            "text": "Color: ", "sampling_params": {"max_new_tokens": 0}}
        batch = requests[-2 if method.startswith("uncond") else -1]
        assert batch["text"] == ["Color: " + c for c in choices]
        assert batch["logprob_start_len"] == len(mock_tokens("Color: ")) - 2
        assert batch["return_logprob"] is True and batch["return_text_in_logprobs"] is True
        assert state.get_meta_info("c")["choice_token_logprobs"] == [
            [table_logprob("", t) for t in mock_tokens(" " + c)] for c in choices]
    # Oracle from the table: means -1.0, -0.65, -0.6; first tokens -1.0, -0.3, -0.5; the fake's logprobs do
    # not depend on context, so (cond - uncond) is the first token's logprob over the token count.
    assert expected == {"token_length_normalized": "very dark red", "greedy_token_selection": "dark red",
                        "unconditional_likelihood_normalized": "dark red"}


def test_choice_token_trimming_keeps_a_merged_boundary_token() -> None:
    entries = [[-0.1, 1, " word"], [-0.7, 2, ":"], [-0.4, 3, " organ"], [-0.2, 4, "ism"]]
    assert choice_token_logprobs(entries, "organism") == [-0.4, -0.2]
    assert choice_token_logprobs(entries, "ganism") == [-0.4, -0.2]  # " organ" spans the boundary
    assert choice_token_logprobs([[None, 1, "x"], [-1.0, 2, "y"], [-0.5, 3, "z"]], "Q") == [-0.5]


def test_fork_sends_a_prefix_hint_and_streams_cumulative_text(backend: RuntimeEndpoint, server: FakeNativeServer) -> None:
    state = forked_names.run(backend=backend)
    requests = server.requests_to("/generate")
    # the hint goes out without the fork waiting for it: among the requests, not necessarily first
    assert requests.count({"text": "Intro. ", "sampling_params": {"max_new_tokens": 0}}) == 1
    assert len(requests) == 3
    assert state["name"] == [" Alice", " Alice"]

    @sgl.function
    def streamed(s):
        s += "Age:" + sgl.gen("age", max_tokens=5)

    state = streamed.run(backend=backend, stream=True)
    chunks = list(state.text_iter("age"))
    assert chunks == [" 30", "\n"] or chunks == [" 30"]
    assert "".join(chunks) == state["age"]
    assert server.requests_to("/generate")[-1]["stream"] is True


def test_batches_n_images_and_errors(backend: RuntimeEndpoint, server: FakeNativeServer, tmp_path: Path) -> None:
    @sgl.function
    def ask(s, q):
        s += "Shared preamble. " + q + sgl.gen("a", max_tokens=1, n=2)

    states = ask.run_batch([{"q": "Name:"}, {"q": "Age:"}], backend=backend)
    assert [s["a"] for s in states] == [[" Alice", " Alice"], [" 30", " 30"]]
    assert server.requests_to("/generate")[0] == {"text": "Shared preamble. ", "sampling_params": {"max_new_tokens": 0}}

    picture = tmp_path / "cat.png"
    picture.write_bytes(b"\x89PNG fake")

    @sgl.function
    def look(s, path):
        s += sgl.user(sgl.image(path) + "What is it?") + sgl.assistant(sgl.gen("a", max_tokens=3))

    assert look.run(path=str(picture), backend=backend).error() is None
    sent = server.requests_to("/generate")[-1]
    assert sent["image_data"] == base64.b64encode(b"\x89PNG fake").decode()
    assert sent["text"].startswith("<|im_start|>user\n<image>What is it?<|im_end|>\n<|im_start|>assistant\n")

    @sgl.function
    def look_select(s, path):
        s += sgl.user(sgl.image(path) + "Cat?") + sgl.assistant(sgl.select("a", ["yes", "no"]))

    assert look_select.run(path=str(picture), backend=backend).error() is None
    batch = server.requests_to("/generate")[-1]
    assert len(batch["text"]) == 2 and batch["image_data"] == [base64.b64encode(b"\x89PNG fake").decode()] * 2

    server.fail_status = 503
    state = ask.run(q="x", backend=backend)
    assert isinstance(state.error().__cause__, sgl.BackendError)
    assert state.error().__cause__.status_code == 503
    with pytest.raises(sgl.ProgramError, match="returned 503.*injected failure"):
        state["a"]
    url = server.url
    server.stop()
    with pytest.raises(sgl.BackendError, match="get_model_info failed: ConnectError"):
        RuntimeEndpoint(url)


def test_server_helpers(backend: RuntimeEndpoint, server: FakeNativeServer) -> None:
    assert sgl.flush_cache(backend) == {"success": True}
    assert sgl.get_server_info(backend)["model_path"] == "/models/SmolLM2-135M-Instruct"
    assert server.requests_to("/flush_cache") == [None]
    from lmdsl.testing import MockBackend

    with pytest.raises(sgl.ConstraintNotSupportedError, match="no server cache"):
        sgl.flush_cache(MockBackend())


def test_video_and_sampling_extras_reach_the_server(backend: RuntimeEndpoint, server: FakeNativeServer) -> None:
    @sgl.function
    def prog(s):
        s += sgl.video("clip.mp4", num_frames=4) + "Name:" + sgl.gen(
            "a", max_tokens=4, stop_token_ids=[2], return_logprob=True, logprob_start_len=0, top_logprobs_num=2)

    state = prog.run(backend=backend)
    assert state.error() is None
    sent = server.requests_to("/generate")[-1]
    assert sent["video_data"] == ["clip.mp4"]
    assert sent["return_logprob"] is True and sent["logprob_start_len"] == 0 and sent["top_logprobs_num"] == 2
    assert sent["sampling_params"]["stop_token_ids"] == [2]
    meta = state.get_meta_info("a")
    assert [e[2] is None for e in meta["output_token_logprobs"]] == [True] * len(meta["output_token_logprobs"])
    assert len(meta["input_token_logprobs"]) == len(mock_tokens("<image>Name:"))


def test_many_calls_in_flight_are_all_sent_at_once() -> None:
    """300 concurrent calls through one RuntimeEndpoint reach the server together (a server that answers only
    once all 300 have arrived): no client-side connection cap holds some back (32 tree-of-thought programs
    have 512 calls in flight; a capped pool stalled or hung them on an H200)."""
    import json
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    parties = 300
    barrier = threading.Barrier(parties, timeout=20)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _reply(self, body: dict[str, object], status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._reply({"model_path": "/models/SmolLM2-135M-Instruct"})

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                self._reply({"error": "not every call arrived"}, 503)
                return
            self._reply({"text": "", "meta_info": {"prompt_tokens": 1}})

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 512

    srv = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        backend = RuntimeEndpoint(f"http://127.0.0.1:{srv.server_address[1]}")
        with ThreadPoolExecutor(parties) as pool:
            results = list(pool.map(lambda i: backend.cache_prefix(f"prefix {i}"), range(parties)))
        assert results == [None] * parties
    finally:
        srv.shutdown()


def test_lmserver_gets_frame_counts_and_names_its_image_token() -> None:
    """lmserver's model info announces frame counts in requests and its placeholder text."""
    lm = TranscriptLM("Name: Alice\n", fallback=" x")
    with FakeNativeServer(lm, model_path="/models/tiny-llava",
                          model_info={"video_frames_in_requests": True, "image_token": "<img>"}) as server:
        backend = RuntimeEndpoint(server.url)

        @sgl.function
        def prog(s):
            s += sgl.image("cat.png") + sgl.video("clip.mp4", num_frames=4) + "Name:" + sgl.gen("a", max_tokens=2)

        state = prog.run(backend=backend)
        assert state.error() is None
        sent = server.requests_to("/generate")[-1]
    assert sent["video_data"] == [{"url": "clip.mp4", "num_frames": 4}]
    assert sent["image_data"] == "cat.png"
    assert sent["text"].startswith("<img><img>Name:")  # one placeholder per image or video
