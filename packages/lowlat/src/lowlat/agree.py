"""Tensor-parallel agreement: every rank runs the same path, decided before collectives exist."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lowlat.spec import Coverage


class Group(Protocol):
    """The two collectives agreement needs; ``TorchGroup`` adapts ``torch.distributed``."""

    rank: int
    world_size: int

    def all_reduce_min(self, value: int) -> int:
        """The minimum of ``value`` over ranks (blocking collective)."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (blocking collective)."""
        ...


class TorchGroup:
    """``Group`` over a ``torch.distributed`` process group (gloo on CPUs, NCCL on GPUs)."""

    def __init__(self, group: Any = None, device: str = "cpu") -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce_min(self, value: int) -> int:
        import torch

        t = torch.tensor([value], dtype=torch.int64, device=self._device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._group)
        return int(t.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out


@dataclass(frozen=True)
class Agreement:
    """The outcome of agreement, identical on every rank.

    ``enabled`` is the MIN of the ranks' verdicts; ``coverage`` is the intersection of the
    ranks' coverage tables; ``reasons`` say why the plugin was turned off (empty when enabled).
    """

    enabled: bool
    plugin: str | None
    coverage: Coverage | None
    world_size: int
    reasons: tuple[str, ...] = ()


def agree(
    plugin: str | None,
    version: str | None,
    coverage: Coverage | None,
    group: Group | None,
    reasons: tuple[str, ...] = (),
) -> Agreement:
    """Agree across ``group`` on whether ``plugin`` runs and on its coverage.

    One MIN all-reduce of the verdict (1 = this rank can run the plugin) and one all-gather of
    (plugin, version, coverage table, ``reasons``); the plugin stays on only if every rank chose
    the same plugin and version. ``reasons``: why this rank has no plugin (empty when it has
    one); a rank that turns everyone off has them listed in the agreement's reasons, so every
    rank can report every rank's reasons. With ``group`` None (single rank) nothing is
    communicated. Pure apart from the collectives.
    """
    verdict = int(plugin is not None and coverage is not None)
    if group is None or group.world_size == 1:
        return Agreement(bool(verdict), plugin if verdict else None, coverage if verdict else None, 1)
    agreed = group.all_reduce_min(verdict)
    table = (plugin, version, coverage.to_table() if coverage is not None else None, tuple(reasons))
    tables = group.all_gather_object(table)
    out: list[str] = []
    if agreed == 0:
        off = [r for r, t in enumerate(tables) if t[0] is None or t[2] is None]
        out.append(f"ranks {off} cannot run a plugin")
        out.extend(f"rank {r}: {why}" for r in off for why in tables[r][3])
    elif len({(t[0], t[1]) for t in tables}) > 1:
        out.append("ranks chose different plugins: " + ", ".join(f"rank {r}: {t[0]} {t[1]}" for r, t in enumerate(tables)))
    if out:
        return Agreement(False, None, None, group.world_size, tuple(out))
    merged = Coverage.from_table(tables[0][2])
    for t in tables[1:]:
        merged = merged.intersect(Coverage.from_table(t[2]))
    return Agreement(True, plugin, merged, group.world_size)
