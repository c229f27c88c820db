"""Token labelling's data ops (Jiang et al. 2021, LV-ViT; used by Refined-ViT): dense per-patch targets that
follow the image's crop exactly, and MixToken.

Format of a dense target file (what a relabelling teacher writes per image, as the TokenLabeling code does):
``float16 (2, k, Hm, Wm)``, ``[0]`` the top-k class scores and ``[1]`` their class indices on an
``Hm x Wm`` grid over the *whole* image (cell ``(i, j)`` covers rows ``[i H/Hm, (i+1) H/Hm)``), stored as
``<image name>.tl.npy`` beside the image or as the ``tl.npy`` member of a WebDataset sample.

Cropping (:func:`crop_dense`): the score of class ``c`` at output cell ``(i, j)`` of the patch grid is the
bilinear interpolation of the dense map ``S_c`` at the cell's centre mapped through the image's crop box
(and mirrored when the image is), with map values at cell centres and the border repeated -- exactly
``grid_sample(S, grid, align_corners=False, padding_mode="border")``. As the map is top-k, each output cell
is a sum over the four neighbouring cells' k entries: it is kept as ``4k`` (class index, weight) pairs, and
:func:`dense_targets` scatters them into ``(B, cells, num_classes)`` on the device only when the loss needs it.

MixToken (LV-ViT): CutMix on the patch grid -- a box of cells cut with ``lam ~ Beta(alpha, alpha)`` (CutMix's
box rule) is filled from the batch reversed; the images get the box times the patch size, the dense targets
the same cells, and the class targets ``lam * y + (1 - lam) * y.flip(0)`` with ``lam`` the kept fraction.
For a patch embedding that maps each patch on its own (a stride-p convolution) mixing the pixels of whole
patches is exactly mixing the tokens.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .geometry import Box
from .mix import MixParams, MixupCutmix, smooth_one_hot


def _axis(start: float, length: float, full: int, cells: int, out: int, mirror: bool):
    """Bilinear sample positions along one axis: (lower cell, upper cell, upper weight) per output cell."""
    u = (np.arange(out) + 0.5) / out
    if mirror:
        u = 1.0 - u
    pos = (start + u * length) * cells / full - 0.5  # map coordinates, values at cell centres
    pos = np.clip(pos, 0, cells - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, cells - 1)
    return lo, hi, pos - lo


def crop_dense(maps: np.ndarray | Tensor, box: Box, grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """The dense target of one image under its crop ``box``, at the patch ``grid``: ``(classes, weights)``,
    both ``(gh * gw, 4k)`` (long, float32); see the module docstring."""
    maps = torch.as_tensor(np.asarray(maps, dtype=np.float32))
    scores, classes = maps[0], maps[1].round().long()  # (k, Hm, Wm)
    _, hm, wm = scores.shape
    (gh, gw), (H, W) = grid, box.size
    y0, y1, fy = _axis(box.top, box.height, H, hm, gh, False)
    x0, x1, fx = _axis(box.left, box.width, W, wm, gw, box.flip)
    fy, fx = torch.from_numpy(fy).float()[:, None], torch.from_numpy(fx).float()[None, :]
    corners = [(y0, x0, (1 - fy) * (1 - fx)), (y0, x1, (1 - fy) * fx), (y1, x0, fy * (1 - fx)), (y1, x1, fy * fx)]
    idx, wts = [], []
    for ys, xs, w in corners:
        rows, cols = torch.from_numpy(ys)[:, None], torch.from_numpy(xs)[None, :]
        idx.append(classes[:, rows, cols])  # (k, gh, gw)
        wts.append(scores[:, rows, cols] * w)
    idx = torch.cat(idx).flatten(1).T.contiguous()  # (gh * gw, 4k)
    wts = torch.cat(wts).flatten(1).T.contiguous()
    return idx, wts


def dense_targets(classes: Tensor, weights: Tensor, num_classes: int) -> Tensor:
    """Scatter (class, weight) pairs ``(B, N, P)`` into dense per-token scores ``(B, N, num_classes)``; a class
    index outside ``0 .. num_classes - 1`` (maps a teacher of other classes wrote) is one ValueError line."""
    if classes.numel():
        # one host sync per batch: a scatter out of bounds is an opaque error on the CPU and a device-side
        # assert that ends the process on a GPU
        low, high = (int(v) for v in torch.aminmax(classes))
        if low < 0 or high >= num_classes:
            bad = high if high >= num_classes else low
            raise ValueError(
                f"the token-label maps name class {bad}, but the data has {num_classes} classes (0..{num_classes - 1}); "
                "relabel the images with a teacher of these classes (vitlab relabel)"
            )
    out = torch.zeros(*classes.shape[:-1], num_classes, dtype=weights.dtype, device=weights.device)
    return out.scatter_add_(-1, classes, weights)


class MixToken:
    """MixToken as a batch op (see the module docstring): ``(x, y, (classes, weights), g) -> mixed``, and the
    :class:`MixParams` (``box`` in patch cells) so that a model can mix its tokens the same way instead."""

    def __init__(
        self,
        patch_size: int,
        alpha: float = 1.0,
        prob: float = 1.0,
        label_smoothing: float = 0.1,
        num_classes: int = 1000,
    ) -> None:
        if patch_size < 1:
            raise ValueError(f"patch_size must be >= 1, got {patch_size}")
        self.patch_size = patch_size
        self.cutmix = MixupCutmix(0.0, alpha, prob=prob, label_smoothing=label_smoothing, num_classes=num_classes)

    def sample(self, x: Tensor, g: torch.Generator | None) -> MixParams:
        gh, gw = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        if gh * self.patch_size != x.shape[-2] or gw * self.patch_size != x.shape[-1]:
            raise ValueError(f"MixToken: image size {tuple(x.shape[-2:])} is not a multiple of patch {self.patch_size}")
        return self.cutmix.sample(gh, gw, g)

    def apply(
        self, x: Tensor, y: Tensor, dense: tuple[Tensor, Tensor], p: MixParams
    ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        target = smooth_one_hot(y, self.cutmix.num_classes, self.cutmix.label_smoothing).to(x.dtype)
        if p.box is None:
            return x, target, dense
        top, left, h, w = p.box
        s = self.patch_size
        x = x.clone()
        x[:, :, top * s : (top + h) * s, left * s : (left + w) * s] = x.flip(0)[
            :, :, top * s : (top + h) * s, left * s : (left + w) * s
        ]
        gw = x.shape[-1] // s
        cells = torch.zeros(x.shape[-2] // s, gw, dtype=torch.bool, device=x.device)
        cells[top : top + h, left : left + w] = True
        mask = cells.flatten()[None, :, None]
        dense = tuple(torch.where(mask, d.flip(0), d) for d in dense)
        return x, target * p.lam + target.flip(0) * (1 - p.lam), dense

    def __call__(
        self, x: Tensor, y: Tensor, dense: tuple[Tensor, Tensor], g: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        return self.apply(x, y, dense, self.sample(x, g))

    def __repr__(self) -> str:
        c = self.cutmix
        return f"MixToken(patch_size={self.patch_size}, alpha={c.cutmix_alpha}, prob={c.prob}, num_classes={c.num_classes})"


def patch_grid(img_size: tuple[int, int], patch_size: int) -> tuple[int, int]:
    """The token grid of an image: ``(H // p, W // p)``."""
    return math.floor(img_size[0] / patch_size), math.floor(img_size[1] / patch_size)
