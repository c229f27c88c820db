"""Stochastic depth (Huang et al. 2016), as used by DeiT and every model here."""

from __future__ import annotations

from torch import Tensor, nn


def drop_path(x: Tensor, p: float, training: bool) -> Tensor:
    """Zero whole samples of a residual branch with probability ``p``, rescale the rest by 1/(1-p)."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask / keep


class DropPath(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"drop-path probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return drop_path(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
