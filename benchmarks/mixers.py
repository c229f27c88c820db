#!/usr/bin/env python
"""Token-mixer benchmark: the same as ``vitlab bench-mixers`` (run with --help for the options).

Example: ``python benchmarks/mixers.py --targets-only`` or ``python benchmarks/mixers.py --quick``.
"""

import sys

from vitlab.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-mixers", *sys.argv[1:]]))
