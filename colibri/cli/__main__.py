"""`python -m colibri.cli`: the `colibri` command."""

import sys

from colibri.cli.commands import main

sys.exit(main())
