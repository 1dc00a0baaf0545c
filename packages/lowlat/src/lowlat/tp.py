"""Tensor parallelism for the plugins: how a layer is split over ranks, and the reducer interface.

Sharding (``shard_layer``, ``shard_moe_layer``) is lmserver's (``lmserver.runner.distributed.shard``), in lowlat's layout:
query heads split over the ranks; KV heads split, or each replicated on ``tp / num_kv_heads`` ranks when the
ranks outnumber them; qkv and gate-up column-parallel (their output rows split: this rank's q, k and v heads, its
gate and up features), o_proj and down row-parallel (their input columns split). Norms, rotary table and the MoE
router stay whole. FP8 row scales follow their rows (o_proj's and down's are whole: each partial sum is scaled by
its output row's scale, so the sum over ranks is too). A split that does not divide is refused with the reason
(``split_errors``).

The row-parallel projections' partial outputs are summed over the ranks by a ``Reducer`` before each residual
add. ``TorchReducer`` is ``torch.distributed.all_reduce`` (gloo on CPUs, NCCL on GPUs; graph-safe on NCCL),
``FnReducer`` wraps a runner's own in-place sum (``BuildContext.all_reduce``: lmserver's TP group), ``LocalGroup``
sums between ranks that are threads of one process (simulated peers, on one device). A reducer that also owns the
projection (the reduction launched from the GEMV epilogue, or chained by PDL over torch symmetric memory; never
NVLink multicast) is the later GPU step: ``Reducer.fused`` says so, and the stack then hands it the whole
``row_parallel`` call instead of a GEMV + ``all_reduce`` + residual add.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

import torch

from lowlat.errors import Unsupported
from lowlat.layer import LayerShape, LayerWeights
from lowlat.moe import MoELayerWeights, MoEShape

TP_SIZES = (1, 2, 4, 8)


@runtime_checkable
class Reducer(Protocol):
    """Sums a tensor over the ranks of a TP group, in place (every rank calls it, in the same order)."""

    world_size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place; returns ``t``. Collective."""
        ...


class TorchReducer:
    """``torch.distributed.all_reduce`` over ``group`` (None: the default group; gloo or NCCL)."""

    fused = False

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist, self._group = dist, group
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(t, group=self._group)
        return t


class FnReducer:
    """A runner's in-place sum over its TP group (``BuildContext.all_reduce``) as a ``Reducer``."""

    fused = False

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], world_size: int) -> None:
        self._fn, self.world_size = fn, world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        out = self._fn(t)
        if out is not t:  # a sum that returned a new tensor: keep the in-place contract
            t.copy_(out)
        return t


class LocalGroup:
    """Ranks that are threads of one process (simulated peers; one device is enough): ``reducer(rank)`` sums
    between them. The sum runs in rank order in the tensors' dtype on every rank alike, queued on the
    threads' (shared) current stream after every rank queued its partial: no host sync on a GPU."""

    def __init__(self, world_size: int, timeout_s: float = 120.0) -> None:
        self.world_size = world_size
        self._slots: list[torch.Tensor | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)

    def reducer(self, rank: int) -> Reducer:
        return _LocalReducer(self, rank)

    def _all_reduce(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        self._slots[rank] = t
        self._barrier.wait()
        parts = [s for s in self._slots if s is not None]
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        self._barrier.wait()  # every rank has read every partial before any overwrites its own
        return t.copy_(total)


class _LocalReducer:
    fused = False

    def __init__(self, group: LocalGroup, rank: int) -> None:
        self._group, self.rank, self.world_size = group, rank, group.world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self._group._all_reduce(self.rank, t)


def context_reducer(reducer: Reducer | None, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None,
                    tp_size: int) -> Reducer | None:
    """The reducer a build uses: ``reducer``, else ``all_reduce`` wrapped (``FnReducer``), else None. Pure."""
    if reducer is not None:
        return reducer
    return FnReducer(all_reduce, tp_size) if all_reduce is not None else None


def split_errors(shape: LayerShape, tp_size: int, moe: MoEShape | None = None) -> tuple[str, ...]:
    """Why the whole layer ``shape`` (and ``moe``) cannot be split over ``tp_size`` ranks (empty: it can). Pure."""
    if tp_size < 1:
        return (f"tp_size must be >= 1, got {tp_size}",)
    out = []
    h, kv = shape.num_heads, shape.num_kv_heads
    if h % tp_size:
        out.append(f"num_heads {h} is not divisible by tp_size {tp_size}")
    if kv % tp_size and tp_size % kv:
        out.append(f"num_kv_heads {kv} and tp_size {tp_size} must divide one another (KV heads split or replicated)")
    inter = moe.expert_intermediate_size if moe is not None else shape.intermediate_size
    if inter % tp_size:
        out.append(f"intermediate_size {inter} is not divisible by tp_size {tp_size}")
    return tuple(out)


def rank_shape(shape: LayerShape, tp_size: int) -> LayerShape:
    """One rank's ``LayerShape`` of the whole layer ``shape`` (raises ``Unsupported`` where it does not split). Pure."""
    errors = split_errors(shape, tp_size)
    if errors:
        raise Unsupported("tp", errors)
    return replace(shape, num_heads=shape.num_heads // tp_size, num_kv_heads=max(shape.num_kv_heads // tp_size, 1),
                   intermediate_size=shape.intermediate_size // tp_size)


def rank_moe_shape(moe: MoEShape, tp_size: int) -> MoEShape:
    """One rank's ``MoEShape`` (each expert's intermediate features split). Pure."""
    if moe.expert_intermediate_size % tp_size:
        raise Unsupported("tp", (f"intermediate_size {moe.expert_intermediate_size} is not divisible by tp_size "
                                 f"{tp_size}",))
    return replace(moe, expert_intermediate_size=moe.expert_intermediate_size // tp_size)


def _qkv_rows(shape: LayerShape, rank: int, tp_size: int) -> torch.Tensor:
    """Row indices of rank ``rank``'s q, k and v heads in the whole qkv weight (lmserver's ``_qkv_row_ranges``)."""
    d, h, kv = shape.head_dim, shape.num_heads, shape.num_kv_heads
    hq, hk = h // tp_size, max(kv // tp_size, 1)
    first_kv = rank * hk if kv >= tp_size else rank // (tp_size // kv)
    q0, k0, v0 = rank * hq * d, h * d + first_kv * d, (h + kv) * d + first_kv * d
    return torch.cat([torch.arange(q0, q0 + hq * d), torch.arange(k0, k0 + hk * d), torch.arange(v0, v0 + hk * d)])


def kv_heads_of_rank(shape: LayerShape, rank: int, tp_size: int) -> range:
    """The whole layer's KV heads rank ``rank`` holds (a replicated head is held by several ranks). Pure."""
    hk = max(shape.num_kv_heads // tp_size, 1)
    first = rank * hk if shape.num_kv_heads >= tp_size else rank // (tp_size // shape.num_kv_heads)
    return range(first, first + hk)


def _rows(t: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, idx.to(t.device)).contiguous()


def _attention_shard(w: Any, shape: LayerShape, rank: int, tp_size: int) -> dict[str, Any]:
    rows = _qkv_rows(shape, rank, tp_size)
    hq, d = shape.num_heads // tp_size, shape.head_dim
    cols = slice(rank * hq * d, (rank + 1) * hq * d)
    out: dict[str, Any] = {"qkv": _rows(w.qkv, rows), "o_proj": w.o_proj[:, cols].contiguous()}
    if getattr(w, "qkv_scale", None) is not None:
        out["qkv_scale"] = _rows(w.qkv_scale, rows)
    return out


def shard_layer(w: LayerWeights, shape: LayerShape, rank: int, tp_size: int) -> LayerWeights:
    """Rank ``rank``'s shard of the whole layer ``w`` (of ``shape``) over ``tp_size`` ranks, as lmserver shards it
    (module docstring); copies. Raises ``Unsupported`` with the reasons where it does not split. Pure."""
    rank_shape(shape, tp_size)  # the split's errors, as Unsupported
    if tp_size == 1:
        return w
    inter = shape.intermediate_size
    n = inter // tp_size
    s = rank * n
    gate_up_rows = torch.cat([torch.arange(s, s + n), torch.arange(inter + s, inter + s + n)])
    fields = _attention_shard(w, shape, rank, tp_size)
    fields["gate_up"] = _rows(w.gate_up, gate_up_rows)
    fields["down"] = w.down[:, s:s + n].contiguous()
    if w.fp8:
        fields["gate_up_scale"] = _rows(w.gate_up_scale, gate_up_rows)
    return replace(w, **fields)


def shard_moe_layer(w: MoELayerWeights, shape: LayerShape, moe: MoEShape, rank: int, tp_size: int) -> MoELayerWeights:
    """Rank ``rank``'s shard of a whole MoE layer (attention as ``shard_layer``; each expert's gate / up rows and
    down columns split, as lmserver's ``TPMoE``; the router whole); copies. Pure."""
    rank_shape(shape, tp_size)
    rank_moe_shape(moe, tp_size)
    if tp_size == 1:
        return w
    inter = moe.expert_intermediate_size
    n = inter // tp_size
    s = rank * n
    fields = _attention_shard(w, shape, rank, tp_size)
    fields["w13"] = torch.cat([w.w13[:, s:s + n], w.w13[:, inter + s:inter + s + n]], 1).contiguous()
    fields["w2"] = w.w2[:, :, s:s + n].contiguous()
    if w.w13_scale is not None:  # FP8: the rows' scales go with the rows (w2's rows, hidden, stay whole)
        fields["w13_scale"] = torch.cat([w.w13_scale[:, s:s + n], w.w13_scale[:, inter + s:inter + s + n]], 1).contiguous()
    return replace(w, **fields)
