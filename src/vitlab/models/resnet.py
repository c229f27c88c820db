"""ResNet-50 / 101 / 152 (He et al. 2016, Deep Residual Learning for Image Recognition), the convolutional
baselines of AFT (Table 7: ResNet-50, 25.6M parameters, 76.9 top-1), DeiT, TNT and the backbone of EANet and DETR.

The bottleneck ResNet (paper Table 1): a 7x7 stride-2 convolution (64) and a 3x3 stride-2 max pool, four
stages of ``depths`` = (3, 4, 6, 3) / (3, 4, 23, 3) / (3, 8, 36, 3) bottleneck blocks of widths 64, 128, 256,
512 (1x1 reduce, 3x3, 1x1 expand x4, BatchNorm after each, ReLU after the first two and after the sum; the
stride on the 3x3 as torchvision's "v1.5"), a 1x1 projection shortcut (option B) where the shape changes,
global average pooling and a linear head: 25,557,032 / 44,549,160 / 60,192,808 parameters for 1000 classes.

``output_stride`` 16 or 8 keeps the resolution from stage 4 (resp. 3) on and dilates the 3x3 convolutions by
2 (and 4) instead (DeepLab; the backbone of EANet, and DETR's DC5 at 16): the same parameters, C5 at stride 8.
``small_stem`` (the ``resnet_mini`` row) replaces the stem by a 3x3 stride-1 convolution without max pool, for
28-32 px images. Stochastic depth (``drop_path_rate``, Huang et al. 2016) grows linearly over the blocks.

Parameter names are torchvision's (``conv1``, ``bn1``, ``layer1.0.conv1``, ``layer1.0.downsample.0``, ``fc``):
its ``resnet50`` state dicts load with ``load_state_dict``. The class contract (stages as blocks, the
C2..C5 pyramid of ``features_only``) is :class:`~vitlab.models.convnet.ConvClassifier`'s. ``ResNet50`` and
``resnet50()`` are the fixed-depth constructors of earlier vitlab versions (TorchScript-able teachers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ..layers.drop import DropPath
from .base import drop_path_rates
from .convnet import ConvClassifier, conv_bn, init_conv_fan_out, stage_plan

EXPANSION = 4
WIDTHS = (64, 128, 256, 512)
#: blocks per stage of the paper's Table 1
DEPTHS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
STAGES = tuple(zip(WIDTHS, DEPTHS[50], (1, 2, 2, 2)))  # width, blocks, stride of ResNet-50 (earlier versions)


class Bottleneck(nn.Module):
    """``relu(x' + drop_path(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x))))))))))``, x' = x or its 1x1 projection;
    the 3x3 carries the stride and ``dilation`` (``first_dilation`` is its padding's dilation in a stage's first
    block, as torchvision)."""

    def __init__(
        self,
        cin: int,
        width: int,
        stride: int = 1,
        dilation: int = 1,
        first_dilation: int | None = None,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        cout = width * EXPANSION
        self.conv1, self.bn1 = conv_bn(cin, width, 1)
        self.conv2, self.bn2 = conv_bn(width, width, 3, stride, first_dilation or dilation)
        self.conv3, self.bn3 = conv_bn(width, cout, 1)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(*conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.drop_path(self.bn3(self.conv3(out)))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(ConvClassifier):
    """The bottleneck ResNet (module docstring).

    Args:
        depths: blocks per stage (four stages); widths: their bottleneck widths (outputs are 4x).
        img_size: the default input size (what ``pretrained_cfg`` reports; any size runs).
        in_chans, num_classes: input channels; classes (0: no head, the pooled features come out).
        output_stride: 32, 16 or 8 (dilated stages, same parameters).
        stem_width: the stem's channels; small_stem: a 3x3 stride-1 stem without max pool (tiny images).
        global_pool: ``"avg"`` (the paper), ``"max"``, ``"avgmax"`` or ``""``.
        drop_rate: dropout before the classifier; drop_path_rate: stochastic depth of the last block.
        zero_init_residual: each block's last BatchNorm starts at γ = 0, so every block starts as its shortcut
            (Goyal et al. 2017; torchvision's ``zero_init_residual``).
    """

    CLASSIFIER = "fc"
    first_conv = "conv1"

    def __init__(
        self,
        depths: Sequence[int] = DEPTHS[50],
        widths: Sequence[int] = WIDTHS,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        output_stride: int = 32,
        stem_width: int = 64,
        small_stem: bool = False,
        global_pool: str = "avg",
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        zero_init_residual: bool = True,
    ) -> None:
        super().__init__()
        if len(depths) != 4 or len(widths) != 4 or min(depths) < 1 or min(widths) < 1:
            raise ValueError(f"a ResNet has four stages of >= 1 blocks, got depths={depths}, widths={widths}")
        if in_chans < 1:
            raise ValueError(f"in_chans must be >= 1, got {in_chans}")
        kernel, stem_stride = (3, 1) if small_stem else (7, 2)
        self.conv1, self.bn1 = conv_bn(in_chans, stem_width, kernel, stem_stride)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity() if small_stem else nn.MaxPool2d(3, 2, 1)
        self.output_stride = output_stride
        plan = stage_plan((1, 2, 2, 2), 1 if small_stem else 4, output_stride)
        dpr = drop_path_rates(drop_path_rate, sum(depths))
        cin, net, stages, k = stem_width, 1 if small_stem else 4, [], 0
        for i, (width, blocks, (stride, first, dilation)) in enumerate(zip(widths, depths, plan)):
            layer = []
            for b in range(blocks):
                layer.append(
                    Bottleneck(cin, width, stride if b == 0 else 1, dilation, first if b == 0 else None, dpr[k])
                )
                cin, k = width * EXPANSION, k + 1
            setattr(self, f"layer{i + 1}", nn.ModuleList(layer))
            net *= stride
            stages.append((f"layer{i + 1}", cin, net, blocks))
        self._setup(img_size, in_chans, num_classes, global_pool, drop_rate, stages, cin)
        self.init_weights(zero_init_residual)

    def init_weights(self, zero_init_residual: bool = True) -> None:
        """He-normal convolutions (fan-out), unit BatchNorms, PyTorch's default linear head; optionally γ = 0 on
        each block's last BatchNorm."""
        init_conv_fan_out(self)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)

    @property
    def blocks(self) -> nn.ModuleList:
        """The stages ``layer1`` .. ``layer4`` (those kept by ``features_only``), each a list of its blocks."""
        return nn.ModuleList(getattr(self, n) for n in self.stage_names)

    def forward_stem(self, x: Tensor) -> Tensor:
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))

    def forward_scripted(self, x: Tensor) -> Tensor:
        x = self.forward_stem(x)
        for blk in self.layer1:
            x = blk(x)
        for blk in self.layer2:
            x = blk(x)
        for blk in self.layer3:
            x = blk(x)
        for blk in self.layer4:
            x = blk(x)
        return x

    def classify(self, x: Tensor) -> Tensor:
        return self.fc(x)

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        stage = r"^layer(\d+)\." if coarse else r"^layer(\d+)\.(\d+)\."
        return {"stem": r"^conv1\.|^bn1\.", "blocks": [(stage, None)]}


class ResNet50(ResNet):
    """ResNet-50 for ``num_classes`` (>= 1) classes on ``in_chans``-channel images of any size: the constructor
    of earlier vitlab versions (``build_model("resnet50")`` is the registered model, with the build record)."""

    def __init__(self, num_classes: int = 1000, in_chans: int = 3, **kwargs: Any) -> None:
        if num_classes < 1 or in_chans < 1:
            raise ValueError(f"ResNet50: num_classes and in_chans must be >= 1, got {num_classes}, {in_chans}")
        super().__init__(DEPTHS[50], num_classes=num_classes, in_chans=in_chans, **kwargs)


def resnet50(num_classes: int = 1000, in_chans: int = 3, **kwargs: Any) -> ResNet50:
    """A randomly initialised ResNet-50 (``kwargs``: :class:`ResNet`'s, e.g. ``output_stride=8``)."""
    return ResNet50(num_classes, in_chans, **kwargs)


__all__ = ["DEPTHS", "Bottleneck", "ResNet", "ResNet50", "resnet50"]
