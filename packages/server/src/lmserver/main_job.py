"""`make serve`: the main job. Not built yet: the HTTP server lands with the server issue."""

from __future__ import annotations

import sys


def main() -> int:
    print("lmserver: the HTTP server is not built yet (see the open issues); nothing to serve.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
