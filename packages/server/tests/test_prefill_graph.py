"""Prefill CUDA graphs (lmserver.runner.prefill_graph).

CPU: the token and request sizes, the padding of an extend against `host_batch` (hypothesis), the runner's refusals;
under Triton's interpreter (a child process: it must be chosen before triton is imported) the graph runner with
`EagerGraph` (static buffers, host upper bounds frozen at capture, padding request) against the eager model runner
on a tiny random Llama: fresh prompts, chunks over cached prefixes, mixed decode rows, every row's logits, an extend
too large for the graphs; then the KV pool and the request-to-token table against the eager run's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.config import ServerConfig
from lmserver.kernels.testing import SLOW_CASES, pytest_under_interpreter
from lmserver.runner.cuda_graph import PAD_SLOT, PAD_TOKEN_ID, CudaGraphError, EagerGraph
from lmserver.runner.host_batch import host_batch
from lmserver.runner.model_runner import MMRows, ModelRunner
from lmserver.runner.prefill_graph import (
    GraphKey,
    PrefillGraphRunner,
    maybe_prefill_graph_runner,
    pad_prefill,
    prefill_token_sizes,
    request_sizes,
)
from lmserver.scheduler import ForwardItem, ScheduleDecision
from packages.server.tests.test_cuda_graph import TABLE_ROWS, TABLE_WIDTH, _runner

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize(("max_tokens", "sizes"), [
    (1, [1]), (64, [64]), (128, [128]), (300, [128, 256, 300]),
    (2048, [128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048]),
    (3000, [128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3000]),
])
def test_prefill_token_sizes(max_tokens: int, sizes: list[int]) -> None:
    assert prefill_token_sizes(max_tokens) == sizes


def test_sizes_refuse_zero() -> None:
    assert request_sizes(1) == [2] and request_sizes(16) == [2, 17]
    with pytest.raises(ValueError, match="cuda_graph_prefill_max_tokens"):
        prefill_token_sizes(0)
    with pytest.raises(ValueError, match="cuda_graph_prefill_max_requests"):
        request_sizes(0)


def _extend_item(row: int, prefix: int, ids: list[int], slots: list[int], every_row: bool = False) -> ForwardItem:
    """An extend of `ids` after `prefix` cached tokens at table row `row`; `slots` (>= prefix + len(ids)) the row's
    slots from position 0; the last row's logits, or every row's."""
    n = len(ids)
    return ForwardItem(
        rid=f"r{row}", req_pool_idx=row, prefix_len=prefix, token_ids=ids, out_slots=slots[prefix:prefix + n],
        table_start=prefix, table_slots=slots[prefix:prefix + n],
        logit_offsets=list(range(n)) if every_row else [n - 1], completes_prefill=True,
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 20)), min_size=1, max_size=5), st.integers(0, 40),
       st.integers(0, 3), st.integers(0, TABLE_ROWS - 1))
def test_pad_prefill_keeps_the_extend_and_adds_a_padding_request(
        shapes: list[tuple[int, int]], spare_tokens: int, spare_requests: int, pad_row: int) -> None:
    """The real rows and requests are `host_batch`'s; the padding tokens are one more request's prompt (positions
    0.., PAD_SLOT, table row `pad_row`, no prefix) starting after the real tokens; further request slots extend
    nothing; too small a size is refused."""
    items = [_extend_item(i, p, list(range(7 * i, 7 * i + n)), list(range(100 * i + 1, 100 * i + 1 + p + n)))
             for i, (p, n) in enumerate(shapes)]
    n, r = sum(s[1] for s in shapes), len(shapes)
    tokens, requests = n + spare_tokens, r + 1 + spare_requests
    step = pad_prefill(items, tokens, requests, pad_row, TABLE_WIDTH)
    h = host_batch(items, TABLE_WIDTH)
    assert step.ints.shape == (3 * tokens + 5 * requests,) and step.num_tokens == n
    ids, pos, loc = step.ints[:tokens], step.ints[tokens:2 * tokens], step.ints[2 * tokens:3 * tokens]
    rows, prefix, ext, starts, seq = step.ints[3 * tokens:].reshape(5, requests)
    for got, want in ((ids, h.input_ids), (pos, h.positions), (loc, h.out_loc)):
        assert got[:n].tolist() == want.tolist()
    assert (ids[n:] == PAD_TOKEN_ID).all() and (loc[n:] == PAD_SLOT).all()
    assert pos[n:].tolist() == list(range(spare_tokens))
    for got, want in ((rows, h.rows), (prefix, h.prefix_lens), (ext, h.ext_lens), (starts, h.starts),
                      (seq, h.seq_lens)):
        assert got[:r].tolist() == want.tolist()
    assert rows[r:].tolist() == [pad_row] * (requests - r) and not prefix[r:].any()
    assert ext[r] == spare_tokens == seq[r] and not ext[r + 1:].any() and (starts[r:] == n).all()
    assert int(ext.sum()) == tokens  # every row belongs to exactly one request, in order
    assert np.array_equal(step.table_slots, h.table_slots) and np.array_equal(step.logit_idx, h.logit_idx)
    with pytest.raises(CudaGraphError, match="does not fit"):
        pad_prefill(items, n - 1 if n > 1 else 0, requests, pad_row, TABLE_WIDTH)
    with pytest.raises(CudaGraphError, match="does not fit"):
        pad_prefill(items, tokens, r, pad_row, TABLE_WIDTH)  # no room for the padding request


def test_prefill_graphs_default_to_on_with_cuda_and_one_rank() -> None:
    from lmserver.runner.resolve import resolve_prefill_graphs

    assert ServerConfig().enable_cuda_graph_prefill is None  # resolved with the device
    assert resolve_prefill_graphs(None, "cuda", 1) is True
    assert resolve_prefill_graphs(None, "cuda", 2) is False and resolve_prefill_graphs(None, "cpu", 1) is False
    assert resolve_prefill_graphs(False, "cuda", 1) is False and resolve_prefill_graphs(True, "cpu", 1) is True


def test_prefill_graphs_are_off_unless_asked_and_need_an_extend_planning_backend(caplog: pytest.LogCaptureFixture,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner("torch_native", "cpu")
    rc = ServerConfig(max_running_requests=TABLE_ROWS)
    assert maybe_prefill_graph_runner(rc, runner) is None  # off unless resolved on (a CUDA device)
    on = rc.replace(enable_cuda_graph_prefill=True)
    assert maybe_prefill_graph_runner(on, runner) is None  # the CPU: no graphs
    monkeypatch.setenv("LMSERVER_TEST_EAGER_GRAPHS", "1")
    with caplog.at_level(logging.INFO, logger="lmserver.runner.prefill_graph"):
        assert maybe_prefill_graph_runner(on, runner) is None  # torch_native plans extends on the host
        assert maybe_prefill_graph_runner(on.replace(disable_cuda_graph=True), runner) is None
    assert "'torch_native' attention backend" in caplog.text
    with pytest.raises(CudaGraphError, match="cannot plan an extend"):
        PrefillGraphRunner(runner, 64, 2, graph_factory=EagerGraph)
    runner.attn_backend.supports_extend_graph = True  # type: ignore[attr-defined]
    with pytest.raises(CudaGraphError, match="pad_row"):
        PrefillGraphRunner(runner, 64, 2, pad_row=TABLE_ROWS, graph_factory=EagerGraph)
    with pytest.raises(CudaGraphError, match="CUDA device"):
        PrefillGraphRunner(runner, 64, 2)


def test_a_failed_capture_leaves_one_rank_eager_and_stops_tensor_parallel_ranks(caplog: pytest.LogCaptureFixture,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank drops a failed capture and runs extends eagerly; under TP the ranks capture together (collectives
    inside), so a failure on one stops the start-up instead of leaving the others' collectives unmatched."""
    runner = _runner("torch_native", "cpu")
    runner.attn_backend.supports_extend_graph = True  # type: ignore[attr-defined]
    monkeypatch.setenv("LMSERVER_TEST_EAGER_GRAPHS", "1")

    def fail(self: PrefillGraphRunner) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(PrefillGraphRunner, "capture", fail)
    on = ServerConfig(max_running_requests=TABLE_ROWS, enable_cuda_graph_prefill=True, cuda_graph_prefill_max_tokens=64)
    with caplog.at_level(logging.WARNING, logger="lmserver.runner.prefill_graph"):
        assert maybe_prefill_graph_runner(on, runner) is None
    assert "the capture failed (operation not permitted" in caplog.text
    with pytest.raises(CudaGraphError, match="under tensor parallelism .* --no-enable-cuda-graph-prefill"):
        maybe_prefill_graph_runner(on, runner, tp_size=2)


@pytest.mark.skipif(INTERPRET, reason="already the interpreter child")
def test_prefill_graph_runner_under_interpreter() -> None:
    """The triton backend's extend (host upper bounds, device lengths) through prefill graphs, in a child."""
    pytest.importorskip("triton")
    proc = pytest_under_interpreter(__file__)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def _script(runner: ModelRunner) -> list[torch.Tensor]:
    """Extends in table rows 1..5 (row 0 is the padding row), each step's logits: fresh prompts together, a prompt
    alone, a chunk over a cached prefix with every row's logits, a decode row next to a fresh prompt (a mixed step),
    an extend larger than the graphs, then a decode step of every row."""
    gen = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(1, 97, (n,), generator=gen).tolist()

    slots = {r: list(range(1 + 60 * r, 1 + 60 * r + 48)) for r in range(1, 6)}
    seqs = {1: ids(9), 2: ids(30), 3: ids(5), 4: ids(20), 5: ids(40)}
    steps = [
        [_extend_item(1, 0, seqs[1], slots[1]), _extend_item(2, 0, seqs[2], slots[2])],
        [_extend_item(3, 0, seqs[3], slots[3])],
        [_extend_item(1, 9, ids(6), slots[1], every_row=True)],
        [_extend_item(2, 30, [seqs[2][-1]], slots[2]), _extend_item(4, 0, seqs[4], slots[4])],
        [_extend_item(5, 0, seqs[5], slots[5]), _extend_item(3, 5, ids(30), slots[3])],  # 70 tokens: eager
    ]
    out = [runner.forward(ScheduleDecision("extend", items)).cpu() for items in steps]
    lens = {1: 15, 2: 31, 3: 35, 4: 20, 5: 40}
    decode = [ForwardItem(rid=f"r{r}", req_pool_idx=r, prefix_len=n, token_ids=[1 + r], out_slots=[slots[r][n]],
                          table_start=n, table_slots=[slots[r][n]], logit_offsets=[0], completes_prefill=False)
              for r, n in lens.items()]
    out.append(runner.forward(ScheduleDecision("decode", decode)).cpu())
    return out


def _fp8_kv_runner() -> ModelRunner:
    """`_runner("triton", "cpu")` over an FP8 (e4m3) KV cache with per-layer scales, K in the Hadamard basis (as the
    server keeps an FP8 cache without a lowlat plugin)."""
    from lmserver.forward.kv_pool import KVPool
    from lmserver.kernels.fp8_ref import FP8_DTYPE
    from lmserver.runner.attention.registry import default_registry

    base = _runner("triton", "cpu")
    cfg: Any = base.model.config
    pool = KVPool(base.kv_pool.num_slots, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                  torch.float32, "cpu", FP8_DTYPE, k_scales=[0.05, 0.08], v_scales=[0.04, 0.06], rotate_k=True)
    return ModelRunner(base.model, pool, base.req_to_token, default_registry().create("triton", pool, base.req_to_token),
                       torch.device("cpu"))


@pytest.mark.skipif(not INTERPRET, reason="runs in test_prefill_graph_runner_under_interpreter's child")
@pytest.mark.parametrize("kv", ["model-dtype", pytest.param("fp8", marks=pytest.mark.slow)])
def test_interpret_prefill_graphs_match_the_eager_runner(kv: str) -> None:
    make = _fp8_kv_runner if kv == "fp8" else (lambda: _runner("triton", "cpu"))
    eager = make()
    want = _script(eager)
    graphed = make()
    graphs = PrefillGraphRunner(graphed, max_tokens=64, max_requests=2, graph_factory=EagerGraph)
    graphs.capture()
    assert graphs.embeds is None  # a text model: no embeds family
    assert sorted(graphs.graphs) == [(64, 2, False, False), (64, 2, True, False), (64, 3, False, False),
                                     (64, 3, True, False)]
    graphed.prefill_graph = graphs
    keys = []
    forward = graphs.forward

    def spy(decision: ScheduleDecision, key: GraphKey, mm_rows: Sequence[MMRows] = ()) -> torch.Tensor:
        keys.append(key)
        return forward(decision, key, mm_rows)

    graphs.forward = spy  # type: ignore[method-assign]
    got = _script(graphed)
    # fresh pair, fresh one, chunk over a prefix, mixed step; the 70-token extend and the decode step eagerly
    assert keys == [(64, 3, False, False), (64, 2, False, False), (64, 2, True, False), (64, 3, True, False)]
    assert graphs.num_replays == 4
    assert [g.shape for g in got] == [w.shape for w in want] and got[2].shape[0] == 6  # every row of the chunk
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert torch.equal(graphed.req_to_token[1:], eager.req_to_token[1:])
    used = eager.req_to_token[1:][eager.req_to_token[1:] > 0].long().unique()
    assert used.numel() == 15 + 31 + 35 + 20 + 40 + 5 and PAD_SLOT not in used.tolist()
    for cache in ("k_cache", "v_cache"):
        for layer in range(len(eager.kv_pool.k_cache)):
            got_kv, want_kv = getattr(graphed.kv_pool, cache)[layer][used], getattr(eager.kv_pool, cache)[layer][used]
            if kv == "fp8":  # the same e4m3 codes (float32 sums of padded row counts may land a value across a midpoint)
                assert (got_kv.view(torch.uint8) == want_kv.view(torch.uint8)).float().mean() > 0.999
                got_kv, want_kv = got_kv.float(), want_kv.float()
            torch.testing.assert_close(got_kv, want_kv, atol=1e-5, rtol=1e-5 if kv != "fp8" else 0.13)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_graphs_on_the_gpu_match_the_eager_runner(dtype: torch.dtype) -> None:
    """Real CUDA graphs (the triton backend) against the eager runner: the same script's logits (bf16: GEMMs of
    padded row counts may round otherwise), the same table, the same KV at every real slot."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    eager = _runner("triton", "cuda", dtype)
    want = _script(eager)
    graphed = _runner("triton", "cuda", dtype)
    graphs = PrefillGraphRunner(graphed, max_tokens=64, max_requests=2)
    graphs.capture()
    graphed.prefill_graph = graphs
    got = _script(graphed)
    assert graphs.num_replays == 4
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)
    assert torch.equal(graphed.req_to_token[1:], eager.req_to_token[1:])
    used = eager.req_to_token[1:][eager.req_to_token[1:] > 0].long().unique()
    for cache in ("k_cache", "v_cache"):
        for layer in range(len(eager.kv_pool.k_cache)):
            got_kv, want_kv = getattr(graphed.kv_pool, cache)[layer], getattr(eager.kv_pool, cache)[layer]
            torch.testing.assert_close(got_kv[used].float(), want_kv[used].float(), atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="already the interpreter child")
def test_long_prefill_graphs_with_images_and_fp8_kv_under_interpreter() -> None:
    """The slow tier's cases in a child: a LLaVA prompt's image rows through the embeds family's graph, the runner
    over an FP8 KV cache."""
    pytest.importorskip("triton")
    proc = pytest_under_interpreter(__file__, marks=SLOW_CASES)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRET, reason="runs in test_long_prefill_graphs_with_images_and_fp8_kv_under_interpreter's child")
def test_interpret_image_prompts_take_the_embeds_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny LLaVA engine (triton backend, EagerGraph) with prefill graphs gives the greedy tokens and logprobs of
    the same engine without them, for a prompt with an image (the embeds family) and one without (the plain one)."""
    from lmserver import Engine
    from lmserver.testing.multimodal import make_tiny_llava_folder, random_png

    monkeypatch.setenv("LMSERVER_TEST_EAGER_GRAPHS", "1")
    folder = make_tiny_llava_folder(tmp_path / "llava", "llava", seed=3)
    image = tmp_path / "a.png"
    image.write_bytes(random_png(1))
    requests = [("USER: <image>\nlook. What is it? ASSISTANT:", [str(image)]), ("USER: what is it? ASSISTANT:", None)]
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    outs: dict[bool, list[dict]] = {}  # type: ignore[type-arg]
    for on in (False, True):
        with Engine(str(folder), dtype="float32", device="cpu", attention_backend="triton", max_total_tokens=2048,
                    max_running_requests=2, cuda_graph_max_bs=2, disable_radix_cache=True,
                    enable_cuda_graph_prefill=on, cuda_graph_prefill_max_tokens=64) as eng:
            outs[on] = [eng.generate(p, params, image_data=imgs, return_logprob=True)  # type: ignore[misc]
                        for p, imgs in requests]
            graphs = eng.core.runner.prefill_graph
            if on:
                assert graphs is not None and graphs.embeds is not None
                assert graphs.num_replays == 2 and graphs.num_image_replays == 1
                stats = eng.core.get_stats()
                assert stats["prefill_graph_replays"] == 2 and stats["prefill_graph_image_replays"] == 1
            else:
                assert graphs is None
    for got, want in zip(outs[True], outs[False], strict=True):
        assert got["output_ids"] == want["output_ids"]
        lp = [[x for x, _, _ in o["meta_info"]["output_token_logprobs"]] for o in (got, want)]
        assert np.allclose(lp[0], lp[1], atol=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRET, reason="runs in test_long_prefill_graphs_with_images_and_fp8_kv_under_interpreter's child")
def test_interpret_an_eagle3_head_reads_its_target_layers_from_prefill_graphs(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An EAGLE-3 head (random, over a tiny 8-layer target: layers 1, 3, 4) is fed by the prefill graphs the features
    the eager prefill gives it: every observation equal within 1e-5, the same drafts and greedy tokens."""
    from lmserver import Engine
    from lmserver.testing import record_eagle, write_eagle3_head
    from lmserver.testing.tiny_llama import write_tiny_llama

    monkeypatch.setenv("LMSERVER_TEST_EAGER_GRAPHS", "1")
    target = write_tiny_llama(tmp_path / "target", num_hidden_layers=8, max_position_embeddings=256)
    head = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=96,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, rope_theta=10000.0)
    write_eagle3_head(tmp_path / "eagle3", head, draft_vocab=256)
    record = record_eagle(monkeypatch)
    prompts = [" ".join(f"w{3 + (7 * i) % 90}" for i in range(n)) for n in (21, 9)]
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    runs = {}
    for on in (True, False):
        with Engine(str(target), dtype="float32", device="cpu", attention_backend="triton", max_total_tokens=2048,
                    max_running_requests=2, cuda_graph_max_bs=2, context_length=256, enable_cuda_graph_prefill=on,
                    cuda_graph_prefill_max_tokens=64, speculative_algorithm="eagle",
                    speculative_draft_model_path=str(tmp_path / "eagle3"), speculative_num_draft_tokens=3) as eng:
            assert eng.core.runner.aux_hidden
            out = [o["output_ids"] for o in eng.generate(prompts, params)]  # type: ignore[index]
            graphs = eng.core.runner.prefill_graph
            assert (graphs is not None and graphs.num_replays > 0) == on
            assert eng.get_stats()["spec_draft_tokens"] > 0
        runs[on] = (out, record.take())
    assert runs[True][0] == runs[False][0]
    runs[True][1].assert_same_as(runs[False][1], width=3 * 64, tol=1e-5)  # three target layers side by side

