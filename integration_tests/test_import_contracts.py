"""Import contracts of DESIGN.md, checked two ways: statically (import-linter) and at run time."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["radixcache", "lmdsl", "cfsm"])
def test_leaf_import_does_not_load_torch(module: str) -> None:
    code = textwrap.dedent(f"""
        import sys, importlib
        importlib.import_module({module!r})
        heavy = sorted(m for m in ("torch", "triton", "transformers", "lmserver") if m in sys.modules)
        print(",".join(heavy))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


def test_scheduler_import_does_not_load_torch() -> None:
    code = "import sys, lmserver.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_import_linter_catches_a_deliberate_violation(tmp_path: Path) -> None:
    """Copies radixcache, adds `import lmdsl` to it, and expects lint-imports to fail."""
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(lint).exists():
        pytest.skip("import-linter is not installed")
    for pkg in ("radixcache", "cfsm", "lmdsl", "lowlat"):
        shutil.copytree(ROOT / "packages" / pkg / "src" / pkg, tmp_path / pkg)
    shutil.copytree(ROOT / "packages" / "server" / "src" / "lmserver", tmp_path / "lmserver")
    config = (ROOT / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(config)
    env = {"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    ok = subprocess.run([lint, "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (tmp_path / "radixcache" / "_violation.py").write_text("import lmdsl\n")
    bad = subprocess.run([lint, "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert bad.returncode != 0
    assert "radixcache._violation -> lmdsl" in bad.stdout
