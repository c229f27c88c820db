"""``python -m vitlab COMMAND ...``: the same as the ``vitlab`` command."""

import sys

from .cli import main

sys.exit(main())
