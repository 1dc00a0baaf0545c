"""SGLang's own frontend (its `sglang` wheel, 0.5.23) against our server on SmolLM2 (CPU), started
the way SGLang's `TestSRTBackend` starts its server (`--incremental-streaming-output`): SGLang's
own programs (`sglang.test.test_programs`, with their assertions) pass, and an
unconditional-likelihood `select` (whose second batch of requests sends prompt-free token ids
with `max_new_tokens: 0`) returns logprobs equal to those of independent single requests.

SGLang is not our dependency: `make sglang-frontend` installs its wheel (no dependencies) in
`.sglang-frontend/`, and the programs run in a subprocess with it on PYTHONPATH
(`integration_tests/sglang_programs.py`). Without it these tests are skipped, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from lmserver.testing import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
FRONTEND = Path(os.environ.get("LMSERVER_SGLANG_FRONTEND", ROOT / ".sglang-frontend"))
SCRIPT = Path(__file__).with_name("sglang_programs.py")
ENV = {"OMP_NUM_THREADS": "1"}  # see test_server_clients.py
# programs that stream or score (the protocol details SGLang's frontend depends on): every run
QUICK = ["stream_logprobs", "select", "unconditional_select", "stream"]
# the rest of SGLang's TestSRTBackend set, the slow tier; without hellaswag (it downloads data) and
# few_shot_qa / decode_int (they assert answers a 135M model does not know, with no switch to skip that)
# (gen_min_new_tokens runs as `min_tokens`: its check needs torchvision and a tokenizer by model name)
REST = ["mt_bench", "expert_answer", "tool_use", "parallel_decoding", "regex", "dtype_gen", "min_tokens"]

pytestmark = pytest.mark.skipif(not (FRONTEND / "sglang").is_dir(),
                                reason="SGLang's frontend is not installed: run `make sglang-frontend`")


@pytest.fixture(scope="module")
def server() -> Any:
    srv = ServerProcess(["--context-length", "4096", "--incremental-streaming-output"], core=None, env=ENV)
    srv.start(timeout_s=900)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def _run(server: ServerProcess, names: list[str]) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FRONTEND), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(SCRIPT), server.base_url, *names], capture_output=True, text=True,
                          env=env, timeout=1200)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row["name"]] = row
    missing = [n for n in names if n not in results]
    assert not missing, f"no result for {missing}: rc {proc.returncode}\n{proc.stderr[-3000:]}"
    return results


def _check(results: dict[str, dict[str, Any]]) -> None:
    failed = {n: r["error"] + "\n" + r.get("trace", "") for n, r in results.items() if not r["ok"]}
    assert not failed, "\n\n".join(f"{n}: {e}" for n, e in failed.items())


def _single_request_logprobs(client: httpx.Client, ids: list[int]) -> list[float | None]:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True, "logprob_start_len": 0})
    assert r.status_code == 200, r.text
    return [row[0] for row in r.json()["meta_info"]["input_token_logprobs"]]


def test_sglangs_streaming_and_scoring_programs_pass(server: ServerProcess) -> None:
    results = _run(server, QUICK)
    _check(results)
    # the unconditional-likelihood select: its logprobs are those of one request per choice
    meta = results["unconditional_select"]["result"]["meta"]
    choices = results["unconditional_select"]["result"]["choices"]
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        for cond, uncond in zip(meta["input_token_logprobs"], meta["unconditional_token_logprobs"], strict=True):
            ids = [row[1] for row in cond]
            assert [row[1] for row in uncond] == ids
            assert uncond[0][0] is None  # the first token has no context: no logprob
            single = _single_request_logprobs(client, ids)
            assert single[0] is None
            for got, want in zip([row[0] for row in uncond][1:], single[1:], strict=True):
                assert abs(got - want) <= 1e-4, (got, want)
    # the decision is the best mean of (conditional - unconditional) logprobs, first unconditional as 0
    scores = []
    for cond, uncond in zip(meta["input_token_logprobs"], meta["unconditional_token_logprobs"], strict=True):
        diffs = [c[0] - (u[0] or 0.0) for c, u in zip(cond, uncond, strict=True)]
        scores.append(sum(diffs) / len(diffs))
    assert results["unconditional_select"]["result"]["answer"] == choices[scores.index(max(scores))]


@pytest.mark.slow
def test_the_rest_of_sglangs_backend_programs_pass(server: ServerProcess) -> None:
    results = _run(server, REST)
    _check(results)
    assert 64 <= results["min_tokens"]["result"]["completion_tokens"] <= 128
