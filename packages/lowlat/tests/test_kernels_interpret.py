"""Runs kernel_cases.py, moe_cases.py and tp_cases.py in a child pytest: on the CPU under TRITON_INTERPRET=1, or
on a GPU.

TRITON_INTERPRET must be set before triton is imported, so the cases run in a child process and the other tests of
this session keep the normal Triton (`lowlat.testing.run_case_file`). The cases marked `slow` there run in this file's
slow tests (`make test-slow`); on a GPU every case runs. The FP8 case files (fp8_cases.py, fp8_moe_cases.py,
w8a8_cases.py) run from test_kernels_interpret_fp8.py, a file of its own so that the two test workers share the
interpreter's minutes (`--dist loadfile`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lowlat.testing import INTERPRET_ENV, run_case_file

CASES = Path(__file__).with_name("kernel_cases.py")
MOE_CASES = Path(__file__).with_name("moe_cases.py")
TP_CASES = Path(__file__).with_name("tp_cases.py")


def test_kernels_and_plugins_under_the_interpreter() -> None:
    run_case_file(CASES, INTERPRET_ENV, marks="not slow")


@pytest.mark.slow
def test_long_kernel_and_plugin_cases_under_the_interpreter() -> None:
    run_case_file(CASES, INTERPRET_ENV, marks="slow")


@pytest.mark.gpu
def test_kernels_and_plugins_on_the_gpu() -> None:
    run_case_file(CASES, {})


def test_moe_kernels_and_layer_under_the_interpreter() -> None:
    run_case_file(MOE_CASES, INTERPRET_ENV, marks="not slow")


@pytest.mark.slow
def test_long_moe_cases_under_the_interpreter() -> None:
    run_case_file(MOE_CASES, INTERPRET_ENV, marks="slow")


@pytest.mark.gpu
def test_moe_kernels_and_layer_on_the_gpu() -> None:
    run_case_file(MOE_CASES, {})


def test_tp_plugin_ranks_under_the_interpreter() -> None:
    run_case_file(TP_CASES, INTERPRET_ENV, marks="not slow")


@pytest.mark.slow
def test_long_tp_cases_under_the_interpreter() -> None:
    run_case_file(TP_CASES, INTERPRET_ENV, marks="slow")


@pytest.mark.gpu
def test_tp_plugin_on_the_gpu() -> None:
    """One GPU: the simulated-peer cases; a GPU per rank: the NCCL ranks too (fewer GPUs: those skip)."""
    run_case_file(TP_CASES, {}, skips=True)
