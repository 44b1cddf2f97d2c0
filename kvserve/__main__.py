import sys

from kvserve.entrypoints.cli import main

sys.exit(main())
