"""Packaging: the installed distribution and the import agree on the version."""

from importlib.metadata import version

import lmdsl


def test_version_matches_distribution() -> None:
    assert lmdsl.__version__ == version("lmdsl")


def test_import_is_light() -> None:
    """`import lmdsl` pulls in neither the optional openai client nor any ML framework."""
    import subprocess
    import sys

    code = ("import sys, lmdsl, lmdsl.testing; "
            "print(sorted(m for m in ('openai', 'torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_names_resolve() -> None:
    for name in lmdsl.__all__:
        assert getattr(lmdsl, name) is not None
