"""Packaging: the installed distribution and the import agree on the version."""

from importlib.metadata import version

import radixcache


def test_version_matches_distribution() -> None:
    assert radixcache.__version__ == version("radixcache")
