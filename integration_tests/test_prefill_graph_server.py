"""Prefill CUDA graphs (`--enable-cuda-graph-prefill`) through the real server and the `openai` client, on the CPU:
two servers on one tiny random LLaVA folder, the triton attention backend under Triton's interpreter with the CPU
stand-in for CUDA graphs (`EagerGraph`, LMSERVER_TEST_EAGER_GRAPHS), one with prefill graphs and one without. Oracle:
the server without them: the same text and logprobs for a completion, a chat with an image part and a chat without;
the first server's stats say its graphs ran them (image rows through the embeds family)."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import openai
import pytest

from integration_tests.servers import started_side_by_side
from lmserver.testing import ServerProcess
from lmserver.testing.multimodal import random_png

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "LMSERVER_TEST_EAGER_GRAPHS": "1", "CUDA_VISIBLE_DEVICES": ""}
ARGS = ["--context-length", "1024", "--dtype", "float32", "--attention-backend", "triton", "--cuda-graph-max-bs", "2",
        "--max-running-requests", "4", "--served-model-name", "tiny-llava", "--disable-radix-cache"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, ServerProcess]]:
    pytest.importorskip("triton")
    from lmserver.testing.multimodal import make_tiny_llava_folder

    folder = make_tiny_llava_folder(tmp_path_factory.mktemp("tiny-llava"), "llava", seed=5)
    procs = {on: ServerProcess(["--model-path", str(folder), *ARGS,
                                *(["--enable-cuda-graph-prefill", "--cuda-graph-prefill-max-tokens", "128"] if on else [])],
                               core=None, env=ENV) for on in (True, False)}
    with started_side_by_side(procs, timeout_s=900):
        yield procs


def _image_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(random_png(seed, 48, 40)).decode()


def _answers(base_url: str) -> list[tuple[str, list[float]]]:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    out = []
    text = oai.completions.create(model="tiny-llava", prompt="USER: tell me about " + "rivers and " * 12 + "ASSISTANT:",
                                  max_tokens=5, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    assert text.choices[0].logprobs is not None
    out.append((text.choices[0].text, [float(x) for x in text.choices[0].logprobs.token_logprobs or []]))
    for content in ([{"type": "image_url", "image_url": {"url": _image_url(3)}}, {"type": "text", "text": "What?"}],
                    "What is a river?"):
        chat = oai.chat.completions.create(model="tiny-llava", messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
                                           max_tokens=5, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
        assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
        out.append((chat.choices[0].message.content or "", [t.logprob for t in chat.choices[0].logprobs.content]))
    return out


def test_openai_answers_equal_with_and_without_prefill_graphs(servers: dict[bool, ServerProcess]) -> None:
    got, want = _answers(servers[True].base_url), _answers(servers[False].base_url)
    for (g_text, g_lp), (w_text, w_lp) in zip(got, want, strict=True):
        assert g_text == w_text
        assert g_lp == pytest.approx(w_lp, abs=1e-4)
    stats = httpx.get(servers[True].base_url + "/get_server_info", timeout=60).json()["scheduler"]
    assert stats["prefill_graph_replays"] >= 3 and stats["prefill_graph_image_replays"] >= 1
    assert "prefill_graph_replays" not in httpx.get(servers[False].base_url + "/get_server_info",
                                                    timeout=60).json()["scheduler"]
