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
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class LayerScale(nn.Module):
    """Learnable per-channel scale of a residual branch (CaiT; the official Refiner code's ``scale_channel``)."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma
