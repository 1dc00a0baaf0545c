"""Packaging: the installed distribution and the import agree on the version."""

from importlib.metadata import version

import cfsm


def test_version_matches_distribution() -> None:
    assert cfsm.__version__ == version("cfsm")
