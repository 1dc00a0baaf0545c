"""Runs test_kernels_triton.py's CPU cases under Triton's interpreter in a child process.

TRITON_INTERPRET must be set before triton is imported, so the kernels run in a child pytest
and the other tests of this session keep the normal Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_triton_kernels_under_interpreter() -> None:
    tests = Path(__file__).with_name("test_kernels_triton.py")
    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "LMSYS_GPU_ONLY"}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "--rootdir", str(root),
         "-k", "interpret", str(tests), str(tests.with_name("test_kernels_triton_backend.py")),
         str(tests.with_name("test_kernels_triton_model.py"))],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    summary = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, summary
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], summary
