"""Image chats with tensor parallelism through the real server and the `openai` client, on the CPU (gloo): a tiny
random LLaVA folder served with `--tp-size 2` and with `--tp-size 1`. Oracle: the tp_size 1 server: the same text and
logprobs for a chat with an image part (a data URL), one with two, and one without; both end with every KV slot
free."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from integration_tests.servers import started_side_by_side
from lmserver.testing import ServerProcess
from lmserver.testing.multimodal import random_png

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
ARGS = ["--context-length", "1024", "--dtype", "float32", "--device", "cpu", "--max-running-requests", "4",
        "--served-model-name", "tiny-llava"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, ServerProcess]]:
    from lmserver.testing.multimodal import make_tiny_llava_folder

    folder = make_tiny_llava_folder(tmp_path_factory.mktemp("tiny-llava"), "llava", seed=5)
    procs = {tp: ServerProcess(["--model-path", str(folder), *ARGS, "--tp-size", str(tp)], core=None, env=ENV)
             for tp in (2, 1)}
    with started_side_by_side(procs, timeout_s=600):
        yield procs


def _image(seed: int) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(random_png(seed, 48, 40)).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _answers(base_url: str) -> list[tuple[str, list[float]]]:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    out = []
    for content in ([_image(3), {"type": "text", "text": "What?"}],
                    [_image(4), {"type": "text", "text": "and"}, _image(5), {"type": "text", "text": "differ?"}],
                    "What is a river?"):
        chat = oai.chat.completions.create(model="tiny-llava", messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
                                           max_tokens=6, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
        assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
        out.append((chat.choices[0].message.content or "", [t.logprob for t in chat.choices[0].logprobs.content]))
    return out


def test_openai_image_chats_with_tp2_equal_tp1(servers: dict[int, ServerProcess]) -> None:
    got, want = _answers(servers[2].base_url), _answers(servers[1].base_url)
    for (g_text, g_lp), (w_text, w_lp) in zip(got, want, strict=True):
        assert g_text == w_text
        assert g_lp == pytest.approx(w_lp, abs=1e-4)
