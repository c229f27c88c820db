"""Feed-forward layers."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Mlp(nn.Module):
    """``fc2(drop(act(fc1(x))))``: the transformer FFN; GELU is the exact (erf) form as in every reference."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        out_dim: int | None = None,
        act_layer: type[nn.Module] = nn.GELU,
        drop: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, out_dim or dim, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if type(self.act) is nn.GELU and not (torch.is_grad_enabled() and h.requires_grad):
            # inference: GELU in place on fc1's fresh output (the widest tensor of the block: one allocation
            # and page-faulting of it fewer; the same values)
            h = torch.ops.aten.gelu_(h, approximate=self.act.approximate)
        else:
            h = self.act(h)
        return self.drop2(self.fc2(self.drop1(h)))


class LayerScale(nn.Module):
    """Learnable per-channel scale of a residual branch (CaiT; the official Refiner code's ``scale_channel``)."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma
