#!/usr/bin/env python
"""Causal-model training-step benchmark: the same code as ``vitlab lm bench`` (run with --help for the options).

Example: ``python benchmarks/lm.py --layers 24`` (the paper's L) or ``python benchmarks/lm.py --quick``.
"""

import sys

from vitlab.lm.bench import main

if __name__ == "__main__":
    sys.exit(main())
