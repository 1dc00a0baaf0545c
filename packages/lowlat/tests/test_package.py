"""Packaging: the installed distribution and the import agree on the version."""

from importlib.metadata import version

import lowlat


def test_version_matches_distribution() -> None:
    assert lowlat.__version__ == version("lowlat")
