"""Cascade decode attention in the engine: the shared-prefix planner (host, hypothesis), the
`triton` backend with cascade metadata against `torch_native`, and greedy tokens of a tiny random
Llama with cascade on equal to `torch_native`'s (eager forwards and the decode-graph runner).

The triton cases run on CUDA (`gpu`) and on the CPU in a TRITON_INTERPRET=1 child process that
`test_cascade_triton_in_a_child_process` starts; the planner cases run here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.kernels.testing import kernel_devices
from lmserver.runner.attention.shared_prefix import SharedPrefixPlanner

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = kernel_devices()


@pytest.mark.skipif(INTERPRET, reason="this is the parent of the interpreter run")
def test_cascade_triton_in_a_child_process() -> None:
    pytest.importorskip("triton")
    from lmserver.kernels.testing import assert_interpreter_run_passed, pytest_under_interpreter

    proc = pytest_under_interpreter(Path(__file__))
    assert_interpreter_run_passed(proc)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the parent of the interpreter run")
def test_long_cascade_triton_cases_in_a_child_process() -> None:
    pytest.importorskip("triton")
    from lmserver.kernels.testing import SLOW_CASES, assert_interpreter_run_passed, pytest_under_interpreter

    proc = pytest_under_interpreter(Path(__file__), marks=SLOW_CASES)
    assert_interpreter_run_passed(proc)


# --- the planner (host only) ---------------------------------------------------------------


@dataclass(frozen=True)
class _Write:  # the table-write fields of a scheduler ForwardItem
    req_pool_idx: int
    table_start: int
    table_slots: list[int]


@st.composite
def _tables(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    """Rows built from a random trie of slot runs (shared prefixes at several depths), and for
    each row how many of its first slots the prefill writes (the rest are decode appends)."""
    counter = iter(range(1, 10**6))
    runs = {(): []}  # node -> its own slots
    nodes = [()]
    for _ in range(draw(st.integers(1, 8))):
        parent = draw(st.sampled_from(nodes))
        node = (*parent, len(nodes))
        runs[node] = [next(counter) for _ in range(draw(st.integers(1, 40)))]
        nodes.append(node)
    rows, prefill = [], []
    for _ in range(draw(st.integers(1, 12))):
        node = draw(st.sampled_from(nodes))
        slots = [s for depth in range(len(node) + 1) for s in runs[node[:depth]]]
        slots += [next(counter) for _ in range(draw(st.integers(1, 10)))]  # own tokens
        rows.append(slots)
        prefill.append(draw(st.integers(1, len(slots))))
    return rows, prefill


@settings(max_examples=150, deadline=None)
@given(_tables(), st.randoms(use_true_random=False), st.integers(1, 20), st.integers(0, 30))
def test_planner_groups_share_their_prefix(case: tuple[list[list[int]], list[int]], rnd: object,
                                           min_prefix: int, cost: int) -> None:
    import random

    assert isinstance(rnd, random.Random)
    rows, prefill = case
    width = max(map(len, rows)) + 2
    planner = SharedPrefixPlanner(len(rows) + 2, width, min_prefix_len=min_prefix, group_cost_tokens=cost,
                                  min_saved_tokens=1)
    truth = np.zeros((len(rows) + 2, width), dtype=np.int64)
    table_rows = rnd.sample(range(len(rows) + 2), len(rows))
    # stale contents of a previous request on some rows (longer than the new one): must not leak
    for r in table_rows[: len(rows) // 2]:
        stale = [10**6 + rnd.randrange(100) for _ in range(width)]
        planner.record(r, 0, stale)
        truth[r] = stale
    for r, slots, n in zip(table_rows, rows, prefill, strict=True):
        planner.record(r, 0, slots[:n])  # the prefill
        truth[r, :n] = slots[:n]
        # decode appends, one token a step (not mirrored), sometimes with a rewrite of earlier columns
        for pos in range(n, len(slots)):
            start = pos if rnd.random() < 0.8 else rnd.randrange(pos + 1)
            planner.record_decode([_Write(r, start, slots[start : pos + 1])])
            truth[r, start : pos + 1] = slots[start : pos + 1]
    batch = list(range(len(rows)))
    rnd.shuffle(batch)
    seq_lens = [len(rows[b]) for b in batch]
    plan = planner.plan([table_rows[b] for b in batch], seq_lens)
    if plan is None:
        return
    seen: set[int] = set()
    saved = 0
    for members, p in plan.groups:
        assert len(members) >= 2 and p >= min_prefix and not seen & set(members)
        seen.update(members)
        saved += (len(members) - 1) * p
        first = truth[table_rows[batch[members[0]]], :p]
        for m in members:
            assert p <= seq_lens[m]
            assert (truth[table_rows[batch[m]], :p] == first).all()
    assert saved == plan.saved_tokens


def test_planner_finds_prompt_groups_behind_a_shared_first_token() -> None:
    """4 groups x 5 rows share 300 tokens each, and all 20 rows their first token (a BOS page):
    the plan is the 4 groups, each with its 300 tokens, whatever the batch order."""
    rng = np.random.default_rng(0)
    planner = SharedPrefixPlanner(24, 512, min_saved_tokens=1)
    rows = rng.permutation(24)[:20].tolist()
    batch_groups: list[list[int]] = [[] for _ in range(4)]
    order = rng.permutation(20).tolist()
    for b, who in enumerate(order):
        g = who // 5
        slots = [1, *range(1000 * (g + 1), 1000 * (g + 1) + 299), *range(50000 + 100 * who, 50000 + 100 * who + 40)]
        planner.record(rows[b], 0, slots)
        batch_groups[g].append(b)
    plan = planner.plan(rows, [339] * 20)
    assert plan is not None
    assert sorted((sorted(m), p) for m, p in plan.groups) == sorted((sorted(g), 300) for g in batch_groups)


def test_planner_caches_and_restricts() -> None:
    planner = SharedPrefixPlanner(8, 64, min_prefix_len=4, group_cost_tokens=0, min_saved_tokens=10)
    shared = list(range(100, 120))
    for r in range(6):
        planner.record(r, 0, [*shared, 200 + r])
    first = planner.plan([0, 1, 2, 3, 4, 5], [22] * 6)
    assert first is not None and first.groups == (((0, 1, 2, 3, 4, 5), 20),)
    # decode appends at the rows' ends: not mirrored, the same plan object
    planner.record_decode([_Write(r, 21, [300 + r]) for r in range(6)])
    assert planner.plan([0, 1, 2, 3, 4, 5], [23] * 6) is first and planner.num_plans == 1
    # rows 1 and 4 finished: the plan restricted to the others (batch rows renumbered), no new plan
    kept = planner.plan([0, 2, 3, 5], [24] * 4)
    assert kept is not None and kept.groups == (((0, 1, 2, 3), 20),) and planner.num_plans == 1
    # too little left to share: None
    assert planner.plan([0, 5], [24] * 2) is not None
    assert planner.plan([5], [24]) is None
    # a rewrite over mirrored columns (row 3 got other slots from column 10): planned again
    planner.record_decode([_Write(3, 10, list(range(900, 912)))])
    again = planner.plan([0, 2, 3, 5], [24] * 4)
    # (rows 0, 2, 5 share 20 tokens: 40 saved; all four share 10: 30 saved)
    assert planner.num_plans == 2 and again is not None and again.groups == (((0, 1, 3), 20),)


# --- the triton backend and the engine (interpreter child or CUDA) ------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_triton_backend_with_cascade_matches_torch_native(device: str) -> None:
    from lmserver.forward.batch import AttentionLayer, ForwardMode
    from lmserver.forward.kv_pool import KVPool, make_req_to_token
    from lmserver.kernels.testing import rel_error
    from lmserver.runner.attention.testing import step_batch
    from lmserver.runner.attention.torch_native import TorchNativeBackend
    from lmserver.runner.attention.triton_backend import TritonBackend

    heads, kv_heads, dim = 9, 3, 64
    g = torch.Generator().manual_seed(3)
    num_slots, width = 600, 200
    pools = [KVPool(num_slots, 2, kv_heads, dim, torch.float32, device) for _ in range(2)]
    for layer in range(2):
        for name in ("k_cache", "v_cache"):
            noise = torch.randn(num_slots, kv_heads, dim, generator=g)
            for pool in pools:
                getattr(pool, name)[layer].copy_(noise)
    tables = [make_req_to_token(10, width, device) for _ in range(2)]
    planner = SharedPrefixPlanner(10, width, min_prefix_len=8, group_cost_tokens=0, min_saved_tokens=1)
    # two prompt groups (prefix 70 over rows 1, 4, 6 and prefix 45 over rows 2, 8), one lone row 5
    layout = {1: (0, 70, 20), 4: (0, 70, 3), 6: (0, 70, 41), 2: (1, 45, 9), 8: (1, 45, 60), 5: (2, 0, 33)}
    perm = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    prefixes = {0: perm[:70], 1: perm[70:115], 2: []}
    own = perm[115:]
    rows, lens = [6, 2, 5, 1, 8, 4], []
    for r in rows:
        grp, p, n = layout[r]
        slots = prefixes[grp] + [own.pop() for _ in range(n)]
        for table in tables:
            table[r, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        planner.record(r, 0, slots[:-1])
        lens.append(len(slots))
    groups = planner.plan(rows, lens)
    assert groups is not None and sorted(p for _, p in groups.groups) == [45, 70]
    ref, tri = TorchNativeBackend(pools[0], tables[0]), TritonBackend(pools[1], tables[1])
    loc = torch.tensor([int(tables[0][r, n - 1]) for r, n in zip(rows, lens, strict=True)])
    batch = step_batch(ForwardMode.DECODE, rows, [n - 1 for n in lens], [1] * len(rows), loc, device)
    ref.plan(batch)
    meta = tri.cascade_metadata(len(rows))
    meta.write(groups.groups)
    batch.cascade = meta
    tri.plan(batch)
    for layer_id in range(2):
        attn = AttentionLayer(layer_id, heads, kv_heads, dim, dim**-0.5)
        q = torch.randn(len(rows), heads, dim, generator=g).to(device)
        k = torch.randn(len(rows), kv_heads, dim, generator=g).to(device)
        v = torch.randn(len(rows), kv_heads, dim, generator=g).to(device)
        want, got = ref.forward(q, k, v, attn), tri.forward(q, k, v, attn)
        assert rel_error(got, want) < 1e-5


CONFIG = dict(
    vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, max_position_embeddings=160,
)


# 2 minutes under the interpreter: the slow tier on the CPU (the backend-level case above stays in the default tier)
@pytest.mark.parametrize("device", kernel_devices(slow_on_cpu=True))
def test_greedy_tokens_with_cascade_equal_torch_native(tmp_path: Path, device: str) -> None:
    """Five requests, four of them behind one shared 37-token prompt (their table rows name the
    same slots, as the radix cache hands them out), decoded greedily: the tokens of `triton` with
    cascade on (eager forwards, and the decode-graph runner with EagerGraph) equal `torch_native`'s,
    and the cascade path ran."""
    transformers = pytest.importorskip("transformers")
    from lmserver.forward.kv_pool import KVPool, make_req_to_token
    from lmserver.models.loader import load_model, read_model_config
    from lmserver.runner.attention.torch_native import TorchNativeBackend
    from lmserver.runner.attention.triton_backend import TritonBackend
    from lmserver.runner.cuda_graph import DecodeGraphRunner, EagerGraph
    from lmserver.runner.model_runner import ModelRunner
    from lmserver.scheduler import ForwardItem, ScheduleDecision

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.5)
    hf.save_pretrained(tmp_path / "tiny-llama")
    folder = tmp_path / "tiny-llama"
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(0, 128, (37,), generator=gen).tolist()
    prompts = [system + torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 9, 1, 5)]
    prompts.insert(2, torch.randint(0, 128, (20,), generator=gen).tolist())  # a request sharing nothing
    steps = 6 if device == "cpu" else 24
    shared_slots = list(range(1, 38))
    tokens: dict[str, list[list[int]]] = {}
    for mode in ("torch_native", "triton-eager", "triton-graphs"):
        config = read_model_config(folder)
        model = load_model(config, folder, dtype=torch.float32, device=device, max_positions=160)
        pool = KVPool(400, config.num_hidden_layers, config.num_key_value_heads, config.head_dim, torch.float32, device)
        table = make_req_to_token(8, 160, device)
        backend = TorchNativeBackend(pool, table) if mode == "torch_native" else TritonBackend(pool, table)
        runner = ModelRunner(model, pool, table, backend, torch.device(device))
        if mode != "torch_native":
            assert runner.enable_cascade()
            assert runner.prefix_planner is not None
            runner.prefix_planner.min_prefix_len, runner.prefix_planner.min_saved_tokens = 8, 1
        graphs = None
        if mode == "triton-graphs":
            graphs = DecodeGraphRunner(runner, 8, pad_row=7, graph_factory=EagerGraph)
            graphs.capture()
            runner.cuda_graph = graphs
        seqs = [list(p) for p in prompts]
        rows = [6, 1, 3, 0, 4]
        own = iter(range(40, 400))
        slot_lists = []
        for p in prompts:
            n_shared = 37 if p[:37] == system else 0
            slot_lists.append(shared_slots[:n_shared] + [next(own) for _ in range(len(p) - n_shared + steps)])
        # request 0 computes the system prompt; the others find it cached (prefix 37) and write their rows from 0
        items = []
        for i, p in enumerate(prompts):
            cached = 37 if (i > 0 and p[:37] == system) else 0
            s = slot_lists[i]
            items.append(ForwardItem(rid=f"r{i}", req_pool_idx=rows[i], prefix_len=cached, token_ids=p[cached:],
                                     out_slots=s[cached : len(p)], table_start=0, table_slots=s[: len(p)],
                                     logit_offsets=[len(p) - cached - 1], completes_prefill=True))
        logits = runner.forward(ScheduleDecision("extend", items[:1]))
        logits = torch.cat([logits, runner.forward(ScheduleDecision("extend", items[1:]))])
        for _ in range(steps):
            for s, nxt in zip(seqs, logits.argmax(-1).tolist(), strict=True):
                s.append(nxt)
            decode = [ForwardItem(rid=f"r{i}", req_pool_idx=rows[i], prefix_len=len(s) - 1, token_ids=[s[-1]],
                                  out_slots=[slot_lists[i][len(s) - 1]], table_start=len(s) - 1,
                                  table_slots=[slot_lists[i][len(s) - 1]], logit_offsets=[0], completes_prefill=False)
                      for i, s in enumerate(seqs)]
            logits = runner.forward(ScheduleDecision("decode", decode))
            if mode == "triton-eager":
                assert backend.cascade is not None  # type: ignore[attr-defined]
        if graphs is not None:
            assert graphs.num_cascade_replays == steps
        tokens[mode] = seqs
    assert tokens["triton-eager"] == tokens["torch_native"]
    assert tokens["triton-graphs"] == tokens["torch_native"]
