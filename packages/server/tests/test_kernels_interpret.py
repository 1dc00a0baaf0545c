"""Runs test_kernels_triton.py's CPU cases under Triton's interpreter in a child process.

TRITON_INTERPRET must be set before triton is imported, so the kernels run in a child pytest
and the other tests of this session keep the normal Triton.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserver.kernels.testing import SLOW_CASES, assert_interpreter_run_passed, pytest_under_interpreter

pytest.importorskip("triton")


TESTS = Path(__file__).with_name("test_kernels_triton.py")
FILES = (TESTS, TESTS.with_name("test_kernels_triton_backend.py"), TESTS.with_name("test_kernels_triton_model.py"))


def test_triton_kernels_under_interpreter() -> None:
    assert_interpreter_run_passed(pytest_under_interpreter(*FILES))


@pytest.mark.slow
def test_long_triton_kernel_cases_under_interpreter() -> None:
    assert_interpreter_run_passed(pytest_under_interpreter(*FILES, marks=SLOW_CASES))
