"""`python -m dflash` runs the `dflash` command line."""

import sys

from dflash.cli import main

sys.exit(main())
