#!/usr/bin/env python
"""Token-mixer benchmark: the same code as ``vitlab bench-mixers`` (run with --help for the options).

Example: ``python benchmarks/mixers.py --targets-only`` or ``python benchmarks/mixers.py --quick``.
"""

import sys

from vitlab.cli import run_tool

if __name__ == "__main__":
    sys.exit(run_tool("bench-mixers"))
