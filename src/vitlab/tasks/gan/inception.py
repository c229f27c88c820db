"""The Inception-v3 of FID (Heusel et al. 2017) without torchvision: the 2015-12-05 TensorFlow graph's network,
as published for PyTorch in ``pt_inception-2015-12-05-6726825d.pth``, whose parameter names (torchvision's
``Inception3`` layout) this module has, so that file loads into it as it is.

FID's network differs from the classification Inception-v3 in its pooling branches (the TF graph's): the average
pools of the A, C and first E blocks leave the padding out of the average, and the last E block max-pools.
Features: the 2048 channels of the last block, averaged over the positions. Inputs: images in [0, 1] (or uint8
in [0, 255]), resized to 299 x 299 (bilinear) and mapped to [-1, 1]; a one-channel image is repeated to three.
torch-fidelity's network (what torchmetrics' own FID loads) is the same graph but resizes as TF 1.x does, so
scores differ from it in the decimals.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WEIGHTS_FILE = "pt_inception-2015-12-05-6726825d.pth"


class Conv(nn.Module):
    """conv (no bias) → BatchNorm (eps 1e-3, the TF graph's) → ReLU; named ``conv`` / ``bn`` as the file."""

    def __init__(self, c_in: int, c_out: int, kernel: int | tuple[int, int], **kw) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel, bias=False, **kw)
        self.bn = nn.BatchNorm2d(c_out, eps=0.001)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)))


def avg3(x: Tensor) -> Tensor:
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


def row_col(c_in: int, c_out: int, k: int, rows_first: bool) -> Conv:
    """A 1 x k (or k x 1) convolution that keeps the size."""
    kernel, pad = ((k, 1), (k // 2, 0)) if rows_first else ((1, k), (0, k // 2))
    return Conv(c_in, c_out, kernel, padding=pad)


class BlockA(nn.Module):  # 35 x 35: 1x1 | 1x1 → 5x5 | 1x1 → 3x3 → 3x3 | avg → 1x1
    def __init__(self, c_in: int, pool: int) -> None:
        super().__init__()
        self.branch1x1 = Conv(c_in, 64, 1)
        self.branch5x5_1, self.branch5x5_2 = Conv(c_in, 48, 1), Conv(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = Conv(c_in, 64, 1)
        self.branch3x3dbl_2, self.branch3x3dbl_3 = Conv(64, 96, 3, padding=1), Conv(96, 96, 3, padding=1)
        self.branch_pool = Conv(c_in, pool, 1)

    def forward(self, x: Tensor) -> Tensor:
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch1x1(x), b5, b3, self.branch_pool(avg3(x))], 1)


class BlockB(nn.Module):  # 35 → 17: 3x3/2 | 1x1 → 3x3 → 3x3/2 | max/2
    def __init__(self, c_in: int) -> None:
        super().__init__()
        self.branch3x3 = Conv(c_in, 384, 3, stride=2)
        self.branch3x3dbl_1, self.branch3x3dbl_2 = Conv(c_in, 64, 1), Conv(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = Conv(96, 96, 3, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), b3, F.max_pool2d(x, 3, stride=2)], 1)


class BlockC(nn.Module):  # 17 x 17, factorised 7x7: 1x1 | 1x7, 7x1 | 7x1, 1x7, 7x1, 1x7 | avg → 1x1
    def __init__(self, c_in: int, c7: int) -> None:
        super().__init__()
        self.branch1x1 = Conv(c_in, 192, 1)
        self.branch7x7_1, self.branch7x7_2 = Conv(c_in, c7, 1), row_col(c7, c7, 7, rows_first=False)
        self.branch7x7_3 = row_col(c7, 192, 7, rows_first=True)
        self.branch7x7dbl_1 = Conv(c_in, c7, 1)
        self.branch7x7dbl_2 = row_col(c7, c7, 7, rows_first=True)
        self.branch7x7dbl_3 = row_col(c7, c7, 7, rows_first=False)
        self.branch7x7dbl_4 = row_col(c7, c7, 7, rows_first=True)
        self.branch7x7dbl_5 = row_col(c7, 192, 7, rows_first=False)
        self.branch_pool = Conv(c_in, 192, 1)

    def forward(self, x: Tensor) -> Tensor:
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        d = x
        for i in range(1, 6):
            d = getattr(self, f"branch7x7dbl_{i}")(d)
        return torch.cat([self.branch1x1(x), b7, d, self.branch_pool(avg3(x))], 1)


class BlockD(nn.Module):  # 17 → 8: 1x1 → 3x3/2 | 1x1 → 1x7 → 7x1 → 3x3/2 | max/2
    def __init__(self, c_in: int) -> None:
        super().__init__()
        self.branch3x3_1, self.branch3x3_2 = Conv(c_in, 192, 1), Conv(192, 320, 3, stride=2)
        self.branch7x7x3_1 = Conv(c_in, 192, 1)
        self.branch7x7x3_2 = row_col(192, 192, 7, rows_first=False)
        self.branch7x7x3_3 = row_col(192, 192, 7, rows_first=True)
        self.branch7x7x3_4 = Conv(192, 192, 3, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([self.branch3x3_2(self.branch3x3_1(x)), b7, F.max_pool2d(x, 3, stride=2)], 1)


class BlockE(nn.Module):  # 8 x 8: 1x1 | 1x1 → (1x3 ‖ 3x1) | 1x1 → 3x3 → (1x3 ‖ 3x1) | pool → 1x1
    def __init__(self, c_in: int, max_pool: bool) -> None:
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = Conv(c_in, 320, 1)
        self.branch3x3_1 = Conv(c_in, 384, 1)
        self.branch3x3_2a = row_col(384, 384, 3, rows_first=False)
        self.branch3x3_2b = row_col(384, 384, 3, rows_first=True)
        self.branch3x3dbl_1, self.branch3x3dbl_2 = Conv(c_in, 448, 1), Conv(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = row_col(384, 384, 3, rows_first=False)
        self.branch3x3dbl_3b = row_col(384, 384, 3, rows_first=True)
        self.branch_pool = Conv(c_in, 192, 1)

    def forward(self, x: Tensor) -> Tensor:
        a = self.branch3x3_1(x)
        d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        pooled = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else avg3(x)
        return torch.cat(
            [
                self.branch1x1(x),
                self.branch3x3_2a(a),
                self.branch3x3_2b(a),
                self.branch3x3dbl_3a(d),
                self.branch3x3dbl_3b(d),
                self.branch_pool(pooled),
            ],
            1,
        )


class FIDInceptionV3(nn.Module):
    """images (B, 1 or 3, H, W) in [0, 1] (or uint8) → FID features (B, 2048) (module docstring). Always in
    eval mode; ``num_features`` is what torchmetrics' ``FrechetInceptionDistance(feature=...)`` reads."""

    num_features = 2048

    def __init__(self) -> None:
        super().__init__()
        self.Conv2d_1a_3x3 = Conv(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = Conv(32, 32, 3)
        self.Conv2d_2b_3x3 = Conv(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = Conv(64, 80, 1)
        self.Conv2d_4a_3x3 = Conv(80, 192, 3)
        self.Mixed_5b, self.Mixed_5c, self.Mixed_5d = BlockA(192, 32), BlockA(256, 64), BlockA(288, 64)
        self.Mixed_6a = BlockB(288)
        self.Mixed_6b, self.Mixed_6c = BlockC(768, 128), BlockC(768, 160)
        self.Mixed_6d, self.Mixed_6e = BlockC(768, 160), BlockC(768, 192)
        self.Mixed_7a = BlockD(768)
        self.Mixed_7b, self.Mixed_7c = BlockE(1280, max_pool=False), BlockE(2048, max_pool=True)
        self.fc = nn.Linear(2048, 1008)  # the graph's logits: in the file, unused by FID
        self.eval()

    def train(self, mode: bool = True) -> FIDInceptionV3:
        return super().train(False)  # a fixed feature extractor: BatchNorm keeps its statistics

    @torch.no_grad()
    def forward(self, x: Tensor) -> Tensor:
        x = x.float() / 255 if x.dtype == torch.uint8 else x.float()
        x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
        x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False) * 2 - 1
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(F.max_pool2d(x, 3, stride=2)))
        x = F.max_pool2d(x, 3, stride=2)
        for name in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e", "7a", "7b", "7c"):
            x = getattr(self, f"Mixed_{name}")(x)
        return x.mean(dim=(2, 3))


def load_fid_inception(path: str | Path) -> FIDInceptionV3:
    """:class:`FIDInceptionV3` with the weights of ``path`` (the file :data:`WEIGHTS_FILE`); a file of other
    weights is one line naming what does not fit."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a state dict of Inception weights ({WEIGHTS_FILE})")
    model = FIDInceptionV3()
    own = model.state_dict()
    state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}  # a BN counter, unused
    missing = sorted(k for k in own if k not in state and not k.endswith("num_batches_tracked"))
    unexpected = sorted(k for k in state if k not in own and not k.startswith("AuxLogits."))
    shapes = sorted(k for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape))
    if missing or unexpected or shapes:
        found = (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes))
        what = [f"{len(v)} {n} (e.g. {v[0]})" for n, v in found if v]
        raise ValueError(f"{path} is not FID's Inception weights ({WEIGHTS_FILE}): {'; '.join(what)}")
    model.load_state_dict(state, strict=False)
    return model
