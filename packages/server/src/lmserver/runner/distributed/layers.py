"""Tensor-parallel layers, built from the full (unsharded) layer by taking this rank's rows or
columns. Sharding is exact: no values change, only which rank holds them.

- ColumnParallelLinear: output features split (per part, e.g. q/k/v), no communication.
- RowParallelLinear: input features split, partial outputs summed with an all-reduce.
- VocabParallelEmbedding: vocabulary rows split; out-of-shard ids give zeros, then all-reduce.
- ParallelLMHead: vocabulary rows split; local logits all-gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
        if moe.is_fp8:  # NOTE: the scales are not sharded (FP8 with tp_size > 1 is refused before loading)
            raise ValueError("FP8 experts with tensor parallelism are not supported yet")
        if inter % group.size:
            raise ValueError(f"intermediate_size ({inter}) must be divisible by tp_size ({group.size})")
        n = inter // group.size
        s = group.rank * n
        with torch.no_grad():
            w13, w2 = moe.w13.data, moe.w2.data
            moe.w13 = nn.Parameter(
                torch.cat([w13[:, s : s + n], w13[:, inter + s : inter + s + n]], 1).contiguous(),
                requires_grad=False,
            )
            moe.w2 = nn.Parameter(w2[:, :, s : s + n].contiguous(), requires_grad=False)
        moe.intermediate_size = n  # this rank's shard, as w13 and w2 now hold
        self.moe = moe
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.moe(x))
