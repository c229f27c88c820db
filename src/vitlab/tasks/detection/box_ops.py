"""Box arithmetic for the set-prediction detectors: formats, areas, pairwise IoU and generalized IoU.

Boxes are ``(..., 4)`` tensors, either corners ``(x0, y0, x1, y1)`` (xyxy) or centre and size ``(cx, cy, w, h)``
(cxcywh, DETR's regression target). For boxes A (n of them) and B (m), as ``(n, m)`` matrices::

    |A ∩ B| = max(0, min(x1) - max(x0)) · max(0, min(y1) - max(y0))
    IoU     = |A ∩ B| / |A ∪ B|,            |A ∪ B| = |A| + |B| - |A ∩ B|
    GIoU    = IoU - |C \\ (A ∪ B)| / |C|     C the smallest box enclosing A and B (Rezatofighi et al. 2019, eq. 1)

GIoU lies in (-1, 1]: it is IoU for overlapping boxes and keeps a gradient for disjoint ones (where IoU is flat at
0), falling towards -1 as they move apart. Areas are clamped at a tiny positive value in the denominators so
that degenerate (zero-area) boxes give finite numbers instead of NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-7  # far below any area of a real box, normalised (~1e-4 for a 1% box) or in pixels


def cxcywh_to_xyxy(b: Tensor) -> Tensor:
    """``(cx, cy, w, h)`` -> ``(cx - w/2, cy - h/2, cx + w/2, cy + h/2)``."""
    c, s = b[..., :2], b[..., 2:]
    return torch.cat((c - s / 2, c + s / 2), -1)


def xyxy_to_cxcywh(b: Tensor) -> Tensor:
    """``(x0, y0, x1, y1)`` -> ``((x0 + x1)/2, (y0 + y1)/2, x1 - x0, y1 - y0)``."""
    lo, hi = b[..., :2], b[..., 2:]
    return torch.cat(((lo + hi) / 2, hi - lo), -1)


def box_area(b: Tensor) -> Tensor:
    """``(x1 - x0) · (y1 - y0)`` of xyxy boxes, ``(...)``."""
    return (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])


def _inter_union(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    wh = (torch.min(a[:, None, 2:], b[None, :, 2:]) - torch.max(a[:, None, :2], b[None, :, :2])).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter, box_area(a)[:, None] + box_area(b)[None, :] - inter


def box_iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU of every pair of xyxy boxes ``a`` ``(n, 4)`` and ``b`` ``(m, 4)``: ``(n, m)`` (module docstring)."""
    inter, union = _inter_union(a, b)
    return inter / union.clamp(min=EPS)


def generalized_box_iou(a: Tensor, b: Tensor) -> Tensor:
    """GIoU = IoU - |C \\ (A ∪ B)| / |C| of every pair of xyxy boxes ``a`` ``(n, 4)`` and ``b`` ``(m, 4)``:
    ``(n, m)`` (Rezatofighi et al. 2019, eq. 1; module docstring)."""
    inter, union = _inter_union(a, b)
    wh = (torch.max(a[:, None, 2:], b[None, :, 2:]) - torch.min(a[:, None, :2], b[None, :, :2])).clamp(min=0)
    hull = (wh[..., 0] * wh[..., 1]).clamp(min=EPS)
    return inter / union.clamp(min=EPS) - (hull - union) / hull


__all__ = ["EPS", "box_area", "box_iou", "cxcywh_to_xyxy", "generalized_box_iou", "xyxy_to_cxcywh"]
