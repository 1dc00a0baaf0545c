"""Tensor-parallel layers, built from the full (unsharded) layer by taking this rank's rows or
columns. Sharding is exact: no values change, only which rank holds them.

- ColumnParallelLinear: output features split (per part, e.g. q/k/v), no communication.
- RowParallelLinear: input features split, partial outputs summed with an all-reduce.
- VocabParallelEmbedding: vocabulary rows split; out-of-shard ids give zeros, then all-reduce.
- ParallelLMHead: vocabulary rows split; local logits all-gathered.

FP8 weights (`Fp8Linear`, scales per (row, group of K columns)) shard exactly too: a column-parallel shard takes its
rows' scales; a row-parallel shard (`RowParallelFp8Linear`) takes its columns' scale groups (its column range must
start on a group boundary; a per-channel scale applies to every partial sum of its row alike). FP8 experts likewise
(`TPMoE`): per-row scales follow the rows, block scales need the split on block boundaries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmserver.layers.fp8_linear import Fp8Linear, Fp8Rows
from lmserver.layers.moe import MoE
from lmserver.runner.distributed.group import TPGroup


def take_rows(full: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Concatenation of full[start:end] over `ranges` (dim 0), as a new contiguous tensor."""
    return torch.cat([full[s:e] for s, e in ranges], dim=0).contiguous()


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, row_ranges: list[tuple[int, int]]) -> None:
        super().__init__()
        self.weight = nn.Parameter(take_rows(full.weight.data, row_ranges), requires_grad=False)
        self.bias = (
            nn.Parameter(take_rows(full.bias.data, row_ranges), requires_grad=False)
            if full.bias is not None
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _fp8_like(cls: type[Fp8Linear], full: Fp8Linear, in_features: int, out_features: int, group_k: int | None,
              weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> Fp8Linear:
    """A `cls` layer holding `weight` / `scale` / `bias` (this shard's), on `full`'s path."""
    layer = cls(in_features, out_features, bias is not None, group_k,
                bias.dtype if bias is not None else torch.float32, device="meta")
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    layer.weight_scale = scale.contiguous()
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    layer.use_path(full.path, full.scaled_mm if full.path == "triton" else None)
    return layer


def column_parallel(full: nn.Module, row_ranges: list[tuple[int, int]]) -> nn.Module:
    """The shard of output rows `row_ranges` of a model-dtype or FP8 linear (no communication)."""
    if not isinstance(full, Fp8Linear):
        return ColumnParallelLinear(full, row_ranges)  # type: ignore[arg-type]
    rows = sum(e - s for s, e in row_ranges)
    bias = take_rows(full.bias.data, row_ranges) if full.bias is not None else None
    return _fp8_like(Fp8Linear, full, full.in_features, rows, full.group_k, take_rows(full.weight.data, row_ranges),
                     take_rows(full.weight_scale, row_ranges), bias)


class RowParallelFp8Linear(Fp8Linear):
    """An FP8 linear's input columns [start, end) (`row_parallel`); partial outputs summed with an all-reduce."""

    group: TPGroup

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


def row_parallel(full: nn.Module, col_range: tuple[int, int], group: TPGroup) -> nn.Module:
    """The shard of input columns `col_range` of a model-dtype or FP8 linear without bias (outputs all-reduced); an
    FP8 layer's range starts on a scale group boundary (`shard.check_fp8_splits`)."""
    if not isinstance(full, Fp8Linear):
        return RowParallelLinear(full, col_range, group)  # type: ignore[arg-type]
    assert full.bias is None, "row-parallel layers here carry no bias"
    s, e = col_range
    g = full.group_k
    per_channel = g == full.in_features
    assert per_channel or s % g == 0, "a split inside a scale group (check_fp8_splits refuses it before sharding)"
    scale = full.weight_scale if per_channel else full.weight_scale[:, s // g : -(-e // g)]
    layer = _fp8_like(RowParallelFp8Linear, full, e - s, full.out_features, None if per_channel else g,
                      full.weight.data[:, s:e], scale, None)
    assert isinstance(layer, RowParallelFp8Linear)
    layer.group = group
    return layer


class RowParallelLinear(nn.Module):
    weight: nn.Parameter
    group: TPGroup

    def __init__(self, full: nn.Linear, col_range: tuple[int, int], group: TPGroup) -> None:
        super().__init__()
        assert full.bias is None, "row-parallel layers here carry no bias"
        s, e = col_range
        self.weight = nn.Parameter(full.weight.data[:, s:e].contiguous(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


def vocab_shard(vocab_size: int, group: TPGroup) -> tuple[int, int, int]:
    """(start, end, rows per rank) of this rank's vocabulary shard (padded to size * rows)."""
    per_rank = -(-vocab_size // group.size)
    start = group.rank * per_rank
    return start, min(start + per_rank, vocab_size), per_rank


def _padded_rows(full: torch.Tensor, start: int, end: int, per_rank: int) -> torch.Tensor:
    rows = torch.zeros((per_rank, *full.shape[1:]), dtype=full.dtype, device=full.device)
    rows[: max(end - start, 0)] = full[start:end]
    return rows


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full: nn.Embedding, group: TPGroup) -> None:
        super().__init__()
        self.start, self.end, per_rank = vocab_shard(full.num_embeddings, group)
        self.weight = nn.Parameter(
            _padded_rows(full.weight.data, self.start, self.end, per_rank), requires_grad=False
        )
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.start) & (ids < self.end)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(out)


class ParallelLMHead(nn.Module):
    def __init__(self, full_weight: torch.Tensor, group: TPGroup) -> None:
        super().__init__()
        self.vocab_size = full_weight.shape[0]
        start, end, per_rank = vocab_shard(self.vocab_size, group)
        self.weight = nn.Parameter(_padded_rows(full_weight, start, end, per_rank), requires_grad=False)
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) on every rank."""
        return self.group.all_gather_last_dim(F.linear(hidden, self.weight))[..., : self.vocab_size]


class TPMoE(nn.Module):
    """An expert MLP whose experts' intermediate dimension is split; outputs summed by all-reduce."""

    def __init__(self, moe: MoE, group: TPGroup) -> None:
        super().__init__()
        inter = moe.intermediate_size
        if inter % group.size:
            raise ValueError(f"intermediate_size ({inter}) must be divisible by tp_size ({group.size})")
        n = inter // group.size
        s = group.rank * n
        block = moe.scale_block
        assert block is None or not (n % block[0] or n % block[1]), \
            "shards of partial scale blocks (check_fp8_splits refuses them before sharding)"
        with torch.no_grad():
            w13, w2 = moe.w13.data, moe.w2.data
            moe.w13 = nn.Parameter(
                torch.cat([w13[:, s : s + n], w13[:, inter + s : inter + s + n]], 1).contiguous(),
                requires_grad=False,
            )
            moe.w2 = nn.Parameter(w2[:, :, s : s + n].contiguous(), requires_grad=False)
            if moe.w13_scale is not None and moe.w2_scale is not None:
                # per row: w13's rows follow the split, w2's (hidden) rows stay whole (a row's scale applies to
                # every partial sum of it); per block: the same on block indices
                rows, cols = (1, 1) if block is None else block
                a, b, m = s // rows, (inter + s) // rows, n // rows
                moe.w13_scale = torch.cat([moe.w13_scale[:, a : a + m], moe.w13_scale[:, b : b + m]], 1).contiguous()
                if block is not None:
                    moe.w2_scale = moe.w2_scale[:, :, s // cols : (s + n) // cols].contiguous()
        moe.intermediate_size = n  # this rank's shard, as w13 and w2 now hold
        self.moe = moe
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.moe(x))
