"""EfficientNet-B0 .. B4 (Tan & Le 2019, EfficientNet: Rethinking Model Scaling for Convolutional Neural Networks),
the convolutional rows of TNT's comparison (EfficientNet-B3 / B4) and of DeiT's.

EfficientNet-B0 (paper Table 1): a 3x3 stride-2 convolution to 32 channels, seven stages of MBConv blocks
(Sandler et al. 2018's inverted residual: 1x1 expansion by 6, k x k depth-wise convolution carrying the stride,
squeeze-and-excitation to ``0.25 ·`` the block's input width, 1x1 linear projection; stage 1 without the
expansion), BatchNorm after every convolution and swish (SiLU) after all but the projection, an identity
shortcut wherever the shape is kept, then a 1x1 convolution to 1280 channels, global average pooling, dropout
and a linear classifier:

=====  ======  =====  =======  ======  ======
stage  expand  k x k  stride   blocks  width
=====  ======  =====  =======  ======  ======
1      1       3      1        1       16
2      6       3      2        2       24
3      6       5      2        2       40
4      6       3      2        3       80
5      6       5      1        3       112
6      6       5      2        4       192
7      6       3      1        1       320
=====  ======  =====  =======  ======  ======

Compound scaling (Sec. 3.3): B1 .. B4 multiply the widths by 1.0, 1.1, 1.2, 1.4 (rounded to multiples of 8,
never down by more than 10 %: the reference ``round_filters``; the stem and the 1280 too) and the blocks of
each stage by 1.1, 1.2, 1.4, 1.8 (rounded up), at 240, 260, 300, 380 px, with dropout 0.2, 0.2, 0.3, 0.3, 0.4.
Drop connect is stochastic depth on each shortcut block: the rate grows as ``0.2 · i / n`` over the ``n``
blocks. BatchNorm as the reference (TensorFlow): eps 1e-3, momentum 0.01 (decay 0.99). Parameters for 1000
classes: 5,288,548 (B0), 7,794,184 (B1), 9,109,994 (B2), 12,233,232 (B3), 19,341,616 (B4).

Parameter names are timm's ``efficientnet_b*`` (``conv_stem``, ``bn1``, ``blocks.1.0.conv_pw``, ``se.conv_reduce``,
``conv_pwl``, ``conv_head``, ``bn2``, ``classifier``); the stages are ``blocks.0`` .. ``blocks.6``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ..layers.drop import DropPath
from .base import MATCH_PREV_GROUP
from .convnet import ConvClassifier, init_conv_fan_out

#: EfficientNet-B0's stages: (expansion, kernel, stride, blocks, width)
B0_STAGES = ((1, 3, 1, 1, 16), (6, 3, 2, 2, 24), (6, 5, 2, 2, 40), (6, 3, 2, 3, 80), (6, 5, 1, 3, 112),
             (6, 5, 2, 4, 192), (6, 3, 1, 1, 320))  # fmt: skip
STEM_WIDTH, HEAD_WIDTH = 32, 1280
BN_EPS, BN_MOMENTUM = 1e-3, 0.01  # TensorFlow's BatchNorm of the reference: epsilon 1e-3, decay 0.99


def round_filters(channels: float, multiplier: float, divisor: int = 8) -> int:
    """The reference's width scaling: ``channels · multiplier`` to the nearest multiple of ``divisor`` (at
    least ``divisor``), one ``divisor`` more where that fell more than 10 % below."""
    scaled = channels * multiplier
    out = max(divisor, int(scaled + divisor / 2) // divisor * divisor)
    return out + divisor if out < 0.9 * scaled else out


def conv_bn_act(cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1):
    """A bias-free ``k x k`` convolution padded to keep ``ceil(size / stride)`` and its BatchNorm (the
    reference's eps and momentum; :class:`EfficientNet` sets its own after building)."""
    conv = nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False)
    return conv, nn.BatchNorm2d(cout, eps=BN_EPS, momentum=BN_MOMENTUM)


class SqueezeExcite(nn.Module):
    """``x · sigmoid(conv_expand(swish(conv_reduce(mean_hw(x)))))`` (timm's names)."""

    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.conv_reduce = nn.Conv2d(channels, reduced, 1)
        self.act1 = nn.SiLU(inplace=True)
        self.conv_expand = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.conv_expand(self.act1(self.conv_reduce(x.mean((2, 3), keepdim=True)))).sigmoid()


class DepthwiseSeparable(nn.Module):
    """MBConv without expansion (stage 1): depth-wise k x k, BN, swish, SE, 1x1 projection, BN (+ shortcut)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, se_ratio: float, drop_path: float) -> None:
        super().__init__()
        self.has_skip = stride == 1 and cin == cout
        self.conv_dw, self.bn1 = conv_bn_act(cin, cin, kernel, stride, groups=cin)
        self.act1 = nn.SiLU(inplace=True)
        self.se = SqueezeExcite(cin, max(1, int(cin * se_ratio))) if se_ratio > 0 else nn.Identity()
        self.conv_pw, self.bn2 = conv_bn_act(cin, cout)
        self.drop_path = DropPath(drop_path) if drop_path > 0 and self.has_skip else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv_pw(self.se(self.act1(self.bn1(self.conv_dw(x))))))
        return self.drop_path(out) + x if self.has_skip else out


class InvertedResidual(nn.Module):
    """MBConv: 1x1 expansion, BN, swish, depth-wise k x k, BN, swish, SE (to ``se_ratio`` of the block's input
    width), 1x1 projection, BN (+ shortcut with drop connect)."""

    def __init__(
        self, cin: int, cout: int, kernel: int, stride: int, expand: int, se_ratio: float, drop_path: float
    ) -> None:
        super().__init__()
        mid = cin * expand
        self.has_skip = stride == 1 and cin == cout
        self.conv_pw, self.bn1 = conv_bn_act(cin, mid)
        self.act1 = nn.SiLU(inplace=True)
        self.conv_dw, self.bn2 = conv_bn_act(mid, mid, kernel, stride, groups=mid)
        self.act2 = nn.SiLU(inplace=True)
        self.se = SqueezeExcite(mid, max(1, int(cin * se_ratio))) if se_ratio > 0 else nn.Identity()
        self.conv_pwl, self.bn3 = conv_bn_act(mid, cout)
        self.drop_path = DropPath(drop_path) if drop_path > 0 and self.has_skip else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = self.act2(self.bn2(self.conv_dw(self.act1(self.bn1(self.conv_pw(x))))))
        out = self.bn3(self.conv_pwl(self.se(out)))
        return self.drop_path(out) + x if self.has_skip else out


class EfficientNet(ConvClassifier):
    """EfficientNet-B0 scaled by ``width_mult`` / ``depth_mult`` (module docstring).

    Args:
        width_mult, depth_mult: the compound scaling's width and depth factors (B0: 1.0, 1.0).
        stages: the B0 table to scale, ``(expansion, kernel, stride, blocks, width)`` per stage.
        se_ratio: SE width over the block's input width (0.25).
        stem_stride: 2 (1: the ``*_mini`` row's tiny images).
        img_size, in_chans, num_classes, global_pool: as :class:`~.resnet.ResNet`.
        drop_rate: dropout before the classifier (0.2 for B0); drop_path_rate: drop connect (0.2).
        bn_momentum: the BatchNorms' running-statistics momentum (0.01: the reference's decay 0.99, for long
            runs; the ``*_mini`` row's few CPU steps take PyTorch's 0.1).
    """

    CLASSIFIER = "classifier"
    first_conv = "conv_stem"

    def __init__(
        self,
        width_mult: float = 1.0,
        depth_mult: float = 1.0,
        stages: Sequence[Sequence[int]] = B0_STAGES,
        se_ratio: float = 0.25,
        stem_stride: int = 2,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        drop_rate: float = 0.2,
        drop_path_rate: float = 0.2,
        bn_momentum: float = BN_MOMENTUM,
    ) -> None:
        super().__init__()
        if width_mult <= 0 or depth_mult <= 0 or stem_stride not in (1, 2) or in_chans < 1:
            raise ValueError(
                f"EfficientNet needs width_mult, depth_mult > 0, stem_stride 1 or 2, in_chans >= 1; got "
                f"{width_mult}, {depth_mult}, {stem_stride}, {in_chans}"
            )
        stem = round_filters(STEM_WIDTH, width_mult)
        self.conv_stem, self.bn1 = conv_bn_act(in_chans, stem, 3, stem_stride)
        self.act1 = nn.SiLU(inplace=True)
        repeats = [math.ceil(depth_mult * s[3]) for s in stages]
        total, k, cin, net, facts, layers = sum(repeats), 0, stem, stem_stride, [], []
        for i, ((expand, kernel, stride, _, width), n) in enumerate(zip(stages, repeats)):
            cout, stage = round_filters(width, width_mult), []
            for b in range(n):
                s, rate = (stride if b == 0 else 1), drop_path_rate * k / total
                if expand == 1:
                    stage.append(DepthwiseSeparable(cin, cout, kernel, s, se_ratio, rate))
                else:
                    stage.append(InvertedResidual(cin, cout, kernel, s, expand, se_ratio, rate))
                cin, k = cout, k + 1
            layers.append(nn.ModuleList(stage))
            net *= stride
            facts.append((f"blocks.{i}", cout, net, n))
        self.blocks = nn.ModuleList(layers)
        head = round_filters(HEAD_WIDTH, width_mult)
        self.conv_head, self.bn2 = conv_bn_act(cin, head)
        self.act2 = nn.SiLU(inplace=True)
        self._setup(img_size, in_chans, num_classes, global_pool, drop_rate, facts, head)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = bn_momentum
        self.init_weights()

    def init_weights(self) -> None:
        """The reference's init: normal(0, sqrt(2 / fan_out)) convolutions, unit BatchNorms, a uniform
        ±1/sqrt(classes) classifier with zero bias."""
        init_conv_fan_out(self)
        fc = self.get_classifier()
        if isinstance(fc, nn.Linear):
            bound = 1.0 / math.sqrt(fc.out_features)
            nn.init.uniform_(fc.weight, -bound, bound)
            nn.init.zeros_(fc.bias)

    def forward_stem(self, x: Tensor) -> Tensor:
        return self.act1(self.bn1(self.conv_stem(x)))

    def forward_final(self, x: Tensor) -> Tensor:
        return self.act2(self.bn2(self.conv_head(x)))

    def forward_scripted(self, x: Tensor) -> Tensor:
        x = self.forward_stem(x)
        for stage in self.blocks:
            for blk in stage:
                x = blk(x)
        return x

    def classify(self, x: Tensor) -> Tensor:
        return self.classifier(x)

    def _prune_final(self) -> None:
        self.conv_head, self.bn2, self.act2 = nn.Identity(), nn.Identity(), nn.Identity()

    def _drop_stage(self, name: str) -> None:
        """(The stages are cut from ``blocks`` at once in :meth:`_prune_after`.)"""

    def _prune_after(self, last: int) -> None:
        self.blocks = self.blocks[: last + 1]
        super()._prune_after(last)

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        stage = r"^blocks\.(\d+)\." if coarse else r"^blocks\.(\d+)\.(\d+)\."
        return {
            "stem": r"^conv_stem\.|^bn1\.",
            "blocks": [(stage, None), (r"^conv_head\.|^bn2\.", (MATCH_PREV_GROUP,))],
        }


__all__ = ["B0_STAGES", "EfficientNet", "round_filters"]
