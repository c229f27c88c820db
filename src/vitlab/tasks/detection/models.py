"""The detectors of ``vitlab det``, by name: :func:`build_detector` (backbone, detector kind, classes, switches).

- ``detr``: :class:`~.detr.DETR` (Carion et al. 2020), its position encoding ``pos=sine|learned|peg|none``
  (``peg``: CPVT's PEG for detection, Chu et al. 2021);
- ``faster_rcnn``, ``mask_rcnn``: torchvision's Faster / Mask R-CNN on a feature pyramid of the backbone
  (:mod:`.rcnn`; they need torchvision's compiled ops, imported only when asked for).

A backbone name ending in ``_mini`` gives DETR the tests' sizes :data:`DETR_MINI` (d 32, one encoder and one
decoder layer, 10 queries) unless the keywords say otherwise; other backbones get the paper's sizes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...common.extras import MissingExtra

DETECTORS = ("detr", "faster_rcnn", "mask_rcnn")
#: DETR's sizes for a ``*_mini`` backbone (tiny synthetic images, seconds on a CPU)
DETR_MINI: dict[str, Any] = dict(d_model=32, nhead=4, enc_layers=1, dec_layers=1, dim_feedforward=64, num_queries=10)
RCNN_HINT = (
    "the R-CNN detectors need torchvision: run scripts/detection_check.sh or pip install 'vitlab[detection]' "
    "with a matching torch/torchvision pair ({})"
)


def build_detector(backbone: str, detector: str = "detr", *, num_classes: int, **kw: Any) -> nn.Module:
    """The ``detector`` (one of :data:`DETECTORS`) of ``num_classes`` classes over the registered model
    ``backbone``; ``kw`` are the detector's switches (DETR's ``pos``, ``num_queries``, ...) and its backbone's
    constructor arguments (``drop_path_rate``, ...)."""
    if detector not in DETECTORS:
        raise ValueError(f"detector must be one of {', '.join(DETECTORS)}, got {detector!r}")
    if num_classes < 1:
        raise ValueError(f"a detector needs num_classes >= 1 (the dataset's categories), got {num_classes}")
    if detector == "detr":
        from .detr import DETR

        sizes = DETR_MINI if backbone.endswith("_mini") else {}
        return DETR(backbone, num_classes, **{**sizes, **kw})
    try:
        from .rcnn import build_rcnn
    except ImportError as e:  # the module itself, or torchvision at its import
        if isinstance(e, MissingExtra):
            raise
        raise MissingExtra(RCNN_HINT.format(" ".join(f"{type(e).__name__}: {e}".split()))) from None
    return build_rcnn(backbone, detector, num_classes, **kw)


__all__ = ["DETECTORS", "DETR_MINI", "build_detector"]
