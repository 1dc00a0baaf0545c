"""Runs fp8_cases.py, fp8_moe_cases.py and w8a8_cases.py in a child pytest: on the CPU under TRITON_INTERPRET=1, or
on a GPU.

TRITON_INTERPRET must be set before triton is imported, so the cases run in a child process and the other tests of
this session keep the normal Triton (`lowlat.testing.run_case_file`). The cases marked `slow` there run in this file's
slow tests (`make test-slow`); on a GPU every case runs. The other case files: test_kernels_interpret.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lowlat.testing import INTERPRET_ENV, run_case_file

FP8_CASES = Path(__file__).with_name("fp8_cases.py")
FP8_MOE_CASES = Path(__file__).with_name("fp8_moe_cases.py")
W8A8_CASES = Path(__file__).with_name("w8a8_cases.py")


def test_fp8_kernels_and_layer_under_the_interpreter() -> None:
    run_case_file(FP8_CASES, INTERPRET_ENV, marks="not slow")


@pytest.mark.slow
def test_long_fp8_cases_under_the_interpreter() -> None:
    run_case_file(FP8_CASES, INTERPRET_ENV, marks="slow")


@pytest.mark.gpu
def test_fp8_kernels_and_layer_on_the_gpu() -> None:
    run_case_file(FP8_CASES, {})


def test_fp8_moe_kernels_and_stack_under_the_interpreter() -> None:
    run_case_file(FP8_MOE_CASES, INTERPRET_ENV, marks="not slow")


@pytest.mark.slow
def test_long_fp8_moe_cases_under_the_interpreter() -> None:
    run_case_file(FP8_MOE_CASES, INTERPRET_ENV, marks="slow")


@pytest.mark.gpu
def test_fp8_moe_kernels_and_stack_on_the_gpu() -> None:
    """The CPU cases plus the Mixtral-8x7B layer (expert kernels at 1-8 tokens, large activations, the stack at 1 and 8
    rows)."""
    run_case_file(FP8_MOE_CASES, {})


def test_w8a8_gemv_under_the_interpreter() -> None:
    run_case_file(W8A8_CASES, INTERPRET_ENV, marks="not slow")


@pytest.mark.slow
def test_long_w8a8_cases_under_the_interpreter() -> None:
    run_case_file(W8A8_CASES, INTERPRET_ENV, marks="slow")


@pytest.mark.gpu
def test_w8a8_gemv_on_the_gpu() -> None:
    """The CPU cases plus the Llama-3-8B stages (issues 33 / 34: the W8A8 multi-row kernels)."""
    run_case_file(W8A8_CASES, {})
