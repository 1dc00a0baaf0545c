"""Host tensors ready to copy to the device without making the host wait (pinned for CUDA)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pinned_for(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` ready to copy to `device`: pinned for CUDA, since a copy from pageable
    memory may wait for the work queued on the stream (the caching host allocator keeps the
    pinned block until its copy ran). Copy it with `non_blocking=True`."""
    return t.pin_memory() if device.type == "cuda" else t


def host_tensor(data: Sequence[int] | Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """`data` as a host tensor to copy to `device` (see `pinned_for`)."""
    return pinned_for(torch.tensor(data, dtype=dtype), device)


def to_device(data: Sequence[int] | Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """`data` on `device` without making the host wait for the device (see `pinned_for`)."""
    return host_tensor(data, dtype, device).to(device, non_blocking=True)
