"""``python -m vitlab COMMAND ...``: the same as the ``vitlab`` command."""

import sys

from vitlab.cli import main

sys.exit(main())
