"""`host_batch` (numpy, array by array) against the per-token lists a forward's inputs were built from, and
`pack_to_device` (one buffer, one copy) against the arrays it packs."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.runner.host_batch import host_batch
from lmserver.runner.host_tensors import pack_to_device
from lmserver.scheduler.scheduler import ForwardItem

CPU = torch.device("cpu")
WIDTH = 64  # the request-to-token table's row length in these tests


@st.composite
def forward_items(draw: st.DrawFn) -> list[ForwardItem]:
    items = []
    for i in range(draw(st.integers(1, 6))):
        n = draw(st.integers(0, 20))
        prefix = draw(st.integers(0, WIDTH - n))
        table_start = draw(st.integers(0, prefix + n))
        slots = st.integers(1, 10**6)
        items.append(ForwardItem(
            rid=f"r{i}", req_pool_idx=draw(st.integers(0, 30)), prefix_len=prefix,
            token_ids=draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n)),
            out_slots=draw(st.lists(slots, min_size=n, max_size=n)), table_start=table_start,
            table_slots=draw(st.lists(slots, min_size=prefix + n - table_start, max_size=prefix + n - table_start)),
            logit_offsets=sorted(draw(st.sets(st.integers(0, n - 1), max_size=3))) if n else [],
            completes_prefill=draw(st.booleans())))
    return items


def naive(items: list[ForwardItem], width: int) -> dict[str, list[int]]:
    """The per-token lists, grown item by item as ModelRunner.build_batch grew them before host_batch."""
    out: dict[str, list[int]] = {k: [] for k in ("input_ids", "positions", "out_loc", "rows", "table_index",
                                                 "table_slots", "logit_idx", "prefix_lens", "ext_lens", "starts")}
    for item in items:
        start = len(out["input_ids"])
        n = len(item.token_ids)
        out["starts"].append(start)
        out["input_ids"].extend(item.token_ids)
        out["positions"].extend(range(item.prefix_len, item.prefix_len + n))
        out["out_loc"].extend(item.out_slots)
        out["rows"].append(item.req_pool_idx)
        out["prefix_lens"].append(item.prefix_len)
        out["ext_lens"].append(n)
        out["logit_idx"].extend(start + o for o in item.logit_offsets)
        base = item.req_pool_idx * width + item.table_start
        out["table_index"].extend(range(base, base + len(item.table_slots)))
        out["table_slots"].extend(item.table_slots)
    out["seq_lens"] = [p + e for p, e in zip(out["prefix_lens"], out["ext_lens"], strict=True)]
    return out


@settings(max_examples=150, deadline=None)
@given(forward_items())
def test_host_batch_equals_the_per_token_lists(items: list[ForwardItem]) -> None:
    got = host_batch(items, WIDTH)
    for name, want in naive(items, WIDTH).items():
        arr = getattr(got, name)
        assert arr.tolist() == want, name
        int32 = name in ("table_slots", "seq_lens", "prefix_lens", "ext_lens", "starts")
        assert arr.dtype == (np.int32 if int32 else np.int64), name


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40), min_size=1, max_size=6),
       st.sampled_from([torch.int64, torch.int32]))
def test_pack_to_device_gives_each_array_aligned(data: list[list[int]], dtype: torch.dtype) -> None:
    arrays = [np.asarray(d, dtype=np.int64) for d in data]
    views = pack_to_device(arrays, dtype, CPU)
    assert len(views) == len(arrays)
    for view, want in zip(views, data, strict=True):
        assert view.dtype == dtype and view.tolist() == want
        assert view.data_ptr() % 16 == 0  # as a tensor of its own would be (Triton's pointer specialization)
    # one storage for all of them: one copy to the device
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
