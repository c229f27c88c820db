"""RegNetY (Radosavovic et al. 2020, Designing Network Design Spaces): DeiT's teacher (RegNetY-16GF, "RegNetY-160")
and the convolutional rows of DeiT's and TNT's comparisons.

A RegNet is four stages of X blocks (paper Sec. 3 and Fig. 4): a block is a 1x1 convolution, a 3x3 group
convolution of group width ``g`` (carrying the stage's stride 2), a 1x1 convolution, BatchNorm after each and
ReLU after the first two and after the residual sum, with a 1x1 projection shortcut where the shape changes.
The Y block adds squeeze-and-excitation after the 3x3 (Hu et al. 2018: global average, 1x1 to
``round(0.25 · block input width)`` channels, ReLU, 1x1 back, sigmoid gate). The stem is a 3x3 stride-2
convolution to 32 channels; the head global average pooling and a linear classifier.

The widths come from the paper's generator (Sec. 3.3, Eq. 2-3 and pycls' ``generate_regnet``): block j of
``d`` gets ``u_j = w_0 + w_a · j``, quantised to ``w_0 · w_m^round(log(u_j / w_0) / log(w_m))`` and rounded
to a multiple of 8; blocks of equal width form a stage; each stage's width is then rounded to a multiple of
its group width (the group width capped at the width). The rows (paper Table 5 / pycls' model zoo):

============== ===== ======= ===== ===== ===== =================================== ==========
model          d     w_0     w_a   w_m   g     stage widths, depths                params
============== ===== ======= ===== ===== ===== =================================== ==========
RegNetY-4.0GF  22    96      31.41 2.24  64    128, 192, 512, 1088 / 2, 6, 12, 2   20.65M
RegNetY-8.0GF  17    192     76.82 2.19  56    168, 448, 896, 2016 / 2, 4, 10, 1   39.18M
RegNetY-16GF   18    200    106.23 2.48  112   224, 448, 1232, 3024 / 2, 4, 11, 1  83.59M
============== ===== ======= ===== ===== ===== =================================== ==========

Parameter names are timm's ``regnet.py`` (``stem.conv``, ``s1.b1.conv2.bn``, ``s1.b1.se.fc1``,
``s1.b1.downsample.conv``, ``head.fc``), the names of DeiT's RegNetY-16GF teacher checkpoint.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from torch import Tensor, nn

from ..layers.drop import DropPath
from .base import drop_path_rates
from .convnet import ConvClassifier, conv_bn, init_conv_fan_out

QUANTUM = 8  # widths are multiples of 8 (pycls' q)


def regnet_stages(w0: int, wa: float, wm: float, depth: int, group_width: int) -> list[tuple[int, int, int]]:
    """``(width, blocks, group width)`` per stage from the generator's parameters (module docstring)."""
    if w0 <= 0 or w0 % QUANTUM or wa < 0 or wm <= 1 or depth < 1 or group_width < 1:
        raise ValueError(
            f"RegNet needs w0 > 0 a multiple of {QUANTUM}, wa >= 0, wm > 1, depth >= 1, group_width >= 1; got "
            f"w0={w0}, wa={wa}, wm={wm}, depth={depth}, group_width={group_width}"
        )
    widths = []
    for j in range(depth):
        step = round(math.log((w0 + wa * j) / w0) / math.log(wm))
        widths.append(int(round(w0 * wm**step / QUANTUM) * QUANTUM))
    stages = []
    for w in sorted(set(widths)):
        g = min(group_width, w)
        stages.append((int(round(w / g) * g), widths.count(w), g))
    return stages


class ConvBN(nn.Module):
    """Convolution, BatchNorm and (``act``) ReLU: timm's ``ConvNormAct`` names (``conv``, ``bn``)."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1, act: bool = True):
        super().__init__()
        self.conv, self.bn = conv_bn(cin, cout, kernel, stride, groups=groups)
        self.act = nn.ReLU(inplace=True) if act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.bn(self.conv(x)))


class SqueezeExcite(nn.Module):
    """``x · sigmoid(fc2(relu(fc1(mean_hw(x)))))``, 1x1 convolutions with biases (Hu et al. 2018)."""

    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, reduced, 1)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.fc2(self.act(self.fc1(x.mean((2, 3), keepdim=True)))).sigmoid()


class RegBlock(nn.Module):
    """The Y block (X block + SE; bottleneck ratio 1): ``relu(x' + drop_path(conv3(se(conv2(conv1(x))))))``."""

    def __init__(
        self, cin: int, cout: int, stride: int, group_width: int, se_ratio: float, drop_path: float = 0.0
    ) -> None:
        super().__init__()
        self.conv1 = ConvBN(cin, cout, 1)
        self.conv2 = ConvBN(cout, cout, 3, stride, groups=cout // group_width)
        self.se = SqueezeExcite(cout, round(cin * se_ratio)) if se_ratio > 0 else nn.Identity()
        self.conv3 = ConvBN(cout, cout, 1, act=False)
        self.downsample = ConvBN(cin, cout, 1, stride, act=False) if stride != 1 or cin != cout else nn.Identity()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.act3 = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv3(self.se(self.conv2(self.conv1(x))))
        return self.act3(self.drop_path(out) + self.downsample(x))


class RegNet(ConvClassifier):
    """RegNetY (``se_ratio=0``: RegNetX) from the generator's parameters (module docstring).

    Args:
        w0, wa, wm, depth, group_width: the generator's ``w_0``, ``w_a``, ``w_m``, ``d`` and ``g``; it must give
            four stages (as every RegNet of the design space).
        se_ratio: SE width over the block's input width (0.25; 0: the X block).
        stem_width: the stem's channels (32); stem_stride: 2 (1: the ``*_mini`` row's tiny images).
        img_size, in_chans, num_classes, global_pool, drop_rate, drop_path_rate: as :class:`~.resnet.ResNet`.
        zero_init_last: each block's last BatchNorm starts at γ = 0 (timm's default).
    """

    CLASSIFIER = "head.fc"
    first_conv = "stem.conv"

    def __init__(
        self,
        w0: int = 96,
        wa: float = 31.41,
        wm: float = 2.24,
        depth: int = 22,
        group_width: int = 64,
        se_ratio: float = 0.25,
        stem_width: int = 32,
        stem_stride: int = 2,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        zero_init_last: bool = True,
    ) -> None:
        super().__init__()
        plan = regnet_stages(w0, wa, wm, depth, group_width)
        if len(plan) != 4:
            raise ValueError(f"the RegNet generator gave {len(plan)} stages ({plan}); a RegNet has 4")
        if stem_stride not in (1, 2) or in_chans < 1:
            raise ValueError(f"stem_stride must be 1 or 2 and in_chans >= 1, got {stem_stride}, {in_chans}")
        self.stem = ConvBN(in_chans, stem_width, 3, stem_stride)
        dpr = drop_path_rates(drop_path_rate, depth)
        cin, net, k, stages = stem_width, stem_stride, 0, []
        for i, (width, blocks, g) in enumerate(plan):
            layer = OrderedDict()
            for b in range(blocks):
                layer[f"b{b + 1}"] = RegBlock(cin, width, 2 if b == 0 else 1, g, se_ratio, dpr[k])
                cin, k = width, k + 1
            setattr(self, f"s{i + 1}", nn.ModuleDict(layer))
            net *= 2
            stages.append((f"s{i + 1}", width, net, blocks))
        self.head = nn.Module()  # holds ``fc`` (timm's ClassifierHead, whose pooling is forward_head's)
        self._setup(img_size, in_chans, num_classes, global_pool, drop_rate, stages, cin)
        self.init_weights(zero_init_last)

    def init_weights(self, zero_init_last: bool = True) -> None:
        """pycls' init: He-normal convolutions (fan-out), unit BatchNorms, a normal(0, 0.01) classifier with zero
        bias; optionally γ = 0 on each block's last BatchNorm."""
        init_conv_fan_out(self)
        fc = self.get_classifier()
        if isinstance(fc, nn.Linear):
            nn.init.normal_(fc.weight, 0.0, 0.01)
            nn.init.zeros_(fc.bias)
        if zero_init_last:
            for m in self.modules():
                if isinstance(m, RegBlock):
                    nn.init.zeros_(m.conv3.bn.weight)

    @property
    def blocks(self) -> nn.ModuleList:
        """The stages ``s1`` .. ``s4`` (those kept by ``features_only``), each a list of its blocks ``b1``, ..."""
        return nn.ModuleList(nn.ModuleList(getattr(self, n).values()) for n in self.stage_names)

    def forward_stem(self, x: Tensor) -> Tensor:
        return self.stem(x)

    def forward_scripted(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for blk in self.s1.values():
            x = blk(x)
        for blk in self.s2.values():
            x = blk(x)
        for blk in self.s3.values():
            x = blk(x)
        for blk in self.s4.values():
            x = blk(x)
        return x

    def classify(self, x: Tensor) -> Tensor:
        return self.head.fc(x)

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return {"stem": r"^stem\.", "blocks": r"^s(\d+)\." if coarse else r"^s(\d+)\.b(\d+)\."}


__all__ = ["RegBlock", "RegNet", "regnet_stages"]
