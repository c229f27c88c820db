"""Semantic segmentation over any vitlab backbone: backbone pyramid -> neck -> fused map -> head -> class logits.

::

    levels  = backbone.features_only(x)              every stage of a pyramid (PCPVT), or 4 evenly spaced
                                                     blocks of a plain ViT, as (B, C_i, H_i, W_i) maps
    p_i     = Resample_i(Conv_1x1(levels_i))         the neck: a 1x1 lateral per level; a plain ViT's levels
                                                     (all at the patch stride) resampled x4, x2, x1, x1/2
                                                     into a pyramid (the simple feature pyramid of ViTDet)
    fused   = ReLU(BN(Conv_1x1(concat_i Up(p_i))))   every level upsampled to the finest one
    logits  = Up_to_input(head(fused))

Heads: ``plain`` = 3x3 conv-BN-ReLU -> Dropout2d(0.1) -> 1x1 classifier; ``ea`` = EANet's head: 3x3 conv-BN-ReLU
-> :class:`~vitlab.layers.ExternalAttentionConv` (S memory slots, ``ea_norm`` = "double" for the paper's
softmax-over-positions then L1-over-slots, or "softmax" only) -> 3x3 conv-BN-ReLU -> Dropout2d(0.1) -> 1x1
classifier. Both heads differ only by the external-attention block and its second conv, so the pair is the
paper's "with vs without EA" comparison at equal decoder width.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...layers import ExternalAttentionConv
from ...models import build_model
from ...models.base import FeatureGetter

HEADS = ("ea", "plain")
EA_NORMS = ("double", "softmax")
PLAIN_SCALES = (4.0, 2.0, 1.0, 0.5)  # a plain ViT's levels resampled to strides patch/4 ... 2 x patch


def conv_bn_relu(c_in: int, c_out: int, k: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(True))


def upsample(x: Tensor, size: tuple[int, int]) -> Tensor:
    return x if tuple(x.shape[-2:]) == tuple(size) else F.interpolate(x, size, mode="bilinear", align_corners=False)


class Neck(nn.Module):
    """Each level to ``channels`` by a 1x1 conv, then resampled by ``scales[i]`` (1: kept), fused at the
    finest resolution by concatenation and a 1x1 conv-BN-ReLU."""

    def __init__(self, in_channels: list[int], channels: int, scales: list[float]) -> None:
        super().__init__()
        self.laterals = nn.ModuleList(nn.Conv2d(c, channels, 1) for c in in_channels)
        self.scales = list(scales)
        self.fuse = conv_bn_relu(channels * len(in_channels), channels, 1)

    def forward(self, levels: list[Tensor]) -> Tensor:
        maps = []
        for lateral, scale, x in zip(self.laterals, self.scales, levels):
            y = lateral(x)
            if scale != 1:
                y = F.interpolate(y, scale_factor=scale, mode="bilinear", align_corners=False)
            maps.append(y)
        size = max((m.shape[-2:] for m in maps), key=lambda s: s[0] * s[1])
        return self.fuse(torch.cat([upsample(m, size) for m in maps], 1))


class Head(nn.Module):
    """The decoder head (module docstring): ``kind`` "ea" or "plain"."""

    def __init__(self, channels: int, num_classes: int, kind: str = "ea", memory_size: int = 64,
                 ea_norm: str = "double", dropout: float = 0.1) -> None:  # fmt: skip
        super().__init__()
        if kind not in HEADS:
            raise ValueError(f"head must be one of {', '.join(HEADS)}, got {kind!r}")
        if ea_norm not in EA_NORMS:
            raise ValueError(f"ea_norm must be one of {', '.join(EA_NORMS)}, got {ea_norm!r}")
        if memory_size < 1:
            raise ValueError(f"memory_size must be >= 1, got {memory_size}")
        layers: list[nn.Module] = [conv_bn_relu(channels, channels, 3)]
        if kind == "ea":
            layers += [ExternalAttentionConv(channels, memory_size, norm=ea_norm), conv_bn_relu(channels, channels, 3)]
        layers += [nn.Dropout2d(dropout), nn.Conv2d(channels, num_classes, 1)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def plain_levels(num_blocks: int) -> list[int]:
    """Four evenly spaced blocks of a plain ViT, the last included (fewer blocks: all of them)."""
    n = min(len(PLAIN_SCALES), num_blocks)
    return sorted({round((i + 1) * num_blocks / n) - 1 for i in range(n)})


class Segmenter(nn.Module):
    """A backbone's feature pyramid -> :class:`Neck` -> :class:`Head` -> logits ``(B, num_classes, H, W)`` at the
    input resolution. ``backbone`` is a registered model name; ``backbone_kwargs`` go to its constructor
    (``drop_path_rate``, ``mixer``, ...)."""

    def __init__(self, backbone: str, num_classes: int, img_size: int, in_chans: int = 3, head: str = "ea",
                 channels: int = 128, memory_size: int = 64, ea_norm: str = "double", dropout: float = 0.1,
                 **backbone_kwargs: Any) -> None:  # fmt: skip
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"a segmentation model needs at least 2 classes, got {num_classes}")
        net = build_model(backbone, img_size=img_size, in_chans=in_chans, **backbone_kwargs)
        info = net.feature_info
        strides = {int(f["reduction"]) for f in info}
        pyramid = len(strides) > 1
        take = list(range(len(info))) if pyramid else plain_levels(len(info))
        self.backbone = FeatureGetter(net, take)
        chans = [int(f["num_chs"]) for f in self.backbone.feature_info]
        scales = [1.0] * len(take) if pyramid else list(PLAIN_SCALES[-len(take) :])
        self.neck = Neck(chans, channels, scales)
        self.head = Head(channels, num_classes, head, memory_size, ea_norm, dropout)
        self.num_classes, self.img_size, self.in_chans = num_classes, img_size, in_chans
        self.backbone_name = backbone

    def forward(self, x: Tensor) -> Tensor:
        return upsample(self.head(self.neck(self.backbone(x))), x.shape[-2:])

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)

    def no_weight_decay(self) -> set[str]:
        inner = getattr(self.backbone.model, "no_weight_decay", lambda: set())()
        return {f"backbone.model.{n}" for n in inner}


def build_segmenter(backbone: str, **kwargs: Any) -> Segmenter:
    """:class:`Segmenter` of the registered backbone ``backbone`` (the name a run and its checkpoint record)."""
    return Segmenter(backbone, **kwargs)
