"""`python -m hicache` runs the command line."""

import sys

from hicache.cli.main import main

sys.exit(main())
