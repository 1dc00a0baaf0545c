"""Issue 32 units: secrets kept out of config dumps, the router's key and /metrics, the request body
limit, SGLang's streamed-logprob fields, clear messages, the prefill chunk size by device."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from lmserver.config import REDACTED, ServerConfig
from lmserver.edge.api.app import BodyLimit
from lmserver.edge.api.errors import install_error_handlers, read_json
from lmserver.edge.api.native import StreamCursor, native_output
from lmserver.edge.router.app import RouterConfig, build_app
from lmserver.edge.tokenizer_manager import GenState
from lmserver.io_struct import GenerateReq, InvalidRequestError, SamplingParams

KEY = "sk-very-secret-4711"


# -- secrets ------------------------------------------------------------------------------------
def test_config_dumps_redact_the_api_key() -> None:
    config = ServerConfig(api_key=KEY)
    assert config.to_dict()["api_key"] == REDACTED and KEY not in repr(config) and KEY not in str(config.to_dict())
    assert config.to_dict(redact_secrets=False)["api_key"] == KEY and config.api_key == KEY
    assert ServerConfig().to_dict()["api_key"] is None


def test_router_needs_the_key_on_every_endpoint_but_health_and_serves_metrics() -> None:
    with TestClient(build_app(RouterConfig(workers=(), api_key=KEY))) as client:
        for method, path in (("POST", "/add_worker?url=http://evil:1"), ("POST", "/remove_worker?url=http://a:1"),
                             ("POST", "/flush_cache"), ("GET", "/workers"), ("GET", "/metrics"),
                             ("POST", "/generate"), ("GET", "/v1/models")):
            r = client.request(method, path, headers={"Authorization": "Bearer wrong"} if "remove" in path else {})
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"], (path, r.text)
        assert client.get("/workers", headers={"Authorization": f"Bearer {KEY}"}).json()["workers"] == []
        assert client.get("/health").status_code == 503  # open (no worker yet), never 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert client.post("/add_worker?url=http://w:1", headers=auth).json() == {"added": "http://w:1"}
        text = client.get("/metrics", headers=auth).text
        assert 'lmserver_router_worker_healthy{worker="http://w:1"} 1.0' in text
        assert 'lmserver_router_requests_total{path="/add_worker",status="401"} 1.0' in text
        assert client.post("/remove_worker?url=http://w:1", headers=auth).status_code == 200
        assert "http://w:1" not in client.get("/metrics", headers=auth).text


def test_router_without_a_key_stays_open() -> None:
    with TestClient(build_app(RouterConfig(workers=()))) as client:
        assert client.post("/add_worker?url=http://w:1").status_code == 200
        assert "lmserver_router_worker_in_flight" in client.get("/metrics").text


# -- body limit ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited() -> Iterator[tuple[TestClient, dict[str, int]]]:
    app = FastAPI()
    install_error_handlers(app)
    seen = {"bytes": 0}

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, Any]:
        body = await read_json(request)
        seen["bytes"] = len(str(body))
        return {"ok": True}

    app.add_middleware(BodyLimit, max_bytes=1000)
    with TestClient(app) as client:
        yield client, seen


def test_a_declared_length_over_the_limit_is_413_before_the_body_is_read(
        limited: tuple[TestClient, dict[str, int]]) -> None:
    client, seen = limited
    r = client.post("/echo", content=b"[" + b"1," * 5000 + b"1]")
    assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"] and seen["bytes"] == 0
    assert r.headers["connection"] == "close"
    assert client.post("/echo", json=[1, 2]).json() == {"ok": True}


def test_a_chunked_body_is_counted_as_it_arrives(limited: tuple[TestClient, dict[str, int]]) -> None:
    client, seen = limited
    sent = []

    def chunks() -> Iterator[bytes]:
        for _ in range(100):
            sent.append(1)
            yield b"1" * 300

    seen["bytes"] = 0
    r = client.post("/echo", content=chunks())
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"] and seen["bytes"] == 0
    assert client.post("/echo", content=iter([b"[1,", b"2]"])).json() == {"ok": True}


# -- protocol -----------------------------------------------------------------------------------
def _state() -> GenState:
    return GenState(rid="r", prompt_tokens=2, input_token_logprobs=[(None, 5, None), (-0.5, 6, None)])


def test_streamed_logprobs_follow_sglang_cumulative_and_incremental() -> None:
    req = GenerateReq(rid="r", input_ids=[5, 6], sampling_params=SamplingParams(), return_logprob=True,
                      top_logprobs_num=1)
    state, cursor = _state(), StreamCursor()
    chunks, cumulative = [], []
    for i, (tok, piece) in enumerate([(7, "He"), (8, "llo"), (9, "!")]):
        state.output_ids.append(tok)
        state.text += piece
        state.output_token_logprobs.append((-0.1 * (i + 1), tok, None))
        state.output_top_logprobs.append([(-0.1 * (i + 1), tok, None)])
        cumulative.append(native_output(state, req))
        chunks.append(native_output(state, req, cursor))
    assert [c["meta_info"]["output_token_logprobs_length"] for c in chunks] == [1, 2, 3]
    assert [c["meta_info"]["output_token_logprobs_length"] for c in cumulative] == [1, 2, 3]
    assert [len(c["meta_info"]["output_token_logprobs"]) for c in cumulative] == [1, 2, 3]
    assert [c["meta_info"]["output_token_logprobs"] for c in chunks] == [[lp] for lp in state.output_token_logprobs]
    assert [c["meta_info"]["output_top_logprobs"] for c in chunks] == [[t] for t in state.output_top_logprobs]
    assert [c["text"] for c in chunks] == ["He", "llo", "!"] and [c["output_ids"] for c in chunks] == [[7], [8], [9]]
    assert all(c["meta_info"]["input_token_logprobs"] == state.input_token_logprobs for c in chunks)
    assert cumulative[-1]["text"] == "Hello!" and cumulative[-1]["output_ids"] == [7, 8, 9]


@pytest.mark.parametrize("field, value, message", [
    ("top_p", float("nan"), "top_p must be a finite number in (0, 1]"),
    ("max_new_tokens", 2**64, "max_new_tokens is out of range"),
    ("max_new_tokens", float(2**64), "max_new_tokens is out of range"),  # orjson's reading of 18446744073709551616
    ("top_k", 2**64, "top_k is out of range"),  # once crashed the engine core (a 64-bit tensor)
])
def test_sampling_messages_say_what_is_wrong(field: str, value: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams.from_dict({field: value})


def test_openai_nan_message_names_the_finite_range() -> None:
    from pydantic import BaseModel, Field, ValidationError

    from lmserver.edge.api.errors import format_validation_error

    class M(BaseModel):
        top_p: float | None = Field(None, gt=0, le=1)

    with pytest.raises(ValidationError) as info:
        M(top_p=float("nan"))
    assert "top_p: must be a finite number in (0, 1], got nan" in format_validation_error(info.value)[0]


def test_a_schema_whose_properties_is_not_an_object_says_so() -> None:
    from cfsm.errors import UnsupportedSchemaError
    from cfsm.schema.json_schema import schema_to_node

    with pytest.raises(UnsupportedSchemaError, match="properties must be an object"):
        schema_to_node({"type": "object", "properties": 5})


# -- head-of-line blocking: the prefill chunk by device -----------------------------------------
def test_chunked_prefill_size_resolves_small_on_cpu_and_8192_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from lmserver.models.config import ModelConfig
    from lmserver.runner import resolve

    mc = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
                              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                              "num_key_value_heads": 1, "max_position_embeddings": 64})
    cpu = ServerConfig(device="cpu", max_total_tokens=256)
    assert cpu.chunked_prefill_size is None  # auto
    assert resolve.resolve_config(cpu, mc, "m").chunked_prefill_size == 512
    assert resolve.resolve_config(cpu.replace(chunked_prefill_size=-1), mc, "m").chunked_prefill_size == -1
    assert resolve.resolve_config(cpu.replace(chunked_prefill_size=64), mc, "m").chunked_prefill_size == 64
    with pytest.raises(resolve.ConfigError, match="chunked_prefill_size"):
        resolve.resolve_config(cpu.replace(chunked_prefill_size=0), mc, "m")
    # the graph extends' read bound: refused on a machine without graphs too, never silently kept
    assert resolve.resolve_config(cpu.replace(cuda_graph_extend_max_reads=5), mc, "m").cuda_graph_extend_max_reads == 5
    with pytest.raises(resolve.ConfigError, match="cuda_graph_extend_max_reads"):
        resolve.resolve_config(cpu.replace(cuda_graph_extend_max_reads=0), mc, "m")
    monkeypatch.setattr(resolve, "resolve_device", lambda config: "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 << 30))
    monkeypatch.setattr(resolve, "resolve_attention_backend", lambda requested, device: "torch_native")
    assert resolve.resolve_config(cpu.replace(device="cuda"), mc, "m").chunked_prefill_size == 8192
