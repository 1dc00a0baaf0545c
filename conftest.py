"""Shared pytest configuration: test tiers (see DESIGN.md, principle 9).

- `gpu`: needs CUDA; skipped automatically when no CUDA device is visible.
- `slow`: a long end-to-end run; `make test` leaves it out (`-m "not slow"`), `make test-slow`
  runs it alone. Keep a smaller case of its oracle in the default tier.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _share_the_cores(processes: int) -> None:
    """One OpenMP thread per core: each process running tests (and every server process its tests start, which
    inherits the variable) gets cores / processes threads. More threads than cores spin against each other: a CPU
    engine test took 81 s with two 2-thread processes on 2 cores and 13 s with one thread each. Must run before
    torch is imported (OpenMP reads the variable once); an OMP_NUM_THREADS set by the caller wins."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, processes)))


if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # a pytest-xdist worker: its share of the cores
    _share_the_cores(int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


def pytest_configure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER_COUNT" not in os.environ and not getattr(config.option, "numprocesses", None):
        _share_the_cores(1)  # tests run in this process (no workers: they would inherit the variable)


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
