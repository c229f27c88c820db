"""Point-cloud networks in the PCT style (Guo et al. 2021, Point Cloud Transformer), with external attention as
the mixer of their offset-attention layers, the EA paper's point-cloud setting.

Offset attention on per-point features ``F`` (B, N, C)::

    F_out = F + LBR(F - Mixer(F))          LBR = Linear, BatchNorm over the points, ReLU

``Mixer`` is any :mod:`vitlab.mixers` token mixer over the N points: ``external`` (S memory slots, the double
normalisation) by default, ``attention`` for PCT's self-attention. The classifier (:class:`PointClassifier`):
point embedding (two LBR 3 -> C) -> ``depth`` offset-attention layers -> their outputs concatenated -> LBR to
``4 C`` -> max and mean over the points -> MLP (512, 256, dropout 0.5) -> class logits. It has no neighbour
embedding (farthest-point sampling and k-NN grouping): every layer sees all the points ("naive PCT").
The part segmenter (:class:`PartSegmenter`): the same trunk, then each point's ``4 C`` features beside the
shape's max and mean features and an embedding of its object category -> LBR 256 -> dropout -> LBR 256 ->
part logits per point.

The full PCT (:class:`PCT`, models ``pct``, ``pct_full_ea`` and their ``_mini``): PCT's neighbour embedding, then
its offset-attention stack::

    LBR 3 -> 64, LBR 64 -> 64                          every point
    SG(512 centres, k = 32): 64 -> 128                  SG = FPS centres, k-NN, [f_n - f_c, f_c] -> LBR -> LBR -> max_k
    SG(256 centres, k = 32): 128 -> 256                 (:mod:`.neighbours`)
    LBR 256 -> 256 twice, 4 offset-attention layers (256), [their outputs, the SG output] 1280 -> 1024 (LeakyReLU)
    max over the 256 centres -> MLP (512, 256, dropout 0.5) -> class logits

Its offset attention uses PCT's own self-attention (mixer ``pct``, :class:`PCTAttention`: query and key share
one projection to C/4, softmax over the keys then L1 over the queries) unless another mixer is named
(``pct_full_ea``: external attention, the EA paper's point-cloud rows). The MLP's activations are LeakyReLU(0.2),
as the naive classifier's (the reference's Jittor code has ReLU there). PCT's part segmenter has no neighbour
embedding (the reference code's: the naive embedding and point-wise layers), so :class:`PartSegmenter` stays
naive.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...mixers import build as build_mixer
from .neighbours import sample_and_group


class LBR(nn.Module):
    """Linear, BatchNorm over (batch, points), ReLU (LeakyReLU of ``slope`` when it is not 0) on ``(B, N, C)``
    features. ``bias`` adds the linear layer's bias the reference's convolutions carry before a BatchNorm (it
    changes nothing the BatchNorm does not undo, only the parameter count)."""

    def __init__(self, c_in: int, c_out: int, bias: bool = False, slope: float = 0.0) -> None:
        super().__init__()
        self.linear, self.bn = nn.Linear(c_in, c_out, bias=bias), nn.BatchNorm1d(c_out)
        self.slope = slope

    def forward(self, x: Tensor) -> Tensor:
        x = self.bn(self.linear(x).transpose(1, 2)).transpose(1, 2)
        return torch.relu(x) if self.slope == 0 else F.leaky_relu(x, self.slope)


class PCTAttention(nn.Module):
    """PCT's self-attention over the points of ``(B, N, C)`` features (its reference ``SA_Layer``, whose offset
    and LBR :class:`OffsetAttention` adds)::

        Q = F W            (W: C -> C/4, no bias; the keys share it, K = Q)
        A_ij = softmax_j(Q_i . Q_j),   A'_ij = A_ij / (eps + sum_i A_ij)
        out_j = sum_i A'_ij V_i        (V = F W_v + b_v)

    A softmax over the keys then an L1 over the queries (the double normalisation external attention reuses);
    no scaling by sqrt(d), one head."""

    def __init__(self, dim: int, num_heads: int = 1, eps: float = 1e-9) -> None:
        super().__init__()
        if num_heads != 1 or dim % 4:
            raise ValueError(f"PCT's attention is one head over a width divisible by 4, got {num_heads}, {dim}")
        self.qk, self.v, self.eps = nn.Linear(dim, dim // 4, bias=False), nn.Linear(dim, dim), eps

    def forward(self, x: Tensor) -> Tensor:
        q = self.qk(x)
        a = torch.softmax(q @ q.transpose(1, 2), -1)
        a = a / (self.eps + a.sum(1, keepdim=True))
        return a.transpose(1, 2) @ self.v(x)


def mixer_options(mixer: str, memory_size: int, num_heads: int) -> dict[str, Any]:
    """The options a point model gives its offset-attention layers' ``mixer``."""
    kwargs: dict[str, Any] = {"memory_size": memory_size} if mixer.startswith("external") else {}
    return {**kwargs, "num_heads": num_heads}


class OffsetAttention(nn.Module):
    """``F + LBR(F - Mixer(F))`` (module docstring); ``mixer="pct"`` is :class:`PCTAttention`, any other name a
    :mod:`vitlab.mixers` mixer. ``lbr_bias``: the LBR's linear bias (the reference's ``trans_conv`` has one)."""

    def __init__(self, dim: int, mixer: str = "external", lbr_bias: bool = False, **mixer_kwargs: Any) -> None:
        super().__init__()
        self.mixer = PCTAttention(dim, **mixer_kwargs) if mixer == "pct" else build_mixer(mixer, dim, **mixer_kwargs)
        self.lbr = LBR(dim, dim, bias=lbr_bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.lbr(x - self.mixer(x))


class PointTrunk(nn.Module):
    """Point embedding, ``depth`` offset-attention layers, their concatenation lifted to ``4 * dim``."""

    def __init__(self, in_chans: int = 3, dim: int = 128, depth: int = 4, mixer: str = "external",
                 memory_size: int = 64, num_heads: int = 1) -> None:  # fmt: skip
        super().__init__()
        kwargs = mixer_options(mixer, memory_size, num_heads)
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


class SampleGroup(nn.Module):
    """PCT's SG layer: ``samples`` centres by farthest-point sampling, each with its ``k`` nearest points, the
    grouped ``[f_n - f_c, f_c]`` (:func:`~.neighbours.group`) -> LBR -> LBR -> max over the ``k`` neighbours.
    ``(xyz (B, N, 3), feats (B, N, C)) -> (centres (B, samples, 3), (B, samples, c_out))``."""

    def __init__(self, c_in: int, c_out: int, samples: int, k: int) -> None:
        super().__init__()
        self.samples, self.k = samples, k
        self.lbr = nn.Sequential(LBR(2 * c_in, c_out), LBR(c_out, c_out))  # BatchNorm over every (centre, neighbour)

    def forward(self, xyz: Tensor, feats: Tensor) -> tuple[Tensor, Tensor]:
        centres, grouped = sample_and_group(xyz, feats, self.samples, self.k)
        b, s, k, c = grouped.shape
        return centres, self.lbr(grouped.reshape(b * s, k, c)).amax(1).reshape(b, s, -1)


class PCT(nn.Module):
    """The full PCT classifier (module docstring): logits ``(B, num_classes)`` of point clouds ``(B, N, in_chans)``
    whose first three channels are the coordinates, ``N`` at least ``samples[0]``. Widths scale with
    ``embed_dim`` (the paper: 64 -> SG 128, 256 -> fused 1024)."""

    def __init__(self, num_classes: int = 40, in_chans: int = 3, embed_dim: int = 64,
                 samples: tuple[int, int] = (512, 256), k: int = 32, depth: int = 4, mixer: str = "pct",
                 memory_size: int = 64, num_heads: int = 1, dropout: float = 0.5) -> None:  # fmt: skip
        super().__init__()
        if in_chans < 3 or len(samples) != 2 or not 1 <= samples[1] <= samples[0] or not 1 <= k <= samples[0]:
            raise ValueError(f"PCT: needs in_chans >= 3, sample counts s1 >= s2 >= 1 and 1 <= k <= s1, "
                             f"got in_chans={in_chans}, samples={tuple(samples)}, k={k}")  # fmt: skip
        self.in_chans, self.num_classes, self.samples = in_chans, num_classes, tuple(samples)
        e, c = embed_dim, 4 * embed_dim
        self.embed = nn.Sequential(LBR(in_chans, e), LBR(e, e))
        self.sg = nn.ModuleList([SampleGroup(e, 2 * e, samples[0], k), SampleGroup(2 * e, c, samples[1], k)])
        self.pre = nn.Sequential(LBR(c, c), LBR(c, c))
        kwargs = mixer_options(mixer, memory_size, num_heads)
        self.layers = nn.ModuleList(OffsetAttention(c, mixer, lbr_bias=True, **kwargs) for _ in range(depth))
        self.fuse = LBR(c * depth + c, 4 * c, slope=0.2)
        self.head = nn.Sequential(
            nn.Linear(4 * c, 512, bias=False), nn.BatchNorm1d(512), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(512, 256), nn.BatchNorm1d(256), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(256, num_classes),
        )  # fmt: skip

    def forward_features(self, points: Tensor) -> Tensor:
        """The fused per-centre features ``(B, samples[1], 16 embed_dim)`` before the max pooling."""
        check_points(points, self.in_chans)
        if points.shape[1] < self.samples[0]:
            raise ValueError(
                f"PCT samples {self.samples[0]} centres: give at least that many points, got {points.shape[1]}"
            )
        xyz, f = points[..., :3], self.embed(points)
        for sg in self.sg:
            xyz, f = sg(xyz, f)
        x, outs = self.pre(f), []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return self.fuse(torch.cat([*outs, f], -1))

    def forward(self, points: Tensor) -> Tensor:
        return self.head(self.forward_features(points).amax(1))


#: the named point models: (class, options); ``*_mini`` for CPU tests and quick runs
POINT_MODELS: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {
    "pct_ea": (PointClassifier, dict(dim=128, depth=4, mixer="external", memory_size=64)),
    "pct_sa": (PointClassifier, dict(dim=128, depth=4, mixer="attention")),
    "pct_ea_mini": (PointClassifier, dict(dim=32, depth=2, mixer="external", memory_size=16)),
    "pct_sa_mini": (PointClassifier, dict(dim=32, depth=2, mixer="attention")),
    "pct_partseg_ea": (PartSegmenter, dict(dim=128, depth=4, mixer="external", memory_size=64)),
    "pct_partseg_ea_mini": (PartSegmenter, dict(dim=32, depth=2, mixer="external", memory_size=16)),
    # the full PCT (neighbour embedding): PCT's own attention, and external attention in its place (EA paper)
    "pct": (PCT, dict(embed_dim=64, samples=(512, 256), k=32, depth=4, mixer="pct")),
    "pct_full_ea": (PCT, dict(embed_dim=64, samples=(512, 256), k=32, depth=4, mixer="external", memory_size=64)),
    "pct_mini": (PCT, dict(embed_dim=8, samples=(64, 32), k=8, depth=2, mixer="pct")),
    "pct_full_ea_mini": (PCT, dict(embed_dim=8, samples=(64, 32), k=8, depth=2, mixer="external", memory_size=16)),
}


def build_point_model(name: str, **kwargs: Any) -> nn.Module:
    """The named point model (:data:`POINT_MODELS`) with ``kwargs`` over its options."""
    if name not in POINT_MODELS:
        raise ValueError(f"unknown point model {name!r}; known: {', '.join(POINT_MODELS)}")
    cls, options = POINT_MODELS[name]
    return cls(**{**options, **kwargs})
