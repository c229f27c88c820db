"""The feature pyramid a two-stage detector reads, from any registered vitlab model.

A registered model gives its features through :class:`~vitlab.models.base.FeatureGetter` (timm's
``features_only``): every stage of a pyramid (PCPVT, ResNet), each at its own stride, or blocks of a plain ViT
(DeiT, TNT, T2T, the EA-equipped models), all at the patch stride. The detector wants four maps at strides 4, 8,
16 and 32, each level built from one of them::

    feats   = FeatureGetter(model)(x)              every stage of a pyramid, or 4 evenly spaced blocks of a
                                                   plain ViT (the segmentation neck's choice), (B, C_j, H_j, W_j)
    c_i     = Resample_i(feats[src_i])             i = 0..3 at stride s_i = 4, 8, 16, 32: a pyramid's stage at
                                                   s_i itself (none there: the nearest one); a plain ViT's i-th
                                                   block. Coarser than needed: 2x2 transposed convs (x2 each,
                                                   half the channels each, LayerNorm-GELU between: ViTDet's
                                                   simple feature pyramid); finer: 2x2 max pools. A plain
                                                   ViT's blocks are LayerNorm-ed first (residual stream)
    p       = FPN(c_0 .. c_3)                      torchvision's FeaturePyramidNetwork: 1x1 laterals to
                                                   ``out_channels``, top-down sums, 3x3 output convs, then a
                                                   max pool of p_3 (LastLevelMaxPool): maps "0".."3", "pool"

The input is padded (by the detector's transform) to a multiple of :func:`size_divisible`, so every level is
exactly the image's size over its stride, which torchvision's anchor generator and RoI pooler assume.
"""

from __future__ import annotations

import inspect
import math
from collections import OrderedDict
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from ...models import build_model
from ...models.base import FeatureGetter
from ...models.registry import MODELS
from ..segmentation.models import plain_levels

LEVEL_STRIDES = (4, 8, 16, 32)  # the maps "0".."3" (torchvision's FPN adds "pool" at 64)


class ChannelNorm(nn.LayerNorm):
    """LayerNorm over the channels of a ``(B, C, H, W)`` map (ViTDet's norm between its deconvolutions)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Resample(nn.Module):
    """A map at stride ``stride_in`` to stride ``stride_out``: optionally LayerNorm first (``norm``), then
    ``log2(stride_in / stride_out)`` 2x2 transposed convs (each halving the channels, LayerNorm-GELU between
    two) or as many 2x2 max pools the other way; then, only if the strides are not a power of two apart, a
    bilinear resize to the exact size asked for."""

    def __init__(self, channels: int, stride_in: int, stride_out: int, norm: bool = False) -> None:
        super().__init__()
        steps = round(math.log2(stride_in / stride_out))
        layers: list[nn.Module] = [ChannelNorm(channels)] if norm else []
        for k in range(steps):  # upsampling: the coarse map of a plain ViT towards stride 4
            if k:
                layers += [ChannelNorm(channels), nn.GELU()]
            layers.append(nn.ConvTranspose2d(channels, max(channels // 2, 1), 2, stride=2))
            channels = max(channels // 2, 1)
        layers += [nn.MaxPool2d(2, 2) for _ in range(-steps)]
        self.layers = nn.Sequential(*layers)
        self.out_channels = channels

    def forward(self, x: Tensor, size: tuple[int, int]) -> Tensor:
        y = self.layers(x)
        if tuple(y.shape[-2:]) != size:  # a patch size that is not a power of two (14): land on the grid anyway
            y = F.interpolate(y, size, mode="bilinear", align_corners=False)
        return y


def level_sources(strides: list[int], pyramid: bool) -> list[int]:
    """Which feature feeds each of :data:`LEVEL_STRIDES`: a pyramid's stage at that stride, else the nearest
    (in octaves; on a tie, or several at one stride as in a dilated ResNet, the deeper); a plain ViT's blocks
    in order, the last one repeated when it has fewer than four."""
    if not pyramid:
        return [min(i, len(strides) - 1) for i in range(len(LEVEL_STRIDES))]
    return [min(range(len(strides)), key=lambda j, t=t: (abs(math.log2(strides[j] / t)), -j)) for t in LEVEL_STRIDES]


def takes_dynamic_size(backbone: str) -> bool:
    """Whether the registered model ``backbone`` is built with ``dynamic_img_size`` (a position table that
    resamples itself to the input: the detector's images differ in size from batch to batch)."""
    factory, kwargs = MODELS.arguments(backbone, {})
    return "dynamic_img_size" in kwargs or "dynamic_img_size" in inspect.signature(factory).parameters


class VitlabBackbone(nn.Module):
    """A registered model's features as an ``OrderedDict`` of maps ``"0".."3"`` at strides 4, 8, 16, 32 (module
    docstring). ``backbone_kwargs`` go to the model's constructor (``drop_path_rate``, ``mixer``, ``img_size``);
    a model with a position table is built with ``dynamic_img_size=True`` unless told otherwise. A model built
    for one token count (AFT-full without ``resample``) says so at its first forward pass."""

    def __init__(self, backbone: str, **backbone_kwargs: Any) -> None:
        super().__init__()
        if "dynamic_img_size" not in backbone_kwargs and takes_dynamic_size(backbone):
            backbone_kwargs["dynamic_img_size"] = True
        net = build_model(backbone, **backbone_kwargs)
        strides = [int(f["reduction"]) for f in net.feature_info]
        pyramid = len(set(strides)) > 1
        take = list(range(len(strides))) if pyramid else plain_levels(len(strides))
        self.features = FeatureGetter(net, take)
        chans = [int(f["num_chs"]) for f in self.features.feature_info]
        strides = [int(f["reduction"]) for f in self.features.feature_info]
        self.sources = level_sources(strides, pyramid)
        # a plain ViT's blocks give the residual stream before the final norm, whose scale grows with depth:
        # LayerNorm on each (ViTDet normalises in its pyramid too); a pyramid's stages feed the FPN as they are
        self.resample = nn.ModuleList(
            Resample(chans[j], strides[j], t, norm=not pyramid)
            for j, t in zip(self.sources, LEVEL_STRIDES, strict=True)
        )
        self.out_channels_list = [r.out_channels for r in self.resample]
        self.strides = strides
        self.backbone_name = backbone

    def forward(self, x: Tensor) -> OrderedDict[str, Tensor]:
        feats = self.features(x)
        h, w = x.shape[-2:]
        return OrderedDict(
            (str(i), r(feats[j], (math.ceil(h / t), math.ceil(w / t))))
            for i, (r, j, t) in enumerate(zip(self.resample, self.sources, LEVEL_STRIDES, strict=True))
        )

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.features.set_grad_checkpointing(enable)


def size_divisible(strides: list[int]) -> int:
    """The multiple the input is padded to: the coarsest level (32), and the model's own strides (a patch of
    14 needs 14 | H; PCPVT's spatial reduction of 8 on its first stage needs 32 | H, as the coarsest level)."""
    return math.lcm(LEVEL_STRIDES[-1], *strides)


class DetectionBackbone(nn.Module):
    """:class:`VitlabBackbone` then torchvision's FPN with LastLevelMaxPool (module docstring): what
    torchvision's ``GeneralizedRCNN`` calls ``backbone``; it reads ``out_channels``."""

    def __init__(self, backbone: str, out_channels: int = 256, **backbone_kwargs: Any) -> None:
        super().__init__()
        from torchvision.ops import FeaturePyramidNetwork  # the caller has checked that torchvision loads
        from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

        self.body = VitlabBackbone(backbone, **backbone_kwargs)
        self.fpn = FeaturePyramidNetwork(self.body.out_channels_list, out_channels, extra_blocks=LastLevelMaxPool())
        self.out_channels = out_channels
        self.size_divisible = size_divisible(self.body.strides)

    def forward(self, x: Tensor) -> OrderedDict[str, Tensor]:
        return self.fpn(self.body(x))

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.body.set_grad_checkpointing(enable)


__all__ = [
    "LEVEL_STRIDES",
    "ChannelNorm",
    "DetectionBackbone",
    "Resample",
    "VitlabBackbone",
    "level_sources",
    "size_divisible",
    "takes_dynamic_size",
]
