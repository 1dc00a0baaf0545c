"""TPGroup: one rank's view of the tensor-parallel group (torch.distributed underneath).

Tensors go through the default process group (NCCL on GPUs, gloo on CPUs); control messages
(the scheduling decision) through a separate gloo group, so they never touch the device.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# NOTE: ranks wait for the next decision for as long as the server is idle; liveness is
# watched by the rank processes themselves (tp_engine.py), not by collective timeouts.
CONTROL_TIMEOUT = datetime.timedelta(days=7)


@dataclass
class TPGroup:
    rank: int
    size: int
    control: Any = None  # gloo process group for Python objects
    captured: bool = False  # a collective of this rank was captured into a CUDA graph

    @classmethod
    def init(cls, rank: int, size: int, init_method: str, backend: str) -> TPGroup:
        """Joins the group (blocks until every rank has joined); mutates torch.distributed state."""
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=CONTROL_TIMEOUT
        )
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if backend != "gloo" else None
        return cls(rank, size, control)

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over ranks in place and returns it (no-op for one rank)."""
        if self.size > 1:
            self._note_capture(x)
            dist.all_reduce(x)
        return x

    def _note_capture(self, x: torch.Tensor) -> None:
        if not self.captured and x.is_cuda and torch.cuda.is_current_stream_capturing():
            self.captured = True

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """(..., n) on every rank -> (..., size * n), rank-major."""
        if self.size == 1:
            return x
        self._note_capture(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape, dtype and device kind), in place; returns it."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled over the gloo control group)."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def destroy(self) -> None:
        """Leaves the group. After NCCL collectives were captured into CUDA graphs, destroying the
        NCCL communicator can hang (pytorch/pytorch#115388), so only the control group is destroyed
        then and the process's exit releases the rest; a later `init` in the same process fails."""
        if self.size == 1 or not dist.is_initialized():
            return
        if self.captured:
            if self.control is not None:
                dist.destroy_process_group(self.control)
            return
        dist.destroy_process_group()
