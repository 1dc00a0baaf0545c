"""Shared pytest configuration: test tiers (see DESIGN.md, principle 9).

- `gpu`: needs CUDA; skipped automatically when no CUDA device is visible.
- `slow`: a long end-to-end run; `make test` leaves it out (`-m "not slow"`), `make test-slow`
  runs it alone. Keep a smaller case of its oracle in the default tier.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("LMSYS_GPU_ONLY") == "1":
        items[:] = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
