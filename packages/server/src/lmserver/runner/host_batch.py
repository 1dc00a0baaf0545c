"""A decision's forward inputs as numpy arrays on the host (`host_batch`), before one copy to the device.

Built array by array (ranges as `np.arange`, per-item offsets by `np.repeat`) instead of Python lists grown token by
token: a 4,096-token prefill's inputs were seven lists of 4,096 ints, each converted once more into a tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmserver.scheduler.scheduler import ForwardItem

__all__ = ["HostBatch", "host_batch"]


@dataclass(frozen=True)
class HostBatch:
    """The forward inputs of a decision's items, in item order (int64 arrays unless said)."""

    input_ids: np.ndarray  # (T,) the new tokens
    positions: np.ndarray  # (T,) prefix_len + offset of each new token
    out_loc: np.ndarray  # (T,) the KV slot of each new token
    rows: np.ndarray  # (B,) req_pool_idx per item
    table_index: np.ndarray  # (K,) flat req_to_token positions to write ...
    table_slots: np.ndarray  # (K,) int32 ... with these slots
    logit_idx: np.ndarray  # (L,) flat token indices whose logits are wanted
    seq_lens: np.ndarray  # (B,) int32 prefix + new tokens
    prefix_lens: np.ndarray  # (B,) int32
    ext_lens: np.ndarray  # (B,) int32 new tokens
    starts: np.ndarray  # (B,) int32 each item's first row among the T


def _concat(lists: Sequence[Sequence[int]], total: int) -> np.ndarray:
    if len(lists) == 1:
        return np.fromiter(lists[0], dtype=np.int64, count=total)
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=total)


def _ranges(firsts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The ranges [firsts[i], firsts[i] + lengths[i]) concatenated."""
    total = int(lengths.sum())
    seg_starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=seg_starts[1:])
    return np.repeat(firsts - seg_starts, lengths) + np.arange(total, dtype=np.int64)


def host_batch(items: Sequence[ForwardItem], table_width: int) -> HostBatch:
    """`items` as arrays; `table_width`: the request-to-token table's row length. Pure."""
    scalars = np.array([(len(it.token_ids), it.prefix_len, it.req_pool_idx, len(it.table_slots), it.table_start)
                        for it in items], dtype=np.int64).reshape(-1, 5)
    ext_lens, prefix_lens, rows, table_lens, table_starts = (np.ascontiguousarray(c) for c in scalars.T)
    total = int(ext_lens.sum())
    starts = np.zeros(len(items), dtype=np.int64)
    np.cumsum(ext_lens[:-1], out=starts[1:])
    logit_idx = [start + o for start, it in zip(starts.tolist(), items, strict=True) for o in it.logit_offsets]
    return HostBatch(
        input_ids=_concat([it.token_ids for it in items], total),
        positions=_ranges(prefix_lens, ext_lens),
        out_loc=_concat([it.out_slots for it in items], total),
        rows=rows,
        table_index=_ranges(rows * table_width + table_starts, table_lens),
        table_slots=_concat([it.table_slots for it in items], int(table_lens.sum())).astype(np.int32),
        logit_idx=np.asarray(logit_idx, dtype=np.int64),
        seq_lens=(prefix_lens + ext_lens).astype(np.int32),
        prefix_lens=prefix_lens.astype(np.int32),
        ext_lens=ext_lens.astype(np.int32),
        starts=starts.astype(np.int32),
    )
