"""Tensor parallelism over gloo on CPU: TP=2 gives the same greedy tokens (and log-probabilities)
as TP=1, per model family, on tiny random configs; several "nodes" on one machine; SmolLM2's
head counts give a clear error for TP=2; a rank that dies stops the server instead of hanging."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lmserver.config import ServerConfig
from lmserver.models.config import ModelConfig
from lmserver.runner.distributed import TensorParallelError, tp_head_counts

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _tiny_config(**overrides: Any) -> dict[str, Any]:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "eos_token_id": 2,
    }
    cfg.update(overrides)
    return cfg


def _model_folder(tmp_path: Path, name: str, hf_config: dict[str, Any]) -> str:
    from lmserver.models.default_model import default_model_path

    folder = tmp_path / name
    folder.mkdir()
    for f in TOKENIZER_FILES:
        shutil.copy(default_model_path() / f, folder / f)
    (folder / "config.json").write_text(json.dumps(hf_config))
    return str(folder)


def _generate_here(model_path: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    from lmserver import Engine

    eager_graphs = config.pop("eager_graphs", False)
    if eager_graphs:  # the decode graph runner with EagerGraph on every rank (inherited by the followers)
        from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV

        os.environ[EAGER_GRAPHS_ENV] = "1"

    engine = Engine(
        model_path=model_path,
        load_format=config.pop("load_format", "dummy"),
        dtype="float32",
        device="cpu",
        context_length=256,
        max_total_tokens=2048,
        **config,
    )
    try:
        params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
        out = engine.generate(PROMPTS, params, return_logprob=True)
        if eager_graphs:
            graphs = engine.core.runner.cuda_graph
            assert graphs is not None and graphs.num_replays > 0, "decode did not replay the captured graphs"
        if config.get("enable_cuda_graph_prefill"):
            prefill = engine.core.runner.prefill_graph
            assert prefill is not None and prefill.num_replays > 0, "the prompts did not replay prefill graphs"
        return out  # type: ignore[no-any-return]
    finally:
        if engine.core.tp is not None:
            engine.core.tp.shutdown()
        engine.shutdown()


def _child(box: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        box.put(("ok", fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - handed to the test process
        box.put(("error", exc))


def in_child(fn: Callable[..., Any], *args: Any, timeout_s: float = 300, check_exit: bool = False) -> Any:
    """`fn(*args)` in a fresh spawned process; its result, or its exception raised here.

    NOTE: rank 0 of a TP engine joins torch.distributed, starts a follower watchdog thread and
    registers an atexit hook; none of that may live in the pytest process (a leftover there
    once hung the CI run in an unrelated later test). `check_exit`: the child must exit with 0.
    """
    ctx = multiprocessing.get_context("spawn")
    box = ctx.Queue()
    proc = ctx.Process(target=_child, args=(box, fn, args), name="tp-test-rank0")
    proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                status, value = box.get(timeout=1)
                break
            except queue.Empty:
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the engine process gave no result (exit status {proc.exitcode})") from None
    finally:
        proc.join(timeout=60)
        exitcode = proc.exitcode
        if proc.is_alive():
            proc.kill()
            proc.join()
    if check_exit:
        assert exitcode == 0, f"rank 0's process did not exit cleanly ({exitcode})"
    if status == "error":
        raise value
    return value


def _generate(model_path: str, **config: Any) -> list[dict[str, Any]]:
    """Greedy outputs of an offline Engine run in a fresh spawned process (see `in_child`)."""
    return in_child(_generate_here, model_path, config)  # type: ignore[no-any-return]


def _assert_same(tp1: list[dict[str, Any]], tp2: list[dict[str, Any]]) -> None:
    for a, b in zip(tp1, tp2, strict=True):
        assert a["output_ids"] == b["output_ids"]
        la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-4


FAMILIES = {
    "llama_gqa": _tiny_config(),
    "llama_kv_replicated_tied_odd_vocab": _tiny_config(
        num_key_value_heads=1, tie_word_embeddings=True, vocab_size=49153
    ),
    "qwen2_bias": _tiny_config(architectures=["Qwen2ForCausalLM"]),
    "qwen3_qk_norm": _tiny_config(architectures=["Qwen3ForCausalLM"], head_dim=16),
    "mixtral_moe": _tiny_config(
        architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=2
    ),
}


# one family in the default tier, the others in the slow one (each a TP=1 and a TP=2 run in child processes)
@pytest.mark.parametrize("family", [f if f == "llama_gqa" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(FAMILIES)])
def test_tp2_equals_tp1(tmp_path: Path, family: str) -> None:
    path = _model_folder(tmp_path, family, FAMILIES[family])
    _assert_same(_generate(path), _generate(path, tp_size=2))


@pytest.mark.slow
def test_tp2_with_decode_graphs_on_every_rank_equals_tp1(tmp_path: Path) -> None:
    # --enable-tp-cuda-graph: every rank captures the same sizes (their collectives run inside the
    # captures) and replays the padded size rank 0's decision implies; EagerGraph on the CPU.
    path = _model_folder(tmp_path, "graphs", FAMILIES["llama_gqa"])
    _assert_same(_generate(path), _generate(path, tp_size=2, enable_tp_cuda_graph=True, eager_graphs=True))


@pytest.mark.slow
def test_tp2_with_prefill_graphs_on_every_rank_equals_tp1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --enable-cuda-graph-prefill under TP: every rank captures the same prefill keys at the same start-up point (their
    # collectives run inside the captures: a rank that did not capture leaves rank 0 waiting in one) and replays the
    # key its copy of the decision implies; the triton backend (extends planned inside a graph) under Triton's
    # interpreter in every rank (the spawned processes inherit the environment), EagerGraph on the CPU.
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = _model_folder(tmp_path, "prefill_graphs", FAMILIES["llama_gqa"])
    want = _generate(path, attention_backend="triton")
    _assert_same(want, _generate(path, tp_size=2, attention_backend="triton", eager_graphs=True,
                                 enable_cuda_graph_prefill=True, cuda_graph_prefill_max_tokens=64))


def _second_node(config: ServerConfig) -> None:
    from lmserver.runner.tp_engine import run_follower_node

    raise SystemExit(run_follower_node(config))


@pytest.mark.slow
def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    from lmserver.netutil import free_port

    path = _model_folder(tmp_path, "two_nodes", FAMILIES["llama_gqa"])
    addr = f"127.0.0.1:{free_port()}"
    node1 = ServerConfig(model_path=path, tp_size=2, nnodes=2, node_rank=1, dist_init_addr=addr, device="cpu")
    proc = multiprocessing.get_context("spawn").Process(target=_second_node, args=(node1,))
    proc.start()
    try:
        tp2 = _generate(path, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr)
    finally:
        proc.join(timeout=30)
    assert proc.exitcode == 0
    _assert_same(_generate(path), tp2)


def test_head_counts_that_do_not_split_give_a_clear_error() -> None:
    smollm2 = ModelConfig.from_hf(_tiny_config(num_attention_heads=9, num_key_value_heads=3, hidden_size=576))
    with pytest.raises(TensorParallelError, match=r"num_attention_heads \(9\).*tp_size \(2\).*\[3, 9\]"):
        tp_head_counts(smollm2, 2)
    assert tp_head_counts(smollm2, 3) == (3, 1)
    llama8b = ModelConfig.from_hf(
        _tiny_config(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    )
    assert tp_head_counts(llama8b, 2) == (16, 4)
    assert tp_head_counts(llama8b, 16) == (2, 1)  # each KV head replicated on 2 ranks
    with pytest.raises(TensorParallelError, match="num_key_value_heads"):
        tp_head_counts(ModelConfig.from_hf(_tiny_config(num_attention_heads=12, num_key_value_heads=8)), 3)


@pytest.mark.slow
def test_smollm2_tp2_error_and_tp3_matches_tp1() -> None:
    from lmserver.models.default_model import default_model_path

    path = str(default_model_path())
    with pytest.raises(TensorParallelError, match="tp_size among"):
        _generate(path, load_format="auto", tp_size=2)
    _assert_same(_generate(path, load_format="auto"), _generate(path, load_format="auto", tp_size=3))


@pytest.mark.slow
def test_a_dead_rank_stops_the_server(tmp_path: Path) -> None:
    import os

    from lmserver.testing import ServerProcess

    path = _model_folder(tmp_path, "dies", FAMILIES["llama_gqa"])
    srv = ServerProcess(
        [
            "--model-path",
            path,
            "--load-format",
            "dummy",
            "--tp-size",
            "2",
            "--device",
            "cpu",
            "--context-length",
            "256",
        ],
        core=None,
        env={"OMP_NUM_THREADS": "1"},
    )
    srv.start(timeout_s=300)
    pids = [int(m.group(1)) for line in srv.lines if (m := re.search(r"rank 1 started \(pid (\d+)\)", line))]
    assert pids, srv.log_tail()
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while srv.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    status = srv.proc.poll()
    if status is None:
        srv.stop()
    assert status not in (None, 0), srv.log_tail()
    assert any("tensor-parallel rank 1 exited" in line for line in srv.lines), srv.log_tail()


def test_tp_moe_shards_sum_to_the_full_expert_mlp_and_record_their_size() -> None:
    import copy

    import torch

    from lmserver.layers.moe import MoE
    from lmserver.runner.distributed.group import TPGroup
    from lmserver.runner.distributed.layers import TPMoE

    torch.manual_seed(0)
    full = MoE(hidden_size=8, intermediate_size=6, num_experts=3, top_k=2)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_()
    x = torch.randn(5, 8)
    want = full(x)
    got = torch.zeros_like(want)
    for rank in range(2):  # TPGroup of size 2 without a process group: sharding only, no all-reduce called
        shard = TPMoE(copy.deepcopy(full), TPGroup(rank, 2)).moe
        assert shard.intermediate_size == 3 == shard.w2.shape[-1] == shard.w13.shape[1] // 2
        got += shard(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
