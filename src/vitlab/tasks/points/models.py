"""Point-cloud networks in the PCT style (Guo et al. 2021, Point Cloud Transformer), with external attention as
the mixer of their offset-attention layers, the EA paper's point-cloud setting.

Offset attention on per-point features ``F`` (B, N, C)::

    F_out = F + LBR(F - Mixer(F))          LBR = Linear, BatchNorm over the points, ReLU

``Mixer`` is any :mod:`vitlab.mixers` token mixer over the N points: ``external`` (S memory slots, the double
normalisation) by default, ``attention`` for PCT's self-attention. The classifier (:class:`PointClassifier`):
point embedding (two LBR 3 -> C) -> ``depth`` offset-attention layers -> their outputs concatenated -> LBR to
``4 C`` -> max and mean over the points -> MLP (512, 256, dropout 0.5) -> class logits. PCT's neighbour embedding
(farthest-point sampling and k-NN grouping) is left out: every layer sees all the points ("naive PCT").
The part segmenter (:class:`PartSegmenter`): the same trunk, then each point's ``4 C`` features beside the
shape's max and mean features and an embedding of its object category -> LBR 256 -> dropout -> LBR 256 ->
part logits per point.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...mixers import build as build_mixer


class LBR(nn.Module):
    """Linear, BatchNorm over (batch, points), ReLU on ``(B, N, C)`` features."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.linear, self.bn = nn.Linear(c_in, c_out, bias=False), nn.BatchNorm1d(c_out)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.bn(self.linear(x).transpose(1, 2)).transpose(1, 2))


class OffsetAttention(nn.Module):
    """``F + LBR(F - Mixer(F))`` (module docstring)."""

    def __init__(self, dim: int, mixer: str = "external", **mixer_kwargs: Any) -> None:
        super().__init__()
        self.mixer = build_mixer(mixer, dim, **mixer_kwargs)
        self.lbr = LBR(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.lbr(x - self.mixer(x))


class PointTrunk(nn.Module):
    """Point embedding, ``depth`` offset-attention layers, their concatenation lifted to ``4 * dim``."""

    def __init__(self, in_chans: int = 3, dim: int = 128, depth: int = 4, mixer: str = "external",
                 memory_size: int = 64, num_heads: int = 1) -> None:  # fmt: skip
        super().__init__()
        kwargs: dict[str, Any] = {"memory_size": memory_size} if mixer.startswith("external") else {}
        kwargs["num_heads"] = num_heads
        self.embed = nn.Sequential(LBR(in_chans, dim), LBR(dim, dim))
        self.layers = nn.ModuleList(OffsetAttention(dim, mixer, **kwargs) for _ in range(depth))
        self.fuse = LBR(dim * depth, 4 * dim)
        self.out_dim = 4 * dim

    def forward(self, points: Tensor) -> Tensor:
        x, outs = self.embed(points), []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return self.fuse(torch.cat(outs, -1))


def check_points(points: Tensor, in_chans: int) -> None:
    if points.dim() != 3 or points.shape[-1] != in_chans:
        raise ValueError(f"expected points (B, N, {in_chans}), got {tuple(points.shape)}")


class PointClassifier(nn.Module):
    """Shape classification: logits ``(B, num_classes)`` of point clouds ``(B, N, 3)`` (module docstring)."""

    def __init__(self, num_classes: int = 40, in_chans: int = 3, dim: int = 128, depth: int = 4,
                 mixer: str = "external", memory_size: int = 64, num_heads: int = 1, dropout: float = 0.5) -> None:  # fmt: skip
        super().__init__()
        self.in_chans, self.num_classes = in_chans, num_classes
        self.trunk = PointTrunk(in_chans, dim, depth, mixer, memory_size, num_heads)
        c = self.trunk.out_dim * 2
        self.head = nn.Sequential(
            nn.Linear(c, 512, bias=False), nn.BatchNorm1d(512), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(512, 256, bias=False), nn.BatchNorm1d(256), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(256, num_classes),
        )  # fmt: skip

    def forward(self, points: Tensor) -> Tensor:
        check_points(points, self.in_chans)
        f = self.trunk(points)
        return self.head(torch.cat([f.amax(1), f.mean(1)], -1))


class PartSegmenter(nn.Module):
    """Part segmentation: logits ``(B, N, num_parts)`` of ``points (B, N, 3)`` given each shape's object
    ``category (B,)`` (module docstring), or of ``(B, N, 4)`` points whose last channel is the category."""

    def __init__(self, num_parts: int = 50, num_categories: int = 16, in_chans: int = 3, dim: int = 128,
                 depth: int = 4, mixer: str = "external", memory_size: int = 64, num_heads: int = 1,
                 dropout: float = 0.5) -> None:  # fmt: skip
        super().__init__()
        self.in_chans, self.num_parts = in_chans, num_parts
        self.trunk = PointTrunk(in_chans, dim, depth, mixer, memory_size, num_heads)
        self.category = nn.Embedding(num_categories, 64)
        c = self.trunk.out_dim
        self.head = nn.Sequential(LBR(3 * c + 64, 256), nn.Dropout(dropout), LBR(256, 256), nn.Linear(256, num_parts))

    def forward(self, points: Tensor, category: Tensor | None = None) -> Tensor:
        if category is None:  # a training batch: the category rides as the points' last channel
            category, points = points[:, 0, -1].round().long(), points[..., :-1]
        check_points(points, self.in_chans)
        f = self.trunk(points)
        n = f.shape[1]
        shape = torch.cat([f.amax(1), f.mean(1), self.category(category)], -1)
        return self.head(torch.cat([f, shape[:, None].expand(-1, n, -1)], -1))


#: the named point models: (class, options); ``*_mini`` for CPU tests and quick runs
POINT_MODELS: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {
    "pct_ea": (PointClassifier, dict(dim=128, depth=4, mixer="external", memory_size=64)),
    "pct_sa": (PointClassifier, dict(dim=128, depth=4, mixer="attention")),
    "pct_ea_mini": (PointClassifier, dict(dim=32, depth=2, mixer="external", memory_size=16)),
    "pct_sa_mini": (PointClassifier, dict(dim=32, depth=2, mixer="attention")),
    "pct_partseg_ea": (PartSegmenter, dict(dim=128, depth=4, mixer="external", memory_size=64)),
    "pct_partseg_ea_mini": (PartSegmenter, dict(dim=32, depth=2, mixer="external", memory_size=16)),
}


def build_point_model(name: str, **kwargs: Any) -> nn.Module:
    """The named point model (:data:`POINT_MODELS`) with ``kwargs`` over its options."""
    if name not in POINT_MODELS:
        raise ValueError(f"unknown point model {name!r}; known: {', '.join(POINT_MODELS)}")
    cls, options = POINT_MODELS[name]
    return cls(**{**options, **kwargs})
