"""Runs kernel_cases.py (and moe_cases.py, fp8_cases.py, fp8_moe_cases.py, w8a8_cases.py, tp_cases.py) in a child pytest: on the CPU under TRITON_INTERPRET=1, or on a GPU.

TRITON_INTERPRET must be set before triton is imported, so the cases run in a child process and
the other tests of this session keep the normal Triton. The cases marked `slow` there run in this
file's slow tests (`make test-slow`); on a GPU every case runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("kernel_cases.py")
MOE_CASES = Path(__file__).with_name("moe_cases.py")
FP8_CASES = Path(__file__).with_name("fp8_cases.py")
FP8_MOE_CASES = Path(__file__).with_name("fp8_moe_cases.py")
TP_CASES = Path(__file__).with_name("tp_cases.py")
W8A8_CASES = Path(__file__).with_name("w8a8_cases.py")
ROOT = Path(__file__).resolve().parents[3]


def _run(env_extra: dict[str, str], cases: Path = CASES, marks: str | None = None, skips: bool = False) -> str:
    """The cases of `cases` in a child pytest; `marks`: a `-m` expression (the cases' own slow tier); `skips`: cases
    may skip (the TP cases on a machine with fewer GPUs than ranks)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LMSYS_GPU_ONLY", "TRITON_INTERPRET")}
    env.update(env_extra)
    select = ["-m", marks] if marks else []
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *select, str(cases)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    summary = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, summary
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and (skips or "skipped" not in last), summary
    assert marks is not None or "deselected" not in last, summary
    return last


INTERPRET = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_kernels_and_plugins_under_the_interpreter() -> None:
    _run(INTERPRET, marks="not slow")


@pytest.mark.slow
def test_long_kernel_and_plugin_cases_under_the_interpreter() -> None:
    _run(INTERPRET, marks="slow")


@pytest.mark.gpu
def test_kernels_and_plugins_on_the_gpu() -> None:
    _run({})


def test_moe_kernels_and_layer_under_the_interpreter() -> None:
    _run(INTERPRET, MOE_CASES, marks="not slow")


@pytest.mark.slow
def test_long_moe_cases_under_the_interpreter() -> None:
    _run(INTERPRET, MOE_CASES, marks="slow")


@pytest.mark.gpu
def test_moe_kernels_and_layer_on_the_gpu() -> None:
    _run({}, MOE_CASES)


def test_fp8_kernels_and_layer_under_the_interpreter() -> None:
    _run(INTERPRET, FP8_CASES, marks="not slow")


@pytest.mark.slow
def test_long_fp8_cases_under_the_interpreter() -> None:
    _run(INTERPRET, FP8_CASES, marks="slow")


@pytest.mark.gpu
def test_fp8_kernels_and_layer_on_the_gpu() -> None:
    _run({}, FP8_CASES)


def test_fp8_moe_kernels_and_stack_under_the_interpreter() -> None:
    _run(INTERPRET, FP8_MOE_CASES, marks="not slow")


@pytest.mark.slow
def test_long_fp8_moe_cases_under_the_interpreter() -> None:
    _run(INTERPRET, FP8_MOE_CASES, marks="slow")


@pytest.mark.gpu
def test_fp8_moe_kernels_and_stack_on_the_gpu() -> None:
    """The CPU cases plus the Mixtral-8x7B layer (expert kernels at 1-8 tokens, large activations, the stack at 1 and 8
    rows)."""
    _run({}, FP8_MOE_CASES)


def test_w8a8_gemv_under_the_interpreter() -> None:
    _run(INTERPRET, W8A8_CASES, marks="not slow")


@pytest.mark.slow
def test_long_w8a8_cases_under_the_interpreter() -> None:
    _run(INTERPRET, W8A8_CASES, marks="slow")


@pytest.mark.gpu
def test_w8a8_gemv_on_the_gpu() -> None:
    """The CPU cases plus the Llama-3-8B stages (issues 33 / 34: the W8A8 multi-row kernels)."""
    _run({}, W8A8_CASES)


def test_tp_plugin_ranks_under_the_interpreter() -> None:
    _run(INTERPRET, TP_CASES, marks="not slow")


@pytest.mark.slow
def test_long_tp_cases_under_the_interpreter() -> None:
    _run(INTERPRET, TP_CASES, marks="slow")


@pytest.mark.gpu
def test_tp_plugin_on_the_gpu() -> None:
    """One GPU: the simulated-peer cases; a GPU per rank: the NCCL ranks too (fewer GPUs: those skip)."""
    _run({}, TP_CASES, skips=True)
