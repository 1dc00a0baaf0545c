import sys

from lmserver.cli import main

sys.exit(main())
