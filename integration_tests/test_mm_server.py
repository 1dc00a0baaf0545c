"""Images through the real server (a tiny random LLaVA-1.5 folder, CPU) and real clients: the
`openai` client with image_url parts (data: and http URLs of a loopback server), native
/generate with image_data, lmdsl's essay judge. Oracle: the offline Engine on the same folder
(whose tokens and logprobs equal HF transformers', see packages/server/tests/test_mm_engine.py).
Bad inputs are 400s; the server stays healthy and leaks no KV."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import regex

import lmdsl as sgl
from lmserver.testing import ServerProcess
from lmserver.testing.multimodal import random_png

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1"}
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _png(seed: int) -> bytes:
    return random_png(seed, 48, 40)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmserver.testing.multimodal import make_tiny_llava_folder

    return make_tiny_llava_folder(tmp_path_factory.mktemp("tiny-llava"), "llava", seed=5)


@pytest.fixture(scope="module")
def server(folder: Path, idle_invariant: Any) -> Iterator[ServerProcess]:
    srv = ServerProcess(["--model-path", str(folder), "--context-length", "2048", "--mm-fetch-timeout-s", "1",
                         "--mm-max-image-pixels", "4000000", "--served-model-name", "tiny-llava"], core=None, env=ENV)
    srv.start(timeout_s=900)
    yield srv
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        idle_invariant(client)  # after the module's tests, in whatever order they ran
    assert srv.stop() == 0, srv.log_tail()


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/slow.png":
            time.sleep(3)
        body = _png(int(re.sub(r"\D", "", self.path) or 0))
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the server gave up on /slow.png
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def offline(folder: Path) -> Iterator[Any]:
    from lmserver import Engine

    eng = Engine(str(folder), dtype="float32", device="cpu", max_total_tokens=4096, max_running_requests=4)
    yield eng
    eng.shutdown()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_native_generate_matches_the_offline_engine(http: httpx.Client, offline: Any, tmp_path: Path,
                                                    image_server: str) -> None:
    path = tmp_path / "a.png"
    path.write_bytes(_png(1))
    prompt = "USER: <image>\nWhat is this? ASSISTANT:"
    want = offline.generate(prompt, GREEDY, image_data=str(path))["output_ids"]
    for source in (str(path), _data_url(_png(1)), base64.b64encode(_png(1)).decode(), f"{image_server}/1.png"):
        out = http.post("/generate", json={"text": prompt, "image_data": source, "sampling_params": GREEDY})
        assert out.status_code == 200, out.text
        assert out.json()["output_ids"] == want, source[:40]
    # the same image again is a radix hit on the whole prompt
    again = http.post("/generate", json={"text": prompt, "image_data": str(path), "sampling_params": GREEDY}).json()
    assert again["meta_info"]["cached_tokens"] >= again["meta_info"]["prompt_tokens"] - 1
    info = http.get("/get_server_info").json()["scheduler"]
    # five requests with the same image bytes: encoded once, the rest radix hits (no encoder lookup); the
    # four after the first went to the engine by the image's hash alone, without pixels (same outputs)
    assert info["mm_encoder_cache_misses"] == 1 and info["mm_radix_hit_rate"] > 0.5
    assert info["mm_items_by_hash"] >= 4
    model = http.get("/get_model_info").json()
    assert model["is_multimodal"] is True and model["image_token"] == "<image>"


def test_openai_chat_with_image_parts(oai: openai.OpenAI, offline: Any, image_server: str) -> None:
    messages: list[Any] = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(_png(2))}},
        {"type": "text", "text": "Describe it."},
        {"type": "image_url", "image_url": {"url": f"{image_server}/3.png"}}]}]
    # the tiny folder's template renders the images first, then the text (llava-hf's layout)
    prompt = "USER: <image>\n<image>\nDescribe it. ASSISTANT:"
    want = offline.tokenizer.decode(offline.generate(prompt, GREEDY, image_data=[_data_url(_png(2)),
                                                                                  f"{image_server}/3.png"])["output_ids"])
    extra = {"ignore_eos": True}
    reply = oai.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=6, temperature=0, extra_body=extra)
    assert reply.choices[0].message.content == want.strip() or reply.choices[0].message.content == want
    assert reply.usage is not None and reply.usage.prompt_tokens > 2 * 16  # two images of 16 tokens each
    chunks = oai.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=6, temperature=0, stream=True,
                                         extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _big_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (8000, 6500)).save(buf, format="PNG")  # 52 megapixels in a few KB
    return buf.getvalue()


def test_bad_images_are_400_and_the_server_stays_healthy(http: httpx.Client, image_server: str,
                                                        tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("no image here")
    prompt = "USER: <image>\nWhat? ASSISTANT:"
    cases = {
        "not an image": {"text": prompt, "image_data": str(text)},
        "truncated png": {"text": prompt, "image_data": _data_url(_png(4)[:300])},
        "50 megapixels": {"text": prompt, "image_data": _data_url(_big_png())},
        "unreachable url": {"text": prompt, "image_data": f"http://127.0.0.1:{_closed_port()}/a.png"},
        "slow url": {"text": prompt, "image_data": f"{image_server}/slow.png"},
        "bad base64": {"text": prompt, "image_data": "data:image/png;base64,%%%not-base64"},
        "more images than placeholders": {"text": prompt, "image_data": [_data_url(_png(1)), _data_url(_png(2))]},
        "not a string": {"text": prompt, "image_data": 42},
        "video to an image-only model": {"text": prompt, "video_data": _data_url(_png(1))},
    }
    for name, body in cases.items():
        resp = http.post("/generate", json={**body, "sampling_params": GREEDY})
        assert resp.status_code == 400, (name, resp.status_code, resp.text)
        assert resp.json()["error"]["message"], name
    assert http.get("/health").status_code == 200
    ok = http.post("/generate", json={"text": prompt, "image_data": _data_url(_png(1)), "sampling_params": GREEDY})
    assert ok.status_code == 200


def test_lmdsl_essay_judge_runs_against_lmserver(server: ServerProcess, tmp_path: Path) -> None:
    import importlib.util

    example = Path(sgl.__file__).resolve().parents[2] / "examples" / "essay_judge.py"
    spec = importlib.util.spec_from_file_location("essay_judge_example", example)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    image = tmp_path / "essay.png"
    image.write_bytes(_png(9))
    state = module.essay_judge.run(image_path=str(image), essay="A cat sleeps on a warm windowsill.",
                                   backend=sgl.RuntimeEndpoint(server.base_url), temperature=0)
    assert state.error() is None
    assert state["related"] in ("yes", "no")
    if state["related"] == "yes":
        assert len(state["judgment"]) == len(module.DIMENSIONS)
        # a random model may stop at max_tokens inside the summary: the text is a prefix of the language
        assert regex.fullmatch(module.RESULT_REGEX, state["result"], partial=True)


def test_memory_invariant_when_idle(http: httpx.Client, idle_invariant: Any) -> None:
    idle_invariant(http)


def test_lmdsl_openai_backend_sends_image_url_parts(server: ServerProcess, offline: Any, tmp_path: Path) -> None:
    """lmdsl's OpenAI backend (image_url parts, as for any OpenAI-style API) against lmserver's chat API:
    the same answer as the native path with the same rendered prompt."""
    from lmdsl.backend.openai_backend import OpenAI

    image = tmp_path / "q.png"
    image.write_bytes(_png(11))

    @sgl.function
    def describe(s, path):  # type: ignore[no-untyped-def]
        s += sgl.user(sgl.image(path) + "Describe it.")
        s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0))

    backend = OpenAI("tiny-llava", base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    state = describe.run(path=str(image), backend=backend)
    assert state.error() is None
    want = offline.tokenizer.decode(offline.generate("USER: <image>\nDescribe it. ASSISTANT:",
                                                     {"max_new_tokens": 6, "temperature": 0},
                                                     image_data=str(image))["output_ids"], skip_special_tokens=True)
    assert state["answer"].strip() == want.strip()
