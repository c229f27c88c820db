"""Image -> patch tokens: a linear (conv k = s = p) embedding, or the CNN stems of Refined-ViT and DeepViT;
:func:`image_size`, the one check of an image batch every embedding makes (and how it traces with torch.fx)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import probe
from ..ops.fold import can_fold, exporting, fold_bn, records_grad
from ..ops.patchify import patch_tokens
from ..ops.switch import fast_paths_enabled


def _as_pair(v: int | Sequence[int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (v[0], v[1])  # no int(): symbolic sizes stay symbolic under export


def check_image(x: Tensor, in_chans: int, size: Sequence[int] | None = None) -> None:
    """ValueError unless ``x`` is a batch of images ``(B, in_chans, H, W)`` (of ``(H, W) == size`` when given)."""
    if x.dim() != 4 or x.shape[1] != in_chans or (size is not None and tuple(x.shape[-2:]) != tuple(size)):
        hw = f"{size[0]}, {size[1]}" if size is not None else "H, W"
        raise ValueError(f"expected images of shape (B, {in_chans}, {hw}), got {tuple(x.shape)}")


torch.fx.wrap("check_image")  # a traced graph keeps the check as a call, run on every image it gets


def image_size(x: Tensor, in_chans: int, traced_size: Sequence[int] | None = None) -> tuple[int, int]:
    """``(H, W)`` of an image batch ``x``, checked by :func:`check_image`.

    While ``torch.fx`` traces a model, ``x`` is a symbol without sizes and Python cannot branch on them. A model
    whose computation depends on the size only through reshapes (no position table, no mixer built for a token
    count: CPVT, AFT-conv, TNT without a patch table) passes no ``traced_size``: its graph reads ``H`` and ``W``
    from each input and runs at any size. Any other model passes the size it is built for, and its graph is
    built for that size and checks each image against it when it runs (as timm's FX graphs of its fixed-size
    models).
    """
    check_image(x, in_chans, traced_size if isinstance(x, torch.fx.Proxy) else None)
    if isinstance(x, torch.fx.Proxy) and traced_size is not None:
        return _as_pair(tuple(traced_size))
    return (x.shape[-2], x.shape[-1])


def check_patch_grid(h: int, w: int, ph: int, pw: int) -> None:
    """ValueError unless an ``h x w`` image is a positive multiple of the ``ph x pw`` patch."""
    if h % ph or w % pw or h < ph or w < pw:
        raise ValueError(
            f"image size {h}x{w} is not divisible by the patch size {ph}x{pw}: it must be a positive multiple of "
            "the patch size"
        )


torch.fx.wrap("check_patch_grid")  # a graph of any size keeps the check as a call


def patch_grid(img_size: int | Sequence[int], patch_size: tuple[int, int]) -> tuple[int, int]:
    """The ``(H/p, W/p)`` token grid of an image size, checked (:func:`check_patch_grid`); symbolic sizes of a
    torch.fx trace give a symbolic grid."""
    (h, w), (ph, pw) = _as_pair(img_size), patch_size
    check_patch_grid(h, w, ph, pw)
    return h // ph, w // pw


class PatchEmbed(nn.Module):
    """Split the image into ``p x p`` patches and project each to ``dim`` (a conv with kernel = stride = p).

    ``stem_channels`` puts a CNN stem before the projection, as the official code
    of Refined-ViT (32, 64, 128) and DeepViT-S/L (64, 64): conv 7x7/2, then 3x3
    convs, each bias-free + BatchNorm + ReLU; the projection then uses kernel =
    stride = p / 2, so the token grid is the same as the plain embedding's.
    Returns tokens ``(B, N, C)`` and the grid ``(H/p, W/p)``.
    """

    def __init__(
        self,
        patch_size: int | Sequence[int] = 16,
        in_chans: int = 3,
        dim: int = 768,
        stem_channels: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.patch_size = _as_pair(patch_size)
        self.in_chans = in_chans
        layers: list[nn.Module] = []
        c_in, stride = in_chans, 1
        for i, c_out in enumerate(stem_channels):
            k, s = (7, 2) if i == 0 else (3, 1)
            layers += [nn.Conv2d(c_in, c_out, k, s, k // 2, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
            c_in, stride = c_out, stride * s
        if any(p % stride for p in self.patch_size):
            raise ValueError(f"patch size {self.patch_size} must be divisible by the stem stride {stride}")
        self.stem = nn.Sequential(*layers)
        k = (self.patch_size[0] // stride, self.patch_size[1] // stride)
        self.proj = nn.Conv2d(c_in, dim, kernel_size=k, stride=k)

    def grid_size(self, img_size: int | Sequence[int]) -> tuple[int, int]:
        return patch_grid(img_size, self.patch_size)

    def forward(self, x: Tensor, traced_size: Sequence[int] | None = None) -> tuple[Tensor, tuple[int, int]]:
        """``traced_size``: the image size a torch.fx graph is built for (:func:`image_size`)."""
        grid = self.grid_size(image_size(x, self.in_chans, traced_size))
        if not len(self.stem):
            return self.proj(x).flatten(2).transpose(1, 2), grid
        # After a stem the projection (kernel = stride) is one product over the patches on the CPU
        # (:mod:`vitlab.ops.patchify`): the convolution's input gradient is the slow part of its backward pass. On the
        # image (no input gradient) the product saves 0.5 ms of a DeiT-S training step and would keep a copy of the
        # patches for the weight's gradient: the convolution stays.
        return patch_tokens(self.proj, self._stem(x)), grid

    def _stem(self, x: Tensor) -> Tensor:
        # Speed: channels-last is oneDNN's native conv layout (no reorders of these large activations between
        # layers, and the projection's patches are rows of the channels-last memory); in inference each BatchNorm
        # is folded into the conv before it and ReLU runs in place (two passes fewer per layer). A training step
        # on the CPU runs in NCHW where the probe finds channels-last's weight gradients slow
        # (:func:`vitlab.ops.probe.stem_channels_last`: oneDNN without AVX-512).
        if not can_fold(self.stem, x):
            layout = torch.contiguous_format if self._trains_in_nchw(x) else torch.channels_last
            return self.stem(x.contiguous(memory_format=layout))
        x = x.contiguous(memory_format=torch.channels_last)
        for conv, bn, _ in zip(*[iter(self.stem)] * 3):
            w, b = fold_bn(conv.weight, conv.bias, bn)
            x = F.conv2d(x, w, b, conv.stride, conv.padding).relu_()
        return x

    def _trains_in_nchw(self, x: Tensor) -> bool:
        """Whether this call runs the stem in NCHW: a training step (autograd through the stem) on the CPU with
        the fast paths on, where the probe leaves channels-last."""
        return (
            records_grad(self.stem, x)
            and x.device.type == "cpu"
            and fast_paths_enabled()
            and not exporting()
            and not probe.stem_channels_last_taken()
        )
