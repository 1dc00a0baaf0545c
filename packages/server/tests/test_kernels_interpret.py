"""Runs test_kernels_triton.py's CPU cases under Triton's interpreter in a child process.

TRITON_INTERPRET must be set before triton is imported, so the kernels run in a child pytest
and the other tests of this session keep the normal Triton.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserver.kernels.testing import pytest_under_interpreter

pytest.importorskip("triton")


def test_triton_kernels_under_interpreter() -> None:
    tests = Path(__file__).with_name("test_kernels_triton.py")
    proc = pytest_under_interpreter(tests, tests.with_name("test_kernels_triton_backend.py"),
                                    tests.with_name("test_kernels_triton_model.py"))
    summary = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, summary
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], summary
