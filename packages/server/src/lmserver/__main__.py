import sys

from lmserver.edge.cli import main

sys.exit(main())
