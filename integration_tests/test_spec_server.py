"""Speculative decoding for every kind of request through the real server and the `openai` client (embedded
SmolLM2, CPU): a server with `--speculative-algorithm ngram` and a plain one. Oracle: the plain server: the same text
for a chat under a JSON Schema `response_format` (jump-forward on), a completion under a regex, a completion with
penalties, and the same text and logprobs for a completion with logprobs (streamed too); the speculating server's
stats say its verify steps accepted drafts; both end with every KV slot free."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from integration_tests.servers import started_side_by_side
from lmserver.testing import ServerProcess

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1"}
ARGS = ["--context-length", "1024", "--grammar-compile-timeout-s", "30"]
RECORD = {"name": "Alice Smith", "email": "alice.smith@example.com", "city": "Paris", "tags": ["admin", "billing"]}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                           "city": {"type": "string"}, "tags": {"type": "array",
                                                                                "items": {"type": "string"}}},
          "required": ["name", "email", "city", "tags"], "additionalProperties": False}
PASSAGE = ("The committee met on Tuesday to review the budget. It approved the road repairs, delayed the library "
           "renovation, and asked the treasurer for a new estimate of the park maintenance costs.")


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = {"spec": ServerProcess([*ARGS, "--speculative-algorithm", "ngram"], core=None, env=ENV),
             "plain": ServerProcess(ARGS, core=None, env=ENV)}
    with started_side_by_side(procs, timeout_s=900):
        yield procs


def _answers(base_url: str) -> list[Any]:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    out: list[Any] = []
    chat = oai.chat.completions.create(
        model="default", temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": f"Copy this record as JSON: {json.dumps(RECORD)}"}],
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}})
    out.append(chat.choices[0].message.content)
    copy = f"Repeat this text word for word.\nText: {PASSAGE}\nRepeated:"
    for extra in ({"regex": r"( [A-Za-z,]+){5,40}\."}, {"frequency_penalty": 0.3, "presence_penalty": 0.2}):
        penalties = {k: extra.pop(k) for k in ("frequency_penalty", "presence_penalty") if k in extra}
        done = oai.completions.create(model="default", prompt=copy, temperature=0, max_tokens=40, extra_body=extra,
                                      **penalties)
        out.append(done.choices[0].text)
    lp = oai.completions.create(model="default", prompt=copy, temperature=0, max_tokens=30, logprobs=2)
    assert lp.choices[0].logprobs is not None
    out.append((lp.choices[0].text, lp.choices[0].logprobs.token_logprobs))
    stream = oai.completions.create(model="default", prompt=copy, temperature=0, max_tokens=30, logprobs=1,
                                    stream=True)
    texts, lps = [], []
    for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            lps.extend((chunk.choices[0].logprobs.token_logprobs or []) if chunk.choices[0].logprobs else [])
    out.append(("".join(texts), lps))
    return out


def test_openai_requests_of_every_kind_with_ngram_speculation_equal_plain(servers: dict[str, ServerProcess]) -> None:
    got, want = _answers(servers["spec"].base_url), _answers(servers["plain"].base_url)
    jsonschema.validate(json.loads(got[0]), SCHEMA)
    assert got[:3] == want[:3]
    for (g_text, g_lp), (w_text, w_lp) in zip(got[3:], want[3:], strict=True):
        assert g_text == w_text
        assert g_lp == pytest.approx(w_lp, abs=1e-4)
    stats = httpx.get(servers["spec"].base_url + "/get_server_info", timeout=60).json()["scheduler"]
    assert stats["spec_accepted_tokens"] >= 20, stats
