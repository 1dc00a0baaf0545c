"""Cascade (shared-prefix) decode attention against the float64 reference, on random group layouts.

The kernel cases run on CUDA (`gpu`) and on the CPU under Triton's interpreter, in a child
process that this file's `test_cascade_kernels_in_a_child_process` starts (TRITON_INTERPRET must
be set before triton is imported). The plan builder's properties run here, on the host.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.kernels import reference as ref
from lmserver.kernels.testing import (
    assert_interpreter_run_passed,
    kernel_devices,
    pytest_under_interpreter,
    rel_error,
)

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = kernel_devices()


@pytest.mark.skipif(INTERPRET, reason="this is the parent of the interpreter run")
def test_cascade_kernels_in_a_child_process() -> None:
    proc = pytest_under_interpreter(Path(__file__))
    assert_interpreter_run_passed(proc)


def shared_prefix_table(
    layout: list[tuple[int, list[int]]], width: int, spare_rows: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[tuple[list[int], int]], int]:
    """A request table for `layout` ((prefix length, seq_len of each member) per group: the
    members' rows hold the same random slots on [0, prefix), their own ones after it), the batch
    rows in random order. Returns (req_to_token, req_pool_indices, seq_lens, groups as batch
    rows, number of slots used + 1)."""
    members = [(g, n) for g, (_, lens) in enumerate(layout) for n in lens]
    order = torch.randperm(len(members), generator=generator).tolist()  # batch row -> member
    bs = len(members)
    total = sum(p for p, _ in layout) + sum(n for _, n in members)
    perm = (torch.randperm(total, generator=generator) + 1).tolist()  # slot 0 is padding
    table = torch.zeros(bs + spare_rows, width, dtype=torch.int32)
    table_rows = torch.randperm(bs + spare_rows, generator=generator)[:bs]
    prefix_slots = []
    for p, _ in layout:
        prefix_slots.append(perm[:p])
        del perm[:p]
    groups: list[list[int]] = [[] for _ in layout]
    seq_lens = []
    for b, m in enumerate(order):
        g, n = members[m]
        p = layout[g][0]
        assert n >= p
        row = int(table_rows[b])
        table[row, :p] = torch.tensor(prefix_slots[g], dtype=torch.int32)
        table[row, p:n] = torch.tensor(perm[: n - p], dtype=torch.int32)
        del perm[: n - p]
        groups[g].append(b)
        seq_lens.append(n)
    return table, table_rows.to(torch.int64), seq_lens, [(rows, layout[g][0]) for g, rows in enumerate(groups)], total + 1


# (prefix, seq_lens of the members) per group: groups of 1 (P 0 and P > 0), uneven sizes, P not a
# multiple of any block, P = seq_len - 1, P = seq_len, suffix lengths that differ per row
LAYOUTS_CPU = [
    [(37, [40, 38, 51, 90, 37]), (0, [13]), (20, [21, 45, 22]), (70, [71])],
    [(129, [130, 150]), (5, [6, 9, 7, 8, 30, 6, 11])],
]
LAYOUTS_GPU = [
    *LAYOUTS_CPU,
    [(2048, [2048 + 1 + (i * 37) % 300 for i in range(16)]) for _ in range(4)] + [(0, [700, 1])],
    [(1000, [1001 + i for i in range(21)]), (3, [4] * 40), (0, [5000])],
]


# the interpreter runs the SmolLM2 shape only (GQA 3, head_dim 64); CUDA runs Llama-3-8B's too
SHAPES = [pytest.param((9, 3, 64), id="smollm2")]
if not INTERPRET:
    SHAPES.append(pytest.param((32, 8, 128), id="llama3-8b"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cascade_matches_reference(device: str, shape: tuple[int, int, int]) -> None:
    from lmserver.kernels.cascade_decode import CascadeMetadata, cascade_decode_attention

    heads, kv_heads, dim = shape
    cpu = device == "cpu"
    dtypes = [torch.float32] if cpu else [torch.bfloat16, torch.float16]
    for i, layout in enumerate(LAYOUTS_CPU if cpu else LAYOUTS_GPU):
        for dtype in dtypes:
            g = torch.Generator().manual_seed(100 + i)
            width = max(n for _, lens in layout for n in lens) + 3
            table, rows, seq_lens, groups, num_slots = shared_prefix_table(layout, width, 2, g)
            bs = len(seq_lens)
            k_cache = torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype).to(device)
            v_cache = torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype).to(device)
            q = torch.randn(bs, heads, dim, generator=g).to(dtype).to(device)
            table, rows = table.to(device), rows.to(device)
            lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
            want = ref.decode_attention_ref(q, k_cache, v_cache, table, rows, lens_t, dim**-0.5)
            for chunk_rows, shared_splits, suffix_splits in ((2, 1, 1), (3, 4, 2)) if cpu else ((16, 4, 1), (5, 8, 4)):
                meta = CascadeMetadata(bs, max_work=bs + 4, num_shared_splits=shared_splits, chunk_rows=chunk_rows,
                                       device=device)
                meta.write(groups)
                out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
                cascade_decode_attention(q, k_cache, v_cache, table, rows, lens_t, dim**-0.5, meta, out=out,
                                         num_kv_splits=suffix_splits, block_n=16 if cpu else 64,
                                         suffix_block_n=16 if cpu else 128)
                tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
                err = rel_error(out, want)
                assert err < tol, (layout, dtype, chunk_rows, shared_splits, suffix_splits, err)


@pytest.mark.parametrize("device", DEVICES)
def test_cascade_without_groups_is_plain_decode(device: str) -> None:
    """All-zero metadata (no group) gives the plain split-KV decode's result."""
    from lmserver.kernels.cascade_decode import CascadeMetadata, cascade_decode_attention
    from lmserver.kernels.decode_attention import decode_attention

    g = torch.Generator().manual_seed(7)
    layout = [(0, [n]) for n in (1, 17, 40, 3)]
    table, rows, seq_lens, _, num_slots = shared_prefix_table(layout, 45, 1, g)
    dtype = torch.float32
    k_cache = torch.randn(num_slots, 3, 64, generator=g).to(dtype).to(device)
    v_cache = torch.randn(num_slots, 3, 64, generator=g).to(dtype).to(device)
    q = torch.randn(len(seq_lens), 9, 64, generator=g).to(dtype).to(device)
    table, rows = table.to(device), rows.to(device)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    meta = CascadeMetadata(len(seq_lens), max_work=3, num_shared_splits=2, chunk_rows=4, device=device)
    bn = 16 if device == "cpu" else 128
    got = cascade_decode_attention(q, k_cache, v_cache, table, rows, lens_t, 0.125, meta, num_kv_splits=2,
                                   suffix_block_n=bn)
    plain = decode_attention(q, k_cache, v_cache, table, rows, lens_t, 0.125, num_kv_splits=2, block_n=bn)
    assert torch.allclose(got, plain, rtol=0, atol=1e-6)


@st.composite
def _groups(draw: st.DrawFn) -> tuple[int, list[tuple[list[int], int]]]:
    bs = draw(st.integers(1, 40))
    rows = draw(st.permutations(range(bs)))
    cuts = sorted(draw(st.lists(st.integers(1, max(bs - 1, 1)), max_size=8, unique=True)))
    groups, prev = [], 0
    for c in [*cuts, bs]:
        if c > prev:
            groups.append((list(rows[prev:c]), draw(st.integers(0, 300))))
            prev = c
    return bs, groups


@settings(max_examples=200, deadline=None)
@given(_groups(), st.integers(2, 17), st.integers(1, 8), st.integers(0, 64), st.integers(1, 100))
def test_plan_covers_each_prefix_once_per_chunk(case: tuple[int, list[tuple[list[int], int]]], chunk_rows: int,
                                                 shared_splits: int, extra_work: int, target_work: int) -> None:
    from lmserver.kernels.cascade_decode import WORK_COLS, build_cascade_plan

    bs, groups = case
    max_work = -(-2 * bs // 3) + extra_work
    plan = build_cascade_plan(groups, bs, max_work, shared_splits, chunk_rows, target_work)
    n_work = max_work * WORK_COLS
    work = plan[:n_work].reshape(max_work, WORK_COLS)
    member_rows, row_prefix, row_num_shared = plan[n_work:].reshape(3, bs)
    expect_prefix = np.zeros(bs, dtype=np.int64)
    for rows, p in groups:
        if len(rows) >= 2 and p > 0:
            expect_prefix[rows] = p
    assert (row_prefix == expect_prefix).all()
    covered: dict[int, list[tuple[int, int, int]]] = {r: [] for r in range(bs)}
    for start, count, lo, hi, split in work:
        if count == 0:
            continue
        assert 1 <= count <= chunk_rows and 0 <= lo < hi and split < shared_splits
        for r in member_rows[start : start + count]:
            covered[int(r)].append((int(lo), int(hi), int(split)))
    for r in range(bs):
        pieces = sorted(covered[r])
        assert len(pieces) == row_num_shared[r] and sorted(s for *_, s in pieces) == list(range(len(pieces)))
        end = 0
        for lo, hi, _ in pieces:  # the pieces tile [0, prefix) exactly
            assert lo == end
            end = hi
        assert end == row_prefix[r]


def test_plan_rejects_repeated_rows() -> None:
    from lmserver.kernels.cascade_decode import build_cascade_plan

    with pytest.raises(ValueError, match="repeat"):
        build_cascade_plan([([0, 1], 5), ([1, 2], 5)], 4, 4, 2, 4)
    with pytest.raises(ValueError, match="outside"):
        build_cascade_plan([([0, 4], 5)], 4, 4, 2, 4)
