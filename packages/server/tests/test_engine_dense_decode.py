"""torch_native's dense decode copy against a direct per-request attention oracle.

Random schedules (hypothesis): requests join through EXTEND forwards (prefills, chunks),
decode together, finish (their rows and KV slots are reused by later requests), and decode
batches change composition without an EXTEND in between. Every forward's output must equal
softmax(q K^T) V over exactly the request's own slots, with the dense copy and with the plain
gather path (budget 0), and the pool must hold every stored k / v. A "plugin" step is planned
but its K/V reach the pool without the backend (as when a lowlat plugin serves the step).
"""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lmserver.forward.batch import AttentionLayer, ForwardBatch, ForwardMode
from lmserver.forward.kv_pool import KVPool, make_req_to_token
from lmserver.runner.attention.torch_native import TorchNativeBackend

HEADS, KV_HEADS, DIM, LAYERS, SLOTS, ROWS, WIDTH = 4, 2, 8, 2, 700, 6, 128


def _batch(mode: ForwardMode, rows: list[int], prefix: list[int], new: list[int], loc: list[int]) -> ForwardBatch:
    seq = [p + n for p, n in zip(prefix, new, strict=True)]
    batch = ForwardBatch(
        mode=mode, batch_size=len(rows), input_ids=torch.zeros(sum(new), dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new, strict=True)]),
        out_cache_loc=torch.tensor(loc, dtype=torch.int64), req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq, dtype=torch.int32), seq_lens_cpu=seq, req_pool_indices_cpu=list(rows),
    )
    if mode == ForwardMode.EXTEND:
        batch.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32)
        batch.extend_seq_lens = torch.tensor(new, dtype=torch.int32)
        batch.extend_start_loc = torch.tensor([sum(new[:i]) for i in range(len(new))], dtype=torch.int32)
        batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu = prefix, new
    return batch


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """q (n, H, D) at positions prefix.. over k, v (prefix + n, KV, D), causal -> (n, H * D)."""
    rep = HEADS // KV_HEADS
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (L, H, D)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk.double()) * scale
    pos = torch.arange(prefix, prefix + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    out = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv.double())
    return out.reshape(q.shape[0], HEADS * DIM).float()


# one schedule step: ("join", prompt lengths), ("decode" | "plugin", how many requests finish first)
STEP = st.one_of(
    st.tuples(st.just("join"), st.lists(st.integers(1, 12), min_size=1, max_size=3)),
    st.tuples(st.sampled_from(["decode", "decode", "plugin"]), st.integers(0, 2)),
)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(STEP, min_size=1, max_size=14), budget=st.sampled_from([0, 1 << 30]), seed=st.integers(0, 99))
@example(steps=[("join", [5, 5]), ("decode", 0), ("plugin", 0), ("decode", 0)], budget=1 << 30, seed=0)
@example(steps=[("join", [3, 9, 4]), ("decode", 0), ("decode", 1), ("join", [2]), ("decode", 0)], budget=1 << 30, seed=1)
def test_decode_attention_matches_the_oracle_across_batch_changes(
    steps: list[tuple[str, object]], budget: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(SLOTS, LAYERS, KV_HEADS, DIM, torch.float32, "cpu")
    for cache in (*pool.k_cache, *pool.v_cache):  # stale finite contents everywhere but slot 0
        cache[1:].copy_(torch.randn(SLOTS - 1, KV_HEADS, DIM, generator=g))
    table = make_req_to_token(ROWS, WIDTH, "cpu")
    backend = TorchNativeBackend(pool, table)
    backend.dense_budget_bytes = budget
    layers = [AttentionLayer(i, HEADS, KV_HEADS, DIM, DIM**-0.5) for i in range(LAYERS)]
    free_slots = (torch.randperm(SLOTS - 1, generator=g) + 1).tolist()
    free_rows = list(range(ROWS))
    live: dict[int, list[int]] = {}  # row -> KV slots of its tokens, in order
    for kind, arg in steps:
        if kind == "join":
            lens = [n for n in arg if free_rows][: len(free_rows)]  # type: ignore[attr-defined]
            rows = [free_rows.pop(0) for _ in lens]
            prefix = [0] * len(rows)
            new = lens
            mode = ForwardMode.EXTEND
        else:
            for row in sorted(live)[: int(arg)]:  # type: ignore[call-overload]
                free_slots.extend(live.pop(row))
                free_rows.append(row)
            rows = sorted(live)
            prefix = [len(live[r]) for r in rows]
            new = [1] * len(rows)
            mode = ForwardMode.DECODE
        if not rows or any(p + n > WIDTH for p, n in zip(prefix, new, strict=True)):
            continue
        loc: list[int] = []
        for row, p, n in zip(rows, prefix, new, strict=True):
            slots = [free_slots.pop() for _ in range(n)]
            live.setdefault(row, []).extend(slots)
            table[row, p : p + n] = torch.tensor(slots, dtype=torch.int32)
            loc += slots
        batch = _batch(mode, rows, prefix, new, loc)
        backend.plan(batch)
        if kind == "plugin":
            for layer in layers:
                k = torch.randn(len(loc), KV_HEADS, DIM, generator=g)
                pool.store(layer.layer_id, batch.out_cache_loc, k, torch.randn(len(loc), KV_HEADS, DIM, generator=g))
            continue
        for layer in layers:
            q = torch.randn(len(loc), HEADS, DIM, generator=g)
            k = torch.randn(len(loc), KV_HEADS, DIM, generator=g)
            v = torch.randn(len(loc), KV_HEADS, DIM, generator=g)
            out = backend.forward(q, k, v, layer)
            assert torch.equal(pool.k_cache[layer.layer_id][loc], k)
            assert torch.equal(pool.v_cache[layer.layer_id][loc], v)
            start = 0
            for row, p, n in zip(rows, prefix, new, strict=True):
                slots_t = torch.tensor(live[row])
                want = _oracle(
                    q[start : start + n], pool.k_cache[layer.layer_id][slots_t], pool.v_cache[layer.layer_id][slots_t],
                    p, layer.scaling,
                )
                torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
                start += n
        assert backend.use_dense == (mode == ForwardMode.DECODE and budget > 0)
