"""Feed-forward layers."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.linear import fused_linear, fuses_linear, gelu_
from ..ops.switch import no_autograd


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

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """The FFN of ``x``; with ``residual``, ``residual + FFN(x)`` (the block's addition, fused into fc2's
        product on the CPU)."""
        if self._fuses(x):  # inference on the CPU: bias, GELU and the residual inside the products
            return fused_linear(self.fc2, fused_linear(self.fc1, x, gelu=True), residual=residual)
        h = fused_linear(self.fc1, x)  # fp32 training on the CPU: oneDNN's products (see fused_linear)
        # inference: GELU in place on fc1's fresh output (the widest tensor of the block: one allocation and
        # page-faulting of it fewer; the same values)
        in_place = type(self.act) is nn.GELU and no_autograd(h)
        h = gelu_(h, approximate=self.act.approximate) if in_place else self.act(h)
        h = self.drop1(h)
        if residual is not None and (self.drop2.p == 0 or not self.training):
            return fused_linear(self.fc2, h, residual=residual)
        y = self.drop2(fused_linear(self.fc2, h))
        return y if residual is None else residual + y

    def _fuses(self, x: Tensor) -> bool:
        exact_gelu = type(self.act) is nn.GELU and self.act.approximate == "none"
        no_dropout = not self.training or (self.drop1.p == 0 and self.drop2.p == 0)
        return exact_gelu and no_dropout and fuses_linear(x, self.fc1.weight)


class LayerScale(nn.Module):
    """Learnable per-channel scale of a residual branch (CaiT; the official Refiner code's ``scale_channel``)."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma
