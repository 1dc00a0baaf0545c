"""Decode CUDA graphs (lmserver.runner.cuda_graph) and GPU KV sizing (engine.resolve).

CPU: batch-size buckets and padding against a naive oracle; the graph runner with `EagerGraph`
(static buffers, padding rows, in-place metadata) against the eager model runner on a tiny
random Llama. `gpu`: real CUDA graphs vs eager (logits and greedy tokens, both backends) and the
engine with graphs on vs off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.config import ServerConfig
from lmserver.forward.kv_pool import KVPool, make_req_to_token
from lmserver.kernels.testing import pytest_under_interpreter
from lmserver.models.config import ModelConfig
from lmserver.models.loader import load_model
from lmserver.runner.attention.registry import default_registry
from lmserver.runner.cuda_graph import (
    PAD_SLOT,
    CudaGraphError,
    DecodeGraphRunner,
    EagerGraph,
    capture_batch_sizes,
    maybe_decode_graph_runner,
    pad_decode,
    pad_verify,
    padded_batch_size,
    verify_rows,
)
from lmserver.runner.model_runner import ModelRunner
from lmserver.runner.resolve import ConfigError, estimate_weight_bytes, resolve_kv_tokens
from lmserver.scheduler import ForwardItem, ScheduleDecision

# head_dim 16 (the smallest tl.dot size on a GPU), GQA group 3 like SmolLM2.
TINY = ModelConfig.from_hf(dict(
    architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
))
TABLE_ROWS, TABLE_WIDTH, NUM_SLOTS = 6, 48, 400


# --- buckets and padding ------------------------------------------------------------------

@pytest.mark.parametrize(("max_bs", "sizes"), [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (32, [1, 2, 4, 8, 16, 24, 32]),
])
def test_capture_batch_sizes(max_bs: int, sizes: list[int]) -> None:
    assert capture_batch_sizes(max_bs) == sizes


def test_capture_batch_sizes_rejects_zero() -> None:
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_batch_sizes(0)


@settings(max_examples=200, deadline=None)
@given(max_bs=st.integers(1, 300), bs=st.integers(-2, 320))
def test_padded_batch_size_is_the_smallest_captured_size_that_fits(max_bs: int, bs: int) -> None:
    sizes = capture_batch_sizes(max_bs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_bs
    fits = [s for s in sizes if s >= bs]
    expected = min(fits) if fits and bs >= 1 else None
    assert padded_batch_size(bs, sizes) == expected


def _item(row: int, prefix: int, ids: list[int], slots: list[int], logits: bool = True) -> ForwardItem:
    n = len(ids)
    return ForwardItem(
        rid=f"r{row}", req_pool_idx=row, prefix_len=prefix, token_ids=ids, out_slots=slots[prefix : prefix + n],
        table_start=prefix, table_slots=slots[prefix : prefix + n], logit_offsets=[n - 1] if logits else [],
        completes_prefill=True,
    )


def test_pad_decode_fills_padding_rows() -> None:
    items = [_item(3, 5, [11], list(range(100, 110))), _item(1, 0, [7], [42], logits=False)]
    step = pad_decode(items, 4, pad_row=5)
    assert step.ints == [[11, 7, 0, 0], [5, 0, 0, 0], [105, 42, PAD_SLOT, PAD_SLOT], [3, 1, 5, 5], [6, 1, 1, 1]]
    assert step.seq_lens == [6, 1, 1, 1]
    assert step.table == [[], [], []]  # the graph writes each new slot itself
    assert step.logit_rows == [0]
    behind = dataclasses.replace(items[0], table_start=2, table_slots=list(range(102, 106)))  # table 3 slots behind
    assert pad_decode([behind], 1, pad_row=5).table == [[3, 3, 3], [2, 3, 4], [102, 103, 104]]
    with pytest.raises(CudaGraphError, match="new slot at position 5"):
        pad_decode([dataclasses.replace(behind, table_slots=[102, 103, 104, 999])], 1, pad_row=5)
    with pytest.raises(CudaGraphError, match="exactly one new token"):
        pad_decode([_item(0, 0, [1, 2], [1, 2])], 2, pad_row=0)
    with pytest.raises(CudaGraphError, match="padded batch size"):
        pad_decode(items, 1, pad_row=0)


# --- the graph runner on CPU (EagerGraph) ---------------------------------------------------

def _runner(backend: str, device: str, dtype: torch.dtype = torch.float32) -> ModelRunner:
    model = load_model(TINY, None, load_format="dummy", dtype=dtype, device=device, max_positions=64, seed=5)
    pool = KVPool(NUM_SLOTS, TINY.num_hidden_layers, TINY.num_key_value_heads, TINY.head_dim, dtype, device)
    table = make_req_to_token(TABLE_ROWS, TABLE_WIDTH, device)
    attn = default_registry().create(backend, pool, table)
    return ModelRunner(model, pool, table, attn, torch.device(device))


def _greedy_run(
    runner: ModelRunner, steps: int, follow: list[list[int]] | None = None
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefills 5 prompts in rows 0..4 (row 0 is also the padding row), then decodes with a
    changing batch: all 5, then 3, 1, 2, 4 ... (sizes that are captured, padded, and too big).
    Greedy, or feeding the tokens of `follow` (a reference run's sequences) when given."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist() for n in (9, 4, 17, 1, 6)]
    slot_sets = [list(range(1 + 60 * i, 1 + 60 * i + 40)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    logits = runner.forward(ScheduleDecision("extend", [_item(i, 0, s, slot_sets[i]) for i, s in enumerate(seqs)]))
    for s, nxt in zip(seqs, logits.argmax(-1).tolist(), strict=True):
        s.append(nxt)
    schedule = [[0, 1, 2, 3, 4], [1, 2, 4], [3], [0, 4], [4, 2, 1, 0], [2], [0, 1, 2, 3, 4], [1, 3, 0]]
    out: list[torch.Tensor] = []
    for rows in (schedule * steps)[:steps]:
        items = [_item(r, len(seqs[r]) - 1, [seqs[r][-1]], slot_sets[r]) for r in rows]
        logits = runner.forward(ScheduleDecision("decode", items))
        out.append(logits.cpu())
        for r, nxt in zip(rows, logits.argmax(-1).tolist(), strict=True):
            seqs[r].append(follow[r][len(seqs[r])] if follow is not None else nxt)
    return out, seqs


CPU_CASES = [pytest.param("torch_native", 4, 12, id="torch_native-4"), pytest.param("torch_native", 8, 12, id="torch_native-8")]
if os.environ.get("TRITON_INTERPRET") == "1":  # the child process of test_triton_backend_under_interpreter
    CPU_CASES = [pytest.param("triton", 4, 8, id="interpret-triton-4")]


@pytest.mark.parametrize(("backend", "max_bs", "steps"), CPU_CASES)
def test_eager_graph_runner_matches_the_eager_runner(backend: str, max_bs: int, steps: int) -> None:
    eager = _runner(backend, "cpu")
    ref_logits, ref_seqs = _greedy_run(eager, steps)
    graphed = _runner(backend, "cpu")
    graphs = DecodeGraphRunner(graphed, max_bs, pad_row=0, graph_factory=EagerGraph)
    graphs.capture()
    assert sorted(graphs.graphs) == capture_batch_sizes(max_bs)
    graphed.cuda_graph = graphs
    got_logits, got_seqs = _greedy_run(graphed, steps)
    assert got_seqs == ref_seqs
    last = got_logits[-1]  # the graph's own argmax of its last replay
    assert graphs.greedy_ids[: len(last)].tolist() == last.argmax(-1).tolist()
    for got, ref in zip(got_logits, ref_logits, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # padding rows wrote only the padding slot: every real slot holds what the eager run stored
    assert torch.equal(graphed.req_to_token, eager.req_to_token)
    used = eager.req_to_token[eager.req_to_token > 0].long().unique()
    assert used.numel() > 60 and PAD_SLOT not in used.tolist()
    for layer in range(TINY.num_hidden_layers):
        for cache in ("k_cache", "v_cache"):
            got, ref = getattr(graphed.kv_pool, cache)[layer], getattr(eager.kv_pool, cache)[layer]
            torch.testing.assert_close(got[used], ref[used], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already the interpreter child")
def test_triton_backend_under_interpreter() -> None:
    """The triton backend's decode (graph-safe plan, scratch made by the warm-up) through the
    graph runner, on the CPU under Triton's interpreter, in a child (it must be set before
    triton is imported)."""
    pytest.importorskip("triton")
    proc = pytest_under_interpreter(__file__)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_graph_runner_only_takes_decode_batches_it_captured() -> None:
    runner = _runner("torch_native", "cpu")
    graphs = DecodeGraphRunner(runner, 2, graph_factory=EagerGraph)
    one = _item(0, 0, [3], [1])
    assert not graphs.can_run(ScheduleDecision("decode", [one]))  # nothing captured yet
    graphs.capture()
    assert graphs.can_run(ScheduleDecision("decode", [one]))
    assert not graphs.can_run(ScheduleDecision("extend", [one]))
    assert not graphs.can_run(ScheduleDecision("decode", [one, _item(1, 0, [3], [2]), _item(2, 0, [3], [3])]))
    # the graph's argmax serves only steps whose every row wants logits; otherwise nothing runs
    replays = graphs.num_replays
    assert graphs.forward_greedy(ScheduleDecision("decode", [_item(0, 0, [3], [1], logits=False)])) is None
    assert graphs.num_replays == replays
    with pytest.raises(CudaGraphError, match="pad_row"):
        DecodeGraphRunner(runner, 2, pad_row=TABLE_ROWS, graph_factory=EagerGraph)
    with pytest.raises(CudaGraphError, match="CUDA device"):
        DecodeGraphRunner(runner, 2)


def test_graphs_are_off_on_cpu_when_disabled_and_with_tensor_parallelism(caplog: pytest.LogCaptureFixture) -> None:
    runner = _runner("torch_native", "cpu")
    rc = ServerConfig(max_running_requests=TABLE_ROWS)
    assert maybe_decode_graph_runner(rc, runner) is None  # CPU: eager decode
    runner.device = torch.device("cuda")  # only the flags are read before capturing
    with caplog.at_level(logging.INFO, logger="lmserver.runner.cuda_graph"):
        assert maybe_decode_graph_runner(rc.replace(disable_cuda_graph=True), runner) is None
        assert maybe_decode_graph_runner(rc.replace(enable_tp_cuda_graph=False), runner, tp_size=2) is None
    assert "--disable-cuda-graph" in caplog.text and "tp_size=2" in caplog.text


# --- KV sizing ------------------------------------------------------------------------------

def test_estimate_weight_bytes_counts_the_built_model() -> None:
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = load_model(TINY, None, load_format="dummy", dtype=torch_dtype, max_positions=64)
        tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
        expected = sum(t.numel() * t.element_size() for t in tensors.values())
        assert estimate_weight_bytes(TINY, dtype, 64) == expected
        assert estimate_weight_bytes(TINY, dtype, 64, tp_size=2) == expected // 2


def test_gpu_kv_budget_is_the_fraction_left_after_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * gib, 80 * gib))  # 10 GiB in use
    per_slot = KVPool.bytes_per_slot(TINY.num_hidden_layers, TINY.num_key_value_heads, TINY.head_dim, torch.bfloat16)
    weights = estimate_weight_bytes(TINY, "bfloat16", 64)
    cfg = ServerConfig(mem_fraction_static=0.5, context_length=64)
    assert resolve_kv_tokens(cfg, TINY, "cuda", "bfloat16", 0) == (40 * gib - 10 * gib - weights) // per_slot
    assert resolve_kv_tokens(cfg, TINY, "cuda", "bfloat16", 3 * gib) == (27 * gib) // per_slot
    with pytest.raises(ConfigError, match="not enough GPU memory"):
        resolve_kv_tokens(ServerConfig(mem_fraction_static=0.1), TINY, "cuda", "bfloat16", 0)
    with pytest.raises(ConfigError, match="mem_fraction_static must be in"):
        resolve_kv_tokens(ServerConfig(mem_fraction_static=1.5), TINY, "cuda", "bfloat16", 0)
    assert resolve_kv_tokens(ServerConfig(max_total_tokens=4096), TINY, "cuda", "bfloat16", 0) == 4096


# --- real CUDA graphs -----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_match_eager_on_gpu(backend: str, dtype: torch.dtype) -> None:
    eager = _runner(backend, "cuda", dtype)
    ref_logits, ref_seqs = _greedy_run(eager, 16)
    graphed = _runner(backend, "cuda", dtype)
    graphs = DecodeGraphRunner(graphed, 4)
    graphs.capture()
    graphed.cuda_graph = graphs
    # NOTE: fed the eager run's tokens: a padded batch may take other GEMM kernels than the
    # eager one (bf16 rounding), so only the logits are compared, and greedy tokens in float32.
    got_logits, _ = _greedy_run(graphed, 16, follow=ref_seqs)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for got, ref in zip(got_logits, ref_logits, strict=True):
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    if dtype == torch.float32:
        assert _greedy_run(graphed, 16)[1] == ref_seqs


@pytest.mark.gpu
def test_engine_greedy_output_same_with_and_without_cuda_graphs(tmp_path: Path) -> None:
    """A tiny random Llama (no embedded model needed on the GPU machine), one prompt at a time: those of 3-4 words
    take the graph extends, the 12-word one runs eagerly."""
    from lmserver.engine.offline import Engine
    from lmserver.testing.tiny_llama import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny")
    prompts = ["w5 w17 w300 w41", "w100 w101 w102", " ".join(f"w{i}" for i in range(200, 212))]
    params = {"max_new_tokens": 24, "temperature": 0}
    texts = {}
    for disable in (True, False):
        engine = Engine(model_path=str(folder), dtype="float32", attention_backend="triton",
                        disable_cuda_graph=disable, cuda_graph_max_bs=4, max_total_tokens=8192)
        graphs = engine.core.runner.cuda_graph
        assert (graphs is None) == disable
        texts[disable] = [engine.generate(p, params)["output_ids"] for p in prompts]  # type: ignore[index]
        assert graphs is None or graphs.num_extend_replays == 2
        engine.shutdown()
    assert texts[True] == texts[False]


def test_graph_max_bs_auto_depends_on_gpu_memory_and_running_requests() -> None:
    from lmserver.runner.resolve import resolve_cuda_graph_max_bs

    h200, l4 = 141 << 30, 24 << 30
    assert resolve_cuda_graph_max_bs(None, "cuda", h200, 256) == 256
    assert resolve_cuda_graph_max_bs(None, "cuda", h200, 48) == 48  # never above max_running_requests
    assert resolve_cuda_graph_max_bs(None, "cuda", l4, 256) == 32
    assert resolve_cuda_graph_max_bs(None, "cpu", 0, 64) == 32
    assert resolve_cuda_graph_max_bs(16, "cuda", h200, 256) == 16  # an explicit value wins
    with pytest.raises(ConfigError, match="cuda_graph_max_bs"):
        resolve_cuda_graph_max_bs(0, "cuda", h200, 256)


# --- speculative verify steps replayed as decode rows ---------------------------------------

def _verify_item(row: int, prefix: int, ids: list[int], slots: list[int], behind: int = 0) -> ForwardItem:
    """A verify item as Scheduler.add_drafts makes it: the last token and drafts, every row's logits;
    `behind`: table writes start that many positions before the first new token."""
    n = len(ids)
    return ForwardItem(
        rid=f"r{row}", req_pool_idx=row, prefix_len=prefix, token_ids=ids, out_slots=slots[prefix : prefix + n],
        table_start=prefix - behind, table_slots=slots[prefix - behind : prefix + n], logit_offsets=list(range(n)),
        completes_prefill=False,
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=4))
def test_verify_rows_are_decode_rows_with_the_same_writes(reqs: list[tuple[int, int, int]]) -> None:
    items = []
    for row, (prefix, n, behind) in enumerate(reqs):
        slots = list(range(1000 * (row + 1), 1000 * (row + 1) + 40))
        items.append(_verify_item(row, prefix, list(range(100 * row, 100 * row + n)), slots, min(behind, prefix)))
    rows = verify_rows(items)
    assert len(rows) == sum(len(it.token_ids) for it in items)
    step = pad_decode(rows, len(rows), pad_row=0)  # every row is a valid decode row
    # naive oracle: each request's table writes, and its tokens at consecutive positions, in order
    want_writes, got_writes = {}, {}
    for it in items:
        want_writes.update({(it.req_pool_idx, it.table_start + k): s for k, s in enumerate(it.table_slots)})
    for r in rows:
        got_writes.update({(r.req_pool_idx, r.table_start + k): s for k, s in enumerate(r.table_slots)})
    assert got_writes == want_writes
    want_rows = [(it.req_pool_idx, it.prefix_len + j, t, it.out_slots[j])
                 for it in items for j, t in enumerate(it.token_ids)]
    assert list(zip(step.ints[3], step.ints[1], step.ints[0], step.ints[2], strict=True)) == want_rows
    assert step.seq_lens == [p + 1 for _, p, _, _ in want_rows]
    bad = dataclasses.replace(items[0], out_slots=items[0].out_slots[:-1] + [1, 2])
    with pytest.raises(CudaGraphError, match="verify item"):
        verify_rows([bad])
    # the graph runner's path: the padded arrays straight from the verify items, equal to the per-row items' padding
    for extra in (0, 3):
        assert pad_verify(items, len(rows) + extra, pad_row=7) == pad_decode(rows, len(rows) + extra, pad_row=7)
    for broken in (bad, dataclasses.replace(items[0], out_slots=[s + 1 for s in items[0].out_slots])):
        with pytest.raises(CudaGraphError, match="verify item"):
            pad_verify([broken], 8, pad_row=0)
    with pytest.raises(CudaGraphError, match="padded batch size"):
        pad_verify(items, len(rows) - 1, pad_row=0)


def _verify_run(runner: ModelRunner, graphs: DecodeGraphRunner | None) -> list[torch.Tensor]:
    """Prefills 3 prompts, then verify steps with 1-4 drafts per request (drafts are the tokens
    a reference sequence continues with, or random ones), through `graphs` when given, else the
    eager extend forward; returns every verify step's logits."""
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist() for n in (7, 3, 12)]
    slot_sets = [list(range(1 + 60 * i, 1 + 60 * i + 50)) for i in range(len(seqs))]
    runner.forward(ScheduleDecision("extend", [_item(i, 0, s, slot_sets[i]) for i, s in enumerate(seqs)]))
    out = []
    for step in range(4):
        items = []
        for r, s in enumerate(seqs):
            n = 1 + (step + r) % 4
            s.extend(torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist())
            items.append(_verify_item(r, len(s) - n, s[-n:], slot_sets[r]))
        decision = ScheduleDecision("extend", items[: 1 + step % 3])
        if graphs is not None:
            assert graphs.can_verify(decision)
            logits = graphs.forward_verify(decision, greedy=False).clone()
            assert graphs.greedy_ids[: logits.shape[0]].tolist() == logits.argmax(-1).tolist()
        else:
            logits = runner.forward(decision)
        out.append(logits.cpu())
        for it, s in zip(items, seqs, strict=True):  # rejected: the next step writes over the last draft
            if it in decision.items:
                del s[len(s) - 1 :]
            else:
                del s[len(s) - len(it.token_ids) :]
    return out


@pytest.mark.parametrize("backend", ["torch_native"])
def test_graph_verify_matches_the_eager_extend_forward(backend: str) -> None:
    ref = _verify_run(_runner(backend, "cpu"), None)
    graphed = _runner(backend, "cpu")
    graphs = DecodeGraphRunner(graphed, 16, pad_row=0, graph_factory=EagerGraph)
    graphs.capture()
    got = _verify_run(graphed, graphs)
    assert graphs.num_verify_replays == len(ref)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    too_many = ScheduleDecision("extend", [_verify_item(r, 0, [1] * 6, list(range(1, 40))) for r in range(3)])
    assert not graphs.can_verify(too_many)  # 18 rows > 16 captured
    assert not graphs.can_verify(ScheduleDecision("extend", [_item(0, 0, [1, 2, 3], list(range(1, 9)))]))  # a prefill


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_graph_verify_matches_eager_on_gpu(backend: str) -> None:
    ref = _verify_run(_runner(backend, "cuda"), None)
    graphed = _runner(backend, "cuda")
    graphs = DecodeGraphRunner(graphed, 16)
    graphs.capture()
    got = _verify_run(graphed, graphs)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


# --- short extends replayed as decode rows --------------------------------------------------

def _extend_steps() -> list[tuple[ScheduleDecision, bool]]:
    """Extend decisions over rows 1..4 (row 0 pads), each with whether a graph of 16 rows within 200 reads takes
    it: fresh prompts (one and several requests), a radix hit's suffix (table writes from 0: the shared prefix's
    slots go into the row too), a chunk that wants no logits, one that wants every row's (input logprobs), a mixed
    step (decode rows beside a prompt), and ones over the row and read limits."""
    gen = torch.Generator().manual_seed(4)

    def ids(n: int) -> list[int]:
        return torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist()

    slots = {r: list(range(1 + 60 * r, 1 + 60 * r + 48)) for r in range(1, 5)}

    def hit(row: int, shared: int, prefix: int, n: int) -> ForwardItem:  # `prefix` slots of row `shared`
        new = slots[row][prefix:prefix + n]
        return ForwardItem(rid=f"r{row}", req_pool_idx=row, prefix_len=prefix, token_ids=ids(n), out_slots=new,
                           table_start=0, table_slots=slots[shared][:prefix] + new, logit_offsets=list(range(n)),
                           completes_prefill=True)

    return [
        (ScheduleDecision("extend", [_item(1, 0, ids(9), slots[1])]), True),
        (ScheduleDecision("extend", [_item(2, 0, ids(5), slots[2]), _item(3, 0, ids(3), slots[3])]), True),
        (ScheduleDecision("extend", [_item(1, 9, ids(4), slots[1], logits=False)]), True),  # a chunk: no logits
        (ScheduleDecision("extend", [hit(4, 2, 5, 6)]), True),  # row 4 over row 2's 5 prompt slots
        (ScheduleDecision("extend", [_item(2, 5, ids(1), slots[2]), _item(3, 3, ids(7), slots[3]),
                                     _item(1, 13, ids(1), slots[1])]), True),  # decode rows beside a prompt chunk
        (ScheduleDecision("extend", [_item(4, 11, ids(17), slots[4])]), False),  # 17 rows > 16
        (ScheduleDecision("extend", [_item(3, 10, ids(10), slots[3])]), False),  # 10 x 20 = 200 reads: fits ...
        (ScheduleDecision("extend", [_item(2, 6, ids(12), slots[2])]), False),  # 12 x 18 = 216 > 200
    ]


def _check_graph_extends(backend: str, device: str, graph_factory: Any, tol: float) -> None:
    eager = _runner(backend, device)
    graphed = _runner(backend, device)
    graphs = DecodeGraphRunner(graphed, 16, pad_row=0, graph_factory=graph_factory, extend_max_reads=200)
    graphs.capture()
    graphed.cuda_graph = graphs
    steps = _extend_steps()
    steps[6] = (steps[6][0], True)  # exactly at the read limit
    for decision, graph_takes in steps:
        assert graphs.can_run_extend(decision) == graph_takes, decision
        before = graphs.num_extend_replays
        got, want = graphed.forward(decision), eager.forward(decision)
        assert graphs.num_extend_replays == before + graph_takes
        assert got.shape == want.shape == (sum(len(it.logit_offsets) for it in decision.items), TINY.vocab_size)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the same table rows and, slot for slot, the same K / V (padding rows wrote only the padding slot)
    assert torch.equal(graphed.req_to_token, eager.req_to_token)
    used = eager.req_to_token[eager.req_to_token > 0].long().unique()
    assert PAD_SLOT not in used.tolist()
    for layer in range(TINY.num_hidden_layers):
        for cache in ("k_cache", "v_cache"):
            got_kv, ref_kv = getattr(graphed.kv_pool, cache)[layer], getattr(eager.kv_pool, cache)[layer]
            torch.testing.assert_close(got_kv[used], ref_kv[used], atol=tol, rtol=tol)


def test_graph_extends_match_the_eager_extend_forward() -> None:
    _check_graph_extends("torch_native", "cpu", EagerGraph, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_graph_extends_match_eager_on_gpu(backend: str) -> None:
    _check_graph_extends(backend, "cuda", None, 1e-4)


def test_graph_extends_are_off_by_default_and_refuse_what_decode_rows_cannot_be() -> None:
    runner = _runner("torch_native", "cpu")
    graphs = DecodeGraphRunner(runner, 8, pad_row=0, graph_factory=EagerGraph)
    graphs.capture()
    prompt = ScheduleDecision("extend", [_item(1, 0, [3, 4, 5], list(range(1, 9)))])
    assert not graphs.can_run_extend(prompt)  # extend_max_reads 0: the decode graph runner alone
    graphs.extend_max_reads = 10**6
    assert graphs.can_run_extend(prompt)
    assert not graphs.can_run_extend(ScheduleDecision("decode", prompt.items))
    behind = dataclasses.replace(prompt.items[0], table_slots=[7, 8, 9])  # table writes not ending with its slots
    assert not graphs.can_run_extend(ScheduleDecision("extend", [behind]))
    image = dataclasses.replace(prompt.items[0], mm_spans=((0, 2, 0),))  # type: ignore[arg-type]
    assert not graphs.can_run_extend(ScheduleDecision("extend", [image]))


def test_graph_extends_defer_to_the_lowlat_plugins_rows() -> None:
    """With a lowlat plugin: an extend takes a graph only where `verify_graph` names one and, for a decode graph, the
    plugin launches rows of one request as it launches decode rows (`needs_verify_graph` False)."""
    from lowlat.spec import StepKind

    class Plugin:  # the two questions LowlatHook answers, scripted
        def __init__(self, kind: StepKind | None, differs: bool) -> None:
            self.kind, self.differs, self.asked = kind, differs, []

        def verify_graph(self, bs: int, rows: int, width: int) -> StepKind | None:
            self.asked.append((bs, rows))
            return self.kind

        def needs_verify_graph(self, bs: int, rows: int, width: int) -> bool:
            return self.differs

    runner = _runner("torch_native", "cpu")
    graphs = DecodeGraphRunner(runner, 8, pad_row=0, graph_factory=EagerGraph, extend_max_reads=10**6)
    graphs.capture()
    prompt = ScheduleDecision("extend", [_item(1, 0, [3, 4, 5], list(range(1, 9)))])
    for kind, differs, want in ((StepKind.DECODE, False, True), (StepKind.DECODE, True, False), (None, False, False)):
        runner.lowlat = Plugin(kind, differs)  # type: ignore[assignment]
        assert graphs.can_run_extend(prompt) == want, (kind, differs)
        assert runner.lowlat.asked == [(4, 3)]  # type: ignore[union-attr]  # 3 rows of one request, padded to 4
    runner.lowlat = None


def test_served_graphs_take_short_extends_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV, EXTEND_MAX_READS

    monkeypatch.setenv(EAGER_GRAPHS_ENV, "1")
    config = ServerConfig(cuda_graph_max_bs=4, max_running_requests=4)
    for enable, tp_size, want in ((True, 1, EXTEND_MAX_READS), (False, 1, 0), (True, 2, 0)):
        graphs = maybe_decode_graph_runner(config.replace(enable_cuda_graph_extend=enable),
                                           _runner("torch_native", "cpu"), tp_size)
        assert graphs is not None and graphs.extend_max_reads == want
    graphs = maybe_decode_graph_runner(config.replace(cuda_graph_extend_max_reads=1000), _runner("torch_native", "cpu"))
    assert graphs is not None and graphs.extend_max_reads == 1000  # --cuda-graph-extend-max-reads
    with pytest.raises(CudaGraphError, match="cuda_graph_extend_max_reads"):
        maybe_decode_graph_runner(config.replace(cuda_graph_extend_max_reads=0), _runner("torch_native", "cpu"))


def _engine_outputs(core: object) -> dict[str, tuple[list[int], list[float]]]:
    """Greedy requests through `core` (an EngineCore): prompts sharing a prefix (radix hits), one longer than a
    prefill chunk, one with input logprobs, one arriving while the others decode (a mixed step)."""
    from lmserver.io_struct import GenerateReq, SamplingParams

    base = [(17 * i) % 900 + 5 for i in range(30)]
    prompts = {"a": base, "b": base + [7, 8, 9], "c": base[:12] + [300 + i for i in range(50)], "d": [11, 12, 13]}
    out: dict[str, tuple[list[int], list[float]]] = {}

    def add(rid: str) -> None:
        core.add_request(GenerateReq(  # type: ignore[attr-defined]
            rid=rid, input_ids=prompts[rid], return_logprob=rid == "b", logprob_start_len=0 if rid == "b" else -1,
            sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)))
        out[rid] = ([], [])

    add("a")
    steps = 0
    while core.has_work():  # type: ignore[attr-defined]
        for o in core.step():  # type: ignore[attr-defined]
            out[o.rid][0].extend(o.new_token_ids)
            if o.input_token_logprobs:
                out[o.rid][1].extend(lp[0] for lp in o.input_token_logprobs if lp[0] is not None)
        steps += 1
        if steps == 2:
            for rid in ("b", "c", "d"):
                add(rid)
    return out


def test_engine_outputs_same_with_extends_in_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmserver.engine.core import EngineCore
    from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV

    monkeypatch.setenv(EAGER_GRAPHS_ENV, "1")  # CPU runners get EagerGraph graphs
    results, replays = {}, {}
    for disable in (True, False):
        core = EngineCore(ServerConfig(dtype="float32", max_total_tokens=2048, max_running_requests=8,
                                       context_length=96, cuda_graph_max_bs=8, chunked_prefill_size=24,
                                       enable_cuda_graph_extend=not disable))
        graphs = core.runner.cuda_graph
        assert graphs is not None
        results[disable] = _engine_outputs(core)
        replays[disable] = graphs.num_extend_replays
    assert replays[True] == 0 < replays[False]
    for rid, (ids, lps) in results[True].items():
        got_ids, got_lps = results[False][rid]
        assert got_ids == ids and len(ids) == 4, rid
        assert got_lps == pytest.approx(lps, abs=1e-4), rid
    assert len(results[False]["b"][1]) > 20  # the input logprobs came through a graph's rows too
