#!/usr/bin/env python
"""T2T's soft split: nn.Unfold's form against ``vitlab.ops.soft_split`` (one gather, its adjoint as backward).

The three splits of T2T-ViT / EAMLP at 224 px (7/4/2 on the image; 3/2/1 on the 56 x 56 and 28 x 28 token grids of
``--width`` channels), each as the model runs it: the plain form is the unfold, the transposed view made contiguous
(the next linear layer's copy) and, for a token grid, first the transpose and copy of the tokens into an image;
backward (the token grids only: the image needs no gradient in training) is fold plus the same copies. ms per call,
the median of ``--repeats`` calls, the two forms alternating in one process.

Example: ``python benchmarks/soft_split.py`` (training batch 4) and ``--batch 8`` (the inference batch of the
side-by-side comparisons). Run it with glibc keeping freed memory, as the harness does
(``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from side_by_side import alternate, machine
from vitlab import ops
from vitlab.ops.soft_split import soft_split


def split_tokens(split: nn.Unfold, tokens: torch.Tensor, grid: int | None) -> torch.Tensor:
    """The split as T2T's forward runs it: an image, or tokens (B, H·W, C) re-structurized first."""
    if grid is not None:
        tokens = tokens.reshape(tokens.shape[0], grid, grid, tokens.shape[2]).permute(0, 3, 1, 2)
    return soft_split(split, tokens)


def plain(split: nn.Unfold, tokens: torch.Tensor, grid: int | None) -> torch.Tensor:
    """The same with the fast paths off (nn.Unfold, then the contiguous copy the next linear layer makes)."""
    with ops.fast_paths(False):
        return split_tokens(split, tokens, grid).contiguous()


def timed(form: Callable[..., torch.Tensor], args: tuple, grad: torch.Tensor | None) -> float:
    start = time.perf_counter()
    out = form(*args)
    if grad is not None:
        out.backward(grad)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--width", type=int, default=64, help="channels of the token grids (T2T's token_dim)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(machine())
    print(f"T2T soft splits, batch {args.batch}; ms per call (forward / forward + backward)")
    print(f"{'split':<30s} {'nn.Unfold':>17s} {'soft_split':>17s} {'speed-up':>13s}")
    b, c = args.batch, args.width
    cases = [  # (label, kernel, stride, padding, input maker, grid, backward)
        ("7/4/2 on 3 x 224 x 224 image", 7, 4, 2, lambda: torch.randn(b, 3, 224, 224), None, False),
        (f"3/2/1 on 56 x 56 x {c} tokens", 3, 2, 1, lambda: torch.randn(b, 56 * 56, c), 56, True),
        (f"3/2/1 on 28 x 28 x {c} tokens", 3, 2, 1, lambda: torch.randn(b, 28 * 28, c), 28, True),
    ]
    for label, k, s, p, make, grid, backward in cases:
        torch.manual_seed(0)
        split = nn.Unfold(k, padding=p, stride=s)
        x = make().requires_grad_(backward)
        grad = torch.randn_like(split_tokens(split, x, grid)) if backward else None
        forms = {"plain": partial(timed, plain, (split, x, grid), grad)}
        forms["gather"] = partial(timed, split_tokens, (split, x, grid), grad)
        slow, fast = alternate(forms, args.repeats).values()
        kind = "f+b" if backward else "f"
        print(f"{label:<30s} {slow:13.2f} {kind:>3s} {fast:13.2f} {kind:>3s} {slow / fast:12.2f}x")


if __name__ == "__main__":
    main()
