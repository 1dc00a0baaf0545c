"""`lmserver` console script (the server CLI lands with the server issue)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("lmserver: the server CLI is not built yet.", file=sys.stderr)
    return 2
