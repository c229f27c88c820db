#!/usr/bin/env python
"""Causal-model training-step benchmark: the same code as ``vitlab lm bench`` (run with --help for the options).

Example: ``python benchmarks/lm.py --layers 24`` (the paper's L) or ``python benchmarks/lm.py --quick``.
"""

import sys

from vitlab.cli import run_tool

if __name__ == "__main__":
    sys.exit(run_tool("lm", ["bench", *sys.argv[1:]]))
