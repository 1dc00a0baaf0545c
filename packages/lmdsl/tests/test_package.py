"""Packaging: the installed distribution and the import agree on the version."""

from importlib.metadata import version

import lmdsl


def test_version_matches_distribution() -> None:
    assert lmdsl.__version__ == version("lmdsl")
