"""Random paged-attention inputs for kernel tests, GPU checks and benchmarks.

Everything is drawn fresh from the given generator (never zeros): cache contents, a random
permutation of slots per request (slot 0 stays padding), request rows in `req_to_token`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["PagedBatch", "kernel_devices", "pytest_under_interpreter", "random_paged_batch", "rel_error"]


@dataclass(frozen=True)
class PagedBatch:
    """One batch over a random paged KV cache (see `lmserver.kernels.reference` for shapes)."""

    q: torch.Tensor  # (num_q_tokens, num_heads, head_dim)
    k_cache: torch.Tensor  # (num_slots, num_kv_heads, head_dim)
    v_cache: torch.Tensor  # (num_slots, num_kv_heads, head_dim)
    req_to_token: torch.Tensor  # (max_running_requests, max_context_len) int32
    req_pool_indices: torch.Tensor  # (bs,) int64
    prefix_lens: torch.Tensor  # (bs,) int64, tokens already cached
    extend_lens: torch.Tensor  # (bs,) int64, new tokens (1 each for decode)
    extend_start_loc: torch.Tensor  # (bs,) int64
    k_extend: torch.Tensor  # (num_q_tokens, num_kv_heads, head_dim)
    v_extend: torch.Tensor  # (num_q_tokens, num_kv_heads, head_dim)

    @property
    def seq_lens(self) -> torch.Tensor:  # (bs,) prefix + new tokens
        return self.prefix_lens + self.extend_lens


def random_paged_batch(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator,
    spare_slots: int = 64,
    spare_rows: int = 3,
) -> PagedBatch:
    """A batch whose request b has `prefix_lens[b]` cached tokens (in random slots) and
    `extend_lens[b]` new tokens. For decode, pass extend_lens of ones and store the new token's
    k/v (`k_extend`, `v_extend`) into the slots `req_to_token[row, prefix_len]` first."""
    bs = len(prefix_lens)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    max_ctx = max(seq + [1]) + 5
    num_slots = 1 + sum(seq) + spare_slots
    rows = bs + spare_rows

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    perm = torch.randperm(num_slots - 1, generator=generator) + 1  # slot 0 is padding
    req_to_token = torch.zeros(rows, max_ctx, dtype=torch.int32)
    req_rows = torch.randperm(rows, generator=generator)[:bs]
    used = 0
    for b in range(bs):
        req_to_token[req_rows[b], : seq[b]] = perm[used : used + seq[b]].int()
        used += seq[b]
    ext = torch.tensor(extend_lens, dtype=torch.int64)
    total_new = int(ext.sum())
    return PagedBatch(
        q=randn(total_new, num_heads, head_dim),
        k_cache=randn(num_slots, num_kv_heads, head_dim),
        v_cache=randn(num_slots, num_kv_heads, head_dim),
        req_to_token=req_to_token.to(device),
        req_pool_indices=req_rows.to(torch.int64).to(device),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64).to(device),
        extend_lens=ext.to(device),
        extend_start_loc=(torch.cumsum(ext, 0) - ext).to(device),
        k_extend=randn(total_new, num_kv_heads, head_dim),
        v_extend=randn(total_new, num_kv_heads, head_dim),
    )


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf when out holds a NaN or inf."""
    diff = out.double() - ref.double()
    if not torch.isfinite(diff).all():
        return float("inf")
    return float(diff.norm() / ref.double().norm().clamp_min(1e-30))


def kernel_devices(slow_on_cpu: bool = False) -> list[Any]:
    """pytest parameters for a kernel test's device: "cuda" (marked `gpu`) and, in a process run
    with TRITON_INTERPRET=1 (`pytest_under_interpreter`), "cpu" under the interpreter (marked `slow`
    with `slow_on_cpu`: a case that takes the interpreter a minute runs in the slow tier only)."""
    import pytest

    devices = [pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
    if os.environ.get("TRITON_INTERPRET") == "1":
        devices.append(pytest.param("cpu", id="interpret", marks=pytest.mark.slow if slow_on_cpu else ()))
    return devices


def assert_interpreter_run_passed(proc: subprocess.CompletedProcess[str]) -> None:
    """A `pytest_under_interpreter` run passed, ran tests and skipped none (the tail of its output as the message)."""
    summary = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, summary
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], summary


# `marks` of pytest_under_interpreter: the default tier's cases and the slow tier's
FAST_CASES = "not gpu and not slow"
SLOW_CASES = "not gpu and slow"


def pytest_under_interpreter(*test_files: str | Path, select: str = "interpret", marks: str = FAST_CASES,
                             timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """Runs pytest on `test_files` (the tests matching `-k select` and `-m marks`: by default the
    default tier's CPU cases) in a child process with TRITON_INTERPRET=1 and no visible GPU: the
    interpreter must be chosen before triton is imported. The repository root is three folders
    above the first file (`packages/<pkg>/tests/<file>`). Returns the finished process (output captured)."""
    root = Path(test_files[0]).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "LMSYS_GPU_ONLY"}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks, "--rootdir", str(root),
         "-k", select, *map(str, test_files)],
        cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s,
    )
