"""Semantic segmentation over any vitlab backbone: backbone -> decoder -> class logits at the input size.

``decoder="pyramid"`` (default): every level of the backbone's pyramid, fused, then a head::

    levels  = backbone.features_only(x)              every stage of a pyramid (PCPVT, ResNet), or 4 evenly
                                                     spaced blocks of a plain ViT, as (B, C_i, H_i, W_i) maps
    p_i     = Resample_i(Conv_1x1(levels_i))         the neck: a 1x1 lateral per level; a plain ViT's levels
                                                     (all at the patch stride) resampled x4, x2, x1, x1/2
                                                     into a pyramid (the simple feature pyramid of ViTDet)
    fused   = ReLU(BN(Conv_1x1(concat_i Up(p_i))))   every level upsampled to the finest one
    logits  = Up_to_input(head(fused))               head widths C -> C -> C (``channels``, default 128)

``decoder="eanet"``: EANet's network (Guo et al. 2021): the head directly on the backbone's last level, no
neck. With a backbone that takes ``output_stride`` (the dilated ResNets) it is built at output stride 8, unless
told otherwise, so the last level C5 is 2048 x H/8 x W/8::

    logits  = Up_to_input(head(C5))                  head widths 2048 -> 512 -> 256 -> K (``channels`` = 512,
                                                     default; the second conv narrows to channels / 2)
    aux     = Up_to_input(FCNHead(C4))               training only, when ``aux_weight`` > 0: 1024 -> 256 -> K

EANet's official code trains without the auxiliary head (``aux_weight=0``, the default); mmsegmentation's
configs for ADE20K and Cityscapes train one on C4 with weight 0.4. In training mode a model with ``aux_weight``
returns ``(logits, aux)``, which :class:`~vitlab.tasks.segmentation.task.SegLoss` weighs; in evaluation mode
only the logits.

Heads (:mod:`.heads`): ``head="ea"`` (EANet's, external attention), ``"sa"`` (self-attention), ``"sa_dn"``
(self-attention with double normalisation), ``"plain"`` (no attention block), the paper's comparison at equal
decoder widths.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...models import build_model
from ...models.base import FeatureGetter
from ...models.registry import MODELS
from .heads import EA_NORMS, HEADS, FCNHead, Head, conv_bn_relu

DECODERS = ("pyramid", "eanet")
DEFAULT_CHANNELS = {"pyramid": 128, "eanet": 512}
EANET_STRIDE = 8  # EANet's dilated ResNet: the last two stages dilated instead of strided
PLAIN_SCALES = (4.0, 2.0, 1.0, 0.5)  # a plain ViT's levels resampled to strides patch/4 ... 2 x patch


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


def plain_levels(num_blocks: int) -> list[int]:
    """Four evenly spaced blocks of a plain ViT, the last included (fewer blocks: all of them)."""
    n = min(len(PLAIN_SCALES), num_blocks)
    return sorted({round((i + 1) * num_blocks / n) - 1 for i in range(n)})


def takes_output_stride(backbone: str) -> bool:
    """Whether the registered model ``backbone`` is built with an ``output_stride`` (a dilated CNN)."""
    factory, kwargs = MODELS.arguments(backbone, {})
    return "output_stride" in kwargs or "output_stride" in inspect.signature(factory).parameters


class Segmenter(nn.Module):
    """A backbone's features -> decoder (module docstring) -> logits ``(B, num_classes, H, W)`` at the input
    resolution. ``backbone`` is a registered model name; ``backbone_kwargs`` go to its constructor
    (``drop_path_rate``, ``mixer``, ``output_stride``, ...). ``channels``: the head's width (default 128 for the
    pyramid decoder, 512 for EANet's)."""

    def __init__(self, backbone: str, num_classes: int, img_size: int, in_chans: int = 3, head: str = "ea",
                 channels: int | None = None, memory_size: int = 64, ea_norm: str = "double", dropout: float = 0.1,
                 decoder: str = "pyramid", aux_weight: float = 0.0, **backbone_kwargs: Any) -> None:  # fmt: skip
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"a segmentation model needs at least 2 classes, got {num_classes}")
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
        if not 0 <= aux_weight < float("inf"):
            raise ValueError(f"aux_weight must be >= 0, got {aux_weight}")
        if aux_weight and decoder != "eanet":
            raise ValueError("aux_weight: the auxiliary head (on C4) belongs to decoder=eanet")
        channels = channels or DEFAULT_CHANNELS[decoder]
        if decoder == "eanet" and "output_stride" not in backbone_kwargs and takes_output_stride(backbone):
            backbone_kwargs["output_stride"] = EANET_STRIDE
        net = build_model(backbone, img_size=img_size, in_chans=in_chans, **backbone_kwargs)
        info = net.feature_info
        self.decoder, self.aux_weight = decoder, float(aux_weight)
        if decoder == "eanet":
            if aux_weight and len(info) < 2:
                raise ValueError(f"aux_weight: {backbone} has one feature level; the auxiliary head needs two")
            take = [len(info) - 2, len(info) - 1] if aux_weight else [len(info) - 1]  # C4 (aux), C5
            self.backbone = FeatureGetter(net, take)
            chans = [int(f["num_chs"]) for f in self.backbone.feature_info]
            self.neck = None
            narrow = max(1, channels // 2)
            self.head = Head(channels, num_classes, head, memory_size, ea_norm, dropout, in_channels=chans[-1],
                             out_channels=narrow)  # fmt: skip
            self.aux_head = FCNHead(chans[0], narrow, num_classes, dropout) if aux_weight else None
        else:
            strides = {int(f["reduction"]) for f in info}
            pyramid = len(strides) > 1
            take = list(range(len(info))) if pyramid else plain_levels(len(info))
            self.backbone = FeatureGetter(net, take)
            chans = [int(f["num_chs"]) for f in self.backbone.feature_info]
            scales = [1.0] * len(take) if pyramid else list(PLAIN_SCALES[-len(take) :])
            self.neck = Neck(chans, channels, scales)
            self.head = Head(channels, num_classes, head, memory_size, ea_norm, dropout)
            self.aux_head = None
        self.num_classes, self.img_size, self.in_chans = num_classes, img_size, in_chans
        self.backbone_name = backbone

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        levels = self.backbone(x)
        if self.neck is not None:
            return upsample(self.head(self.neck(levels)), x.shape[-2:])
        logits = upsample(self.head(levels[-1]), x.shape[-2:])
        if self.aux_head is not None and self.training:  # the auxiliary loss's logits, training only
            return logits, upsample(self.aux_head(levels[0]), x.shape[-2:])
        return logits

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)

    def no_weight_decay(self) -> set[str]:
        inner = getattr(self.backbone.model, "no_weight_decay", lambda: set())()
        return {f"backbone.model.{n}" for n in inner}


def build_segmenter(backbone: str, **kwargs: Any) -> Segmenter:
    """:class:`Segmenter` of the registered backbone ``backbone`` (the name a run and its checkpoint record)."""
    return Segmenter(backbone, **kwargs)


__all__ = ["DECODERS", "EA_NORMS", "HEADS", "FCNHead", "Head", "Neck", "Segmenter", "build_segmenter", "conv_bn_relu"]
