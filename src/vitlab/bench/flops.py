"""Multiply-accumulate counts of a model, without running it for real.

``torch.utils.flop_counter`` counts matmuls and convolutions from shapes; the
model runs on the meta device, so counting a 86M-parameter model takes no
memory and about a second. MACs = counted FLOPs / 2 (the papers' "FLOPs" are
MACs). Norms, activations, softmax and exponentials are not counted, as in the
papers' own figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


@dataclass
class MacCount:
    total: int
    by_op: dict[str, int]

    @property
    def gmacs(self) -> float:
        return self.total / 1e9


def count_macs(model: nn.Module, input_size: tuple[int, ...], batch: int = 1) -> MacCount:
    """MACs of one forward pass of ``model`` on a ``(batch, *input_size)`` input (run on the meta device)."""
    model = model.to("meta").eval()
    x = torch.empty(batch, *input_size, device="meta")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x)
    by_op = {str(op).removeprefix("aten."): int(n) // 2 for op, n in counter.get_flop_counts()["Global"].items()}
    return MacCount(sum(by_op.values()), by_op)
