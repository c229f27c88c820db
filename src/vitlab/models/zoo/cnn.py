"""The convolutional baselines of the papers' tables: ResNet-50 / 101 / 152 (AFT Table 7, DeiT, TNT; the dilated
``*_d8`` backbones of EANet), RegNetY-4GF / 8GF / 16GF (DeiT's teacher and comparison, TNT's), EfficientNet-B0 ..
B4 (TNT's B3 / B4), and their small ``resnet_mini`` / ``regnety_mini`` / ``efficientnet_mini`` rows.

The architectures are :mod:`vitlab.models.resnet`, :mod:`~vitlab.models.regnet` and
:mod:`~vitlab.models.efficientnet`; the parameter targets are the reference implementations' exact counts
(torchvision's ResNets, pycls' / timm's RegNetY, the TensorFlow reference of EfficientNet), which the papers
print rounded. ``top1`` is what each architecture's own paper or reference release reports; the figure a
vitlab paper prints for it (AFT's 76.9 for ResNet-50, DeiT's 82.9 for its RegNetY-16GF teacher) is in ``notes``.
"""

from __future__ import annotations

from typing import Any

from ..registry import ModelConfig, register
from ..resnet import DEPTHS
from ._shared import MINI_EVAL

RESNET = "He et al. 2016, Deep Residual Learning for Image Recognition (ResNet)"
REGNET = "Radosavovic et al. 2020, Designing Network Design Spaces (RegNet)"
EFFICIENTNET = "Tan & Le 2019, EfficientNet: Rethinking Model Scaling for Convolutional Neural Networks"
TORCHVISION = "https://download.pytorch.org/models/"


def row(name: str, arch: str, paper: str, source: str, kwargs: dict[str, Any], **facts: Any) -> ModelConfig:
    """A convolutional row; ``kwargs`` are constructor arguments (``img_size`` the default input size),
    ``facts`` ModelConfig's (params_m, macs_g, top1, weights_url, notes, crop_pct, interpolation)."""
    return ModelConfig(name, arch, kwargs, paper, source, **facts)


_rows: list[ModelConfig] = []

# --- ResNet: torchvision's "v1.5" bottleneck ResNets; torchvision's evaluation (resize 256, crop 224, bilinear)
# top-1: torchvision's IMAGENET1K_V1 weights (the paper reports 10-crop errors only); MACs counted (He et al.
# Table 1: 3.8 / 7.6 / 11.3 "FLOPs", conv layers only)
for depth, params, macs, top1, weights, notes in (
    (50, 25.557, 4.089, 76.13, "resnet50-0676ba61.pth",
     "AFT Table 7: 25.6M parameters, 76.9 top-1 (its training recipe); DeiT's convnet comparison: 76.2; "
     "a row of TNT's CNN comparison"),
    (101, 44.549, 7.801, 77.37, "resnet101-63fe2227.pth",
     "EANet's backbone (dilated: resnet101_d8); DeiT's convnet comparison: 77.4"),
    (152, 60.193, 11.514, 78.31, "resnet152-394f9c45.pth", "a row of TNT's CNN comparison; DeiT's: 78.3"),
):  # fmt: skip
    _rows.append(
        row(
            f"resnet{depth}",
            "resnet",
            RESNET,
            f"torchvision resnet{depth} (Bottleneck v1.5, stride on the 3x3)",
            dict(depths=DEPTHS[depth]),
            params_m=params,
            macs_g=macs,
            top1=top1,
            weights_url=TORCHVISION + weights,
            notes=notes,
            interpolation="bilinear",
        )
    )
# dilated backbones for dense prediction: stages 3-4 at stride 1 with dilation 2 and 4 (C5 at 1/8)
for depth, params, macs in ((50, 25.557, 19.079), (101, 44.549, 33.928)):
    _rows.append(
        row(
            f"resnet{depth}_d8",
            "resnet",
            RESNET,
            f"torchvision resnet{depth} with replace_stride_with_dilation=(False, True, True) (DeepLab, EANet)",
            dict(depths=DEPTHS[depth], output_stride=8),
            params_m=params,
            macs_g=macs,
            notes="the same parameters as the classifier; C5 at stride 8 (EANet's and DeepLab's backbone)",
            interpolation="bilinear",
        )
    )

# --- RegNetY: pycls' dds_baselines (the paper's models; timm regnety_040/080/160 names); top-1: pycls model
# zoo (100 epochs, the paper's setting: errors 20.6 / 20.1 / 19.6); MACs counted (the paper: 4.0 / 8.0 / 15.9)
for gf, gen, params, macs, top1, extra in (
    ("040", dict(w0=96, wa=31.41, wm=2.24, depth=22, group_width=64), 20.647, 3.973, 79.4,
     "DeiT (its training recipe): 80.0 top-1, as a teacher and in its convnet comparison"),
    ("080", dict(w0=192, wa=76.82, wm=2.19, depth=17, group_width=56), 39.180, 7.963, 79.9,
     "DeiT: 81.7 top-1 with its recipe; a row of TNT's CNN comparison (RegNetY-8GF)"),
    ("160", dict(w0=200, wa=106.23, wm=2.48, depth=18, group_width=112), 83.590, 15.912, 80.4,
     "DeiT's teacher RegNetY-16GF ('RegNetY-160'): 82.9 top-1 with DeiT's recipe (weights_url: its checkpoint, "
     "timm names); a row of TNT's CNN comparison"),
):  # fmt: skip
    _rows.append(
        row(
            f"regnety_{gf}",
            "regnet",
            REGNET,
            f"pycls RegNetY-{int(gf) / 10:g}GF (timm regnety_{gf})",
            gen,
            params_m=params,
            macs_g=macs,
            top1=top1,
            weights_url="https://dl.fbaipublicfiles.com/deit/regnety_160-a5fe301d.pth" if gf == "160" else "",
            notes=extra,
        )
    )

# --- EfficientNet: the TensorFlow reference's efficientnet-b0..b4 (timm efficientnet_b* names); the paper's
# resolution, dropout and drop connect; evaluation: centre crop of size / (size + 32), bicubic; top-1: paper
# Table 2; MACs counted (Table 2: 0.39 / 0.70 / 1.0 / 1.8 / 4.2 "FLOPs")
for b, (width, depth, size, drop, params, macs, top1) in enumerate(
    (
        (1.0, 1.0, 224, 0.2, 5.289, 0.386, 77.1),
        (1.0, 1.1, 240, 0.2, 7.794, 0.687, 79.1),
        (1.1, 1.2, 260, 0.3, 9.110, 0.994, 80.1),
        (1.2, 1.4, 300, 0.3, 12.233, 1.827, 81.6),
        (1.4, 1.8, 380, 0.4, 19.342, 4.394, 82.9),
    )
):
    _rows.append(
        row(
            f"efficientnet_b{b}",
            "efficientnet",
            EFFICIENTNET,
            f"tensorflow/tpu efficientnet_builder efficientnet-b{b} (timm efficientnet_b{b})",
            dict(width_mult=width, depth_mult=depth, img_size=size, drop_rate=drop, drop_path_rate=0.2),
            params_m=params,
            macs_g=macs,
            top1=top1,
            crop_pct=round(size / (size + 32), 3),
            notes="a row of TNT's CNN comparison (the paper: 12M / 19M, 1.8 / 4.2 G)" if b in (3, 4) else "",
        )
    )

# --- small variants for CPU training (32 px, as the ViT minis; about deit_mini's size and speed), with a
# stride-1 stem so that a 28-32 px image keeps a 4x4 (RegNet, EfficientNet: 2x2) last map, and some stages of
# more than one block (the feature evolution compares the blocks of a stage)
_rows += [
    row(
        "resnet_mini",
        "resnet",
        RESNET,
        "vitlab: small bottleneck ResNet (widths 8-64, outputs 32-256, two blocks per stage, 3x3 stride-1 stem)",
        dict(depths=(2, 2, 2, 2), widths=(8, 16, 32, 64), stem_width=16, small_stem=True, img_size=32),
        **MINI_EVAL,
    ),
    row(
        "regnety_mini",
        "regnet",
        REGNET,
        "vitlab: small RegNetY from the generator (w0 16, wa 16, wm 2, d 6, g 16: widths 16-128, depths 1, 1, 3, 1)",
        dict(w0=16, wa=16.0, wm=2.0, depth=6, group_width=16, stem_width=16, stem_stride=1, img_size=32),
        **MINI_EVAL,
    ),
    row(
        "efficientnet_mini",
        "efficientnet",
        EFFICIENTNET,
        "vitlab: EfficientNet-B0 scaled to width 0.25, depth 0.5 (blocks 1, 1, 1, 2, 2, 2, 1), stride-1 stem",
        dict(
            width_mult=0.25,
            depth_mult=0.5,
            stem_stride=1,
            img_size=32,
            drop_rate=0.0,
            drop_path_rate=0.0,
            bn_momentum=0.1,
        ),
        **MINI_EVAL,
    ),
]

register(*_rows)
