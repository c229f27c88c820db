"""The evaluation of a detector over a held-out COCO split: every image resized so its shorter side is ``size``
(the longer at most ``max_size``, DETR's 1333/800 of it by default), batched with its padding mask, passed
through the detector contract of :mod:`.batch` (``forward``, then ``predict``: boxes in the file's pixels),
written as COCO results and scored by pycocotools (:mod:`.metrics`): box AP always, mask AP when the detector
predicts masks.

The loss over the held-out images is the detector's own ``loss`` of its evaluation outputs, when it has one
there (DETR's set loss does; an R-CNN computes its losses only in training mode, and reports none). It is not
computed inside a process group: a detector's loss may all-reduce (DETR's box count), and only one process
evaluates.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...common.device import autocast
from .data import CocoDetection, DetTransform, collate, default_max_size
from .metrics import evaluate_results, to_coco_results


@torch.no_grad()
def evaluate_detector(model: nn.Module, ds: CocoDetection, device: torch.device | str, size: int = 800,
                      batch_size: int = 2, dtype: torch.dtype | None = None, limit: int | None = None,
                      max_size: int | None = None, keep_results: bool = False,
                      size_divisor: int = 1) -> dict[str, Any]:  # fmt: skip
    """Box AP figures (``"bbox"``: :data:`.metrics.STATS` in %), mask AP figures (``"segm"``, when the model
    predicts masks), the mean held-out ``loss`` (None where the detector gives none), ``n`` images, ``img_s``
    (forward and prediction, without the scoring) of ``model`` on the first ``limit`` images of ``ds`` (all by
    default); with ``keep_results`` also ``results``, the COCO result entries."""
    if size < 1 or batch_size < 1:
        raise ValueError(f"need size >= 1 and batch_size >= 1, got {size} and {batch_size}")
    device = torch.device(device)
    n = len(ds) if limit is None else max(0, min(limit, len(ds)))
    if n == 0:
        raise ValueError("nothing to evaluate: the split (or --limit) has no images")
    resize = DetTransform((size,), max_size or default_max_size(size), hflip=0.0)
    was_training = model.training
    model.eval()
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    with_loss = hasattr(model, "loss") and not grouped
    results: list[dict[str, Any]] = []
    loss_sum, masks, t0 = 0.0, False, time.perf_counter()
    try:
        for start in range(0, n, batch_size):
            samples = [resize(*ds[i]) for i in range(start, min(n, start + batch_size))]
            batch = collate(samples, ds.mean, ds.std, size_divisor, device)
            with autocast(device, dtype):
                outputs = model(batch)
                if with_loss:
                    try:
                        loss_sum += float(model.loss(batch, outputs)[0]) * len(batch)
                    except (ValueError, KeyError, NotImplementedError):  # no loss outside training (an R-CNN)
                        with_loss = False
            preds = model.predict(batch, outputs)
            for p, t in zip(preds, batch.targets):
                p["image_id"] = int(t["image_id"])
                masks = masks or "masks" in p
            results += to_coco_results(preds, ds)  # per batch: masks become RLE before the next one
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - t0
    iou_types = ("bbox", "segm") if masks else ("bbox",)
    out: dict[str, Any] = evaluate_results(ds.annotation_file, results, iou_types, image_ids=ds.image_ids[:n])
    out.update(loss=loss_sum / n if with_loss else None, n=n, img_s=n / seconds)
    if keep_results:
        out["results"] = results
    return out
