#!/usr/bin/env python
"""Model benchmark: the same code as ``vitlab bench`` (run with --help for the options).

Example: ``python benchmarks/models.py --targets`` or
``python benchmarks/models.py deit_small_patch16_224 --batch 1,8 --img-size 224,384 --dtypes fp32,bf16``.
"""

import sys

from vitlab.cli import run_tool

if __name__ == "__main__":
    sys.exit(run_tool("bench"))
