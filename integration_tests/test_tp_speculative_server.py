"""EAGLE drafting with tensor parallelism through the real server and the `openai` client, on the CPU (gloo): a server
with `--tp-size 2 --speculative-algorithm eagle` (a random one-layer head in the published layout) and a plain
`--tp-size 1` server on one tiny random Llama folder. Oracle: the plain server: the same greedy text for completions
(one streamed); the first server's stats say its verify steps ran drafts; both end with every KV slot free."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from integration_tests.servers import started_side_by_side
from lmserver.testing import ServerProcess, write_eagle_head
from packages.server.tests.test_tensor_parallel import _model_folder, _tiny_config

pytestmark = pytest.mark.slow

TARGET = _tiny_config(num_hidden_layers=4)
ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
ARGS = ["--load-format", "dummy", "--dtype", "float32", "--device", "cpu", "--context-length", "512",
        "--max-total-tokens", "4096", "--served-model-name", "tiny"]
PROMPTS = ["The river runs", "def fibonacci(n):", "one two three four five six", "Once upon a time"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    root = tmp_path_factory.mktemp("tp-eagle")
    folder = _model_folder(root, "llama", TARGET)
    write_eagle_head(Path(root) / "head", dict(TARGET, num_hidden_layers=1, intermediate_size=128))
    procs = {
        "tp2-eagle": ServerProcess(["--model-path", folder, *ARGS, "--tp-size", "2", "--speculative-algorithm", "eagle",
                                    "--speculative-draft-model-path", str(Path(root) / "head"),
                                    "--speculative-num-draft-tokens", "3"], core=None, env=ENV),
        "plain": ServerProcess(["--model-path", folder, *ARGS], core=None, env=ENV),
    }
    with started_side_by_side(procs, timeout_s=600):
        yield procs


def _answers(base_url: str) -> list[str]:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    out = [oai.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    stream = oai.completions.create(model="tiny", prompt="Name three rivers:", max_tokens=16, temperature=0,
                                    stream=True, extra_body={"ignore_eos": True})
    out.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    return out


def test_openai_answers_with_eagle_over_tp2_equal_plain_decoding(servers: dict[str, ServerProcess]) -> None:
    assert _answers(servers["tp2-eagle"].base_url) == _answers(servers["plain"].base_url)
    stats = httpx.get(servers["tp2-eagle"].base_url + "/get_server_info", timeout=60).json()["scheduler"]
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0, stats
