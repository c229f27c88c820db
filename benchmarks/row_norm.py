#!/usr/bin/env python
"""Training BatchNorm on channels-last maps: PyTorch's kernel against ``vitlab.ops.row_norm`` (the maps as rows).

Forward + backward of ``BatchNorm2d`` with the batch's statistics on refiner-sized maps ``(B, C, N, N)``
(channels-last, as the refiner's depth-wise conv writes them), for several channel counts; ms per call, the median
of ``--repeats`` calls of each, the two alternating in one process.

Example: ``python benchmarks/row_norm.py`` (batch 4, N = 197: Refined-ViT at 224 px; C = 18 is 6 heads x 3,
C = 36 Refined-ViT-S's 12 heads x 3). Run it with glibc keeping freed memory, as the side-by-side harness does
(``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184``), or every call
also pays the page faults of fresh 10-20 MB buffers.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from side_by_side import alternate, machine
from vitlab.ops.row_norm import batch_norm_rows


def forward_backward(norm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor) -> float:
    x = x.detach().requires_grad_()
    start = time.perf_counter()
    norm(x).backward(grad)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=197)
    parser.add_argument("--channels", type=int, nargs="+", default=[12, 16, 18, 36, 48])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(machine())
    print(f"BatchNorm2d forward + backward, batch {args.batch}, {args.tokens}x{args.tokens} maps, channels-last; ms")
    print(f"{'C':>4s} {'nn.BatchNorm2d':>15s} {'row_norm':>9s} {'speed-up':>9s}")
    n = args.tokens
    for c in args.channels:
        torch.manual_seed(0)
        x = torch.randn(args.batch, c, n, n).contiguous(memory_format=torch.channels_last)
        grad = torch.randn_like(x)
        bn = nn.BatchNorm2d(c)
        forms = {
            "module": partial(forward_backward, bn, x, grad),
            "rows": partial(forward_backward, partial(batch_norm_rows, bn=bn), x, grad),
        }
        module, rows_ms = alternate(forms, args.repeats).values()
        print(f"{c:4d} {module:15.2f} {rows_ms:9.2f} {module / rows_ms:8.2f}x")


if __name__ == "__main__":
    main()
