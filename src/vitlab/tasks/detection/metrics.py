"""COCO box and mask AP, computed by pycocotools' ``COCOeval`` (the benchmark's own code, never a re-derivation).

For each IoU type (``bbox``, ``segm``) ``COCOeval`` matches detections to ground truth per image and category,
best score first, at IoU thresholds 0.50:0.05:0.95 (crowd regions and unmatched detections inside them
ignored), takes the precision interpolated at 101 recall points and averages it over thresholds and
categories. :data:`STATS` names its 12 summary figures, reported here as percentages: AP (IoU .50:.95), AP50,
AP75, AP of small / medium / large objects (area < 32^2, < 96^2, above), AR given 1, 10, 100 detections per
image, AR of small / medium / large objects. A figure pycocotools leaves undefined (no ground truth of that
size) stays -1.

:func:`to_coco_results` writes a detector's predictions (:mod:`.batch`'s contract) as COCO results: ``bbox``
as ``x, y, w, h`` in the file's pixels, the category id for each label, and for masks the compressed RLE of
the probabilities above 0.5. :func:`evaluate_results` scores results against an annotation file (checked by
:func:`.coco_format.read_instances` before pycocotools reads it); box AP reads each result's ``bbox``, mask AP its
``segmentation`` and the mask's own area (as DETR and Detectron2 evaluate). :func:`load_predictions` reads a
results file written elsewhere. pycocotools prints as it works: that text is kept from the terminal, and
``summaries`` receives its summary table.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...common.extras import require
from ...data.safe_files import DataFileError, read_regular
from .coco_format import check_segmentation, is_int, is_number, read_instances

STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
IOU_TYPES = ("bbox", "segm")
RESULTS_LIMIT = 4 << 30  # a results file of 5000 images x 100 detections with masks is ~0.5 GB
PURPOSE = "COCO box and mask AP"


def to_coco_results(predictions: Sequence[dict[str, Any]], dataset: Any,
                    image_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """COCO result entries of per-image predictions (``boxes`` xyxy in the file's pixels, ``scores``,
    ``labels`` 0..C-1, optional ``masks`` ``(n, H, W)`` probabilities): each prediction's ``image_id``, or
    ``image_ids[k]`` for the k-th; ``dataset.cat_ids`` maps the labels to COCO's category ids."""
    cat_ids, out = list(dataset.cat_ids), []
    for k, p in enumerate(predictions):
        image_id = int(p["image_id"]) if "image_id" in p else int(image_ids[k]) if image_ids is not None else None
        if image_id is None:
            raise ValueError(f"prediction {k} has no image_id and no image_ids were given")
        boxes = torch.as_tensor(p["boxes"]).detach().float().cpu().reshape(-1, 4)
        scores = torch.as_tensor(p["scores"]).detach().float().cpu().reshape(-1).tolist()
        labels = torch.as_tensor(p["labels"]).detach().cpu().reshape(-1).tolist()
        if not len(boxes) == len(scores) == len(labels):
            raise ValueError(f"prediction {k}: {len(boxes)} boxes, {len(scores)} scores, {len(labels)} labels")
        bad = [c for c in labels if not 0 <= c < len(cat_ids)]
        if bad:
            raise ValueError(f"prediction {k}: label {bad[0]} is outside the dataset's {len(cat_ids)} classes")
        xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1).tolist()
        rows = [{"image_id": image_id, "category_id": cat_ids[int(c)], "bbox": b, "score": s}
                for b, s, c in zip(xywh, scores, labels)]  # fmt: skip
        if "masks" in p and len(rows):
            mask = require("pycocotools.mask", PURPOSE, extra="detection")
            binary = (torch.as_tensor(p["masks"]).detach().float().cpu() > 0.5).numpy().astype(np.uint8)
            rles = mask.encode(np.asfortranarray(binary.transpose(1, 2, 0)))  # pycocotools takes (H, W, n)
            for row, rle in zip(rows, rles):
                row["segmentation"] = {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode("ascii")}
        out += rows
    return out


def _coco(doc: dict[str, Any]) -> Any:
    """A pycocotools ``COCO`` over an annotation dict already read and checked (pycocotools opens no file)."""
    coco_mod = require("pycocotools.coco", PURPOSE, extra="detection")
    gt = coco_mod.COCO()
    gt.dataset = doc
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
    return gt


def _check_results(results: Sequence[dict[str, Any]], images: dict[int, tuple[int, int]] | None,
                   cats: set[int] | None, where: str, fix: str | None = None) -> None:  # fmt: skip
    """One line for the first result pycocotools would fail on: an image or category not in ``images`` /
    ``cats`` (not checked where None), a missing score or geometry, a mask of another size than its image's;
    with a ``fix`` (a file's results) also an RLE whose runs do not cover its image (pycocotools' C code trusts
    them: those :func:`to_coco_results` writes do)."""
    for k, r in enumerate(results):
        at = f"{where}: result {k}"
        if not isinstance(r, dict):
            raise ValueError(f"{at} is not an object")
        if not is_int(r.get("image_id")) or (images is not None and r["image_id"] not in images):
            raise ValueError(f"{at} names image id {r.get('image_id')!r:.40}, which is not an image of the data")
        if not is_int(r.get("category_id")) or (cats is not None and r["category_id"] not in cats):
            raise ValueError(f"{at} names category id {r.get('category_id')!r:.40}, which is not a category")
        if not is_number(r.get("score")):
            raise ValueError(f"{at} needs a finite score")
        if "bbox" not in r and "segmentation" not in r:
            raise ValueError(f"{at} has neither a bbox nor a segmentation")
        box = r.get("bbox", [0, 0, 0, 0])
        if not (isinstance(box, list) and len(box) == 4 and all(map(is_number, box)) and min(box[2:]) >= 0):
            raise ValueError(f"{at}: bbox must be four finite numbers x, y, width >= 0, height >= 0")
        if "segmentation" in r:
            seg = r["segmentation"]
            size = seg.get("size") if isinstance(seg, dict) else None
            h, w = images[r["image_id"]] if images is not None else size if isinstance(size, list) else (0, 0)
            ok = isinstance(seg, dict) and isinstance(seg.get("counts"), str) and size == [h, w]
            if not (ok and is_int(h) and is_int(w)):
                raise ValueError(f"{at}: segmentation must be a compressed RLE of its image's size")
            if fix is not None:
                check_segmentation(seg, h, w, at, fix)


def load_predictions(path: str | Path, dataset: Any = None) -> list[dict[str, Any]]:
    """The entries of a COCO results file (a JSON list of ``image_id``, ``category_id``, ``score`` and a
    ``bbox`` and/or an RLE ``segmentation``), read bounded and checked against ``dataset``'s images and
    categories when given (else their form only: :func:`evaluate_results` checks the ids); one line for the
    first entry that is wrong."""
    path = Path(path)
    fix = "write it as a JSON list of COCO result objects (vitlab det eval --save-predictions writes one)"
    data = read_regular(path, "COCO results file", fix, RESULTS_LIMIT)
    try:
        results = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise DataFileError(f"COCO results file {path} is not JSON ({' '.join(str(e).split())[:120]}); {fix}") from None
    if not isinstance(results, list):
        raise DataFileError(f"COCO results file {path} holds a JSON {type(results).__name__}, not a list; {fix}")
    images = {im["id"]: (im["height"], im["width"]) for im in dataset.images} if dataset is not None else None
    try:
        _check_results(results, images, set(dataset.cat_ids) if dataset is not None else None,
                       f"COCO results file {path}", fix)  # fmt: skip
    except DataFileError:
        raise
    except ValueError as e:
        raise DataFileError(f"{e}; {fix}") from None
    return results


def evaluate_results(annotation_file: str | Path, results: Sequence[dict[str, Any]],
                     iou_types: Sequence[str] = ("bbox",), image_ids: Sequence[int] | None = None,
                     summaries: dict[str, str] | None = None) -> dict[str, dict[str, float]]:  # fmt: skip
    """For each of ``iou_types``, the :data:`STATS` (%) of COCOeval scoring ``results`` against
    ``annotation_file`` over ``image_ids`` (default: every image of the file). ``summaries``, when given,
    receives pycocotools' summary table per IoU type."""
    eval_mod = require("pycocotools.cocoeval", PURPOSE, extra="detection")
    bad = [t for t in iou_types if t not in IOU_TYPES]
    if bad or not iou_types:
        raise ValueError(f"iou_types must be among {', '.join(IOU_TYPES)}, got {list(iou_types)}")
    doc = read_instances(annotation_file)
    sizes = {im["id"]: (im["height"], im["width"]) for im in doc["images"]}
    if "segm" in iou_types:  # pycocotools rasterises every ground-truth mask: each checked first
        for a in doc["annotations"]:
            h, w = sizes[a["image_id"]]
            where = f"COCO annotation file {annotation_file}: annotation id {a['id']}"
            if "segmentation" not in a:
                raise DataFileError(f"{where} has no segmentation: the file cannot score masks")
            a["segmentation"] = check_segmentation(a["segmentation"], h, w, where)
    ids = sorted(sizes) if image_ids is None else sorted({int(i) for i in image_ids})
    missing = [i for i in ids if i not in sizes]
    if missing:
        raise ValueError(f"image id {missing[0]} is not in {annotation_file}")
    _check_results(results, sizes, {c["id"] for c in doc["categories"]}, "COCO results")
    gt, figures = _coco(doc), {}
    for iou_type in iou_types:
        key = "bbox" if iou_type == "bbox" else "segmentation"
        # a copy of each entry with only its own geometry: pycocotools writes into the entries, and with both
        # present it would take the box's area for a mask
        mine = [{k: v for k, v in r.items() if k in ("image_id", "category_id", "score", key)} for r in results]
        mine = [r for r in mine if key in r]
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            if mine:
                dt = gt.loadRes(mine)
            else:  # loadRes cannot take an empty list: an empty result set scores 0 where there is ground truth
                dt = _coco({"images": doc["images"], "categories": doc["categories"], "annotations": []})
            ev = eval_mod.COCOeval(gt, dt, iou_type)
            ev.params.imgIds = ids
            ev.evaluate()
            ev.accumulate()
            start = text.tell()
            ev.summarize()
        if summaries is not None:
            summaries[iou_type] = text.getvalue()[start:]
        figures[iou_type] = {n: float(v) * 100 if v >= 0 else float(v) for n, v in zip(STATS, ev.stats)}
    return figures
