"""Triton capability probes shared by the kernel launchers."""

from __future__ import annotations

import os

import torch

from lowlat.errors import LowlatError


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` before triton import)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(device: torch.device) -> None:
    """Raise ``LowlatError`` when Triton cannot run on ``device`` in this process."""
    if device.type == "cpu" and not interpreting():
        raise LowlatError(
            "lowlat's Triton kernels got CPU tensors but the Triton interpreter is off: set TRITON_INTERPRET=1 "
            "before triton is imported, or pass CUDA tensors"
        )


def pdl_available() -> bool:
    """Whether this Triton build exposes programmatic dependent launch (``gdc_*`` + ``launch_pdl``)."""
    try:
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    if not (hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())
