"""Packaging: the installed distribution and the import agree on the version."""

from importlib.metadata import version

import lmserver


def test_version_matches_distribution() -> None:
    assert lmserver.__version__ == version("lmserver")
