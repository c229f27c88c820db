"""ResNet-50 (He et al. 2016), the convolutional row of AFT's Table 7 and a distillation teacher.

The bottleneck ResNet: a 7x7 stride-2 stem and 3x3 max pool, four stages of (3, 4, 6, 3) bottleneck blocks
(1x1 reduce, 3x3, 1x1 expand x4, BatchNorm after each, ReLU; the stride on the 3x3 as torchvision's "v1.5"),
a 1x1 projection shortcut where the shape changes, global average pooling and a linear head: 25.56M
parameters for 1000 classes (AFT Table 7: 25.6M, 76.9 top-1). Parameter names follow torchvision's
``resnet50`` (``conv1``, ``bn1``, ``layer1.0.conv1``, ``layer1.0.downsample.0``, ``fc``), so its state dicts load.

It is a plain module, not a registered vitlab model: the registry's contract (token intermediates, position
tables, mixers) is a ViT's. As a teacher it goes in as a TorchScript file (docs/baselines.md).
"""

from __future__ import annotations

from torch import Tensor, nn

STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # width, blocks, stride of ResNet-50
EXPANSION = 4


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    return nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout)


class Bottleneck(nn.Module):
    """``relu(x' + bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))))``, x' = x or its 1x1 projection."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * EXPANSION
        self.conv1, self.bn1 = conv_bn(cin, width, 1)
        self.conv2, self.bn2 = conv_bn(width, width, 3, stride)
        self.conv3, self.bn3 = conv_bn(width, cout, 1)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(*conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """ResNet-50 for ``num_classes`` classes on ``in_chans``-channel images of any size (module docstring)."""

    def __init__(self, num_classes: int = 1000, in_chans: int = 3) -> None:
        super().__init__()
        if num_classes < 1 or in_chans < 1:
            raise ValueError(f"ResNet50: num_classes and in_chans must be >= 1, got {num_classes}, {in_chans}")
        self.num_classes, self.in_chans = num_classes, in_chans
        self.conv1 = nn.Conv2d(in_chans, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        for i, (width, blocks, stride) in enumerate(STAGES, 1):
            layer = []
            for b in range(blocks):
                layer.append(Bottleneck(cin, width, stride if b == 0 else 1))
                cin = width * EXPANSION
            setattr(self, f"layer{i}", nn.Sequential(*layer))
        self.fc = nn.Linear(cin, num_classes)
        self.init_weights()

    def init_weights(self) -> None:
        """He-normal convolutions (fan-out), BatchNorm γ = 1, and γ = 0 on each block's last BatchNorm, so every
        block starts as its shortcut (Goyal et al.'s zero-γ, as torchvision's ``zero_init_residual``)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, Bottleneck):
                nn.init.zeros_(m.bn3.weight)

    def forward_features(self, x: Tensor) -> Tensor:
        """The last stage's feature map (B, 2048, H/32, W/32)."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.forward_features(x).mean((2, 3)))


def resnet50(num_classes: int = 1000, in_chans: int = 3) -> ResNet50:
    """A randomly initialised ResNet-50."""
    return ResNet50(num_classes, in_chans)


__all__ = ["Bottleneck", "ResNet50", "resnet50"]
