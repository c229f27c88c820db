"""COCO box and mask AP through pycocotools (vitlab.tasks.detection.metrics) and the evaluation of a detector
over a held-out split (vitlab.tasks.detection.infer)."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hangs import unblocked
from vitlab.data.safe_files import DataFileError
from vitlab.tasks.detection.data import open_coco
from vitlab.tasks.detection.infer import evaluate_detector
from vitlab.tasks.detection.metrics import STATS, evaluate_results, load_predictions, to_coco_results
from vitlab.tasks.detection.synth import make_coco_folder

mask_api = pytest.importorskip("pycocotools.mask")  # vitlab[detection]
from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy:DeprecationWarning")

# two 100 x 120 images, two categories (ids 5 and 9) with two objects each: a rectangle's box and its polygon
BOXES = {(1, 5): [10.0, 10.0, 40.0, 30.0], (1, 9): [60.0, 50.0, 50.0, 40.0],
         (2, 5): [20.0, 30.0, 35.0, 45.0], (2, 9): [5.0, 5.0, 30.0, 20.0]}  # fmt: skip


def polygon(box: list[float]) -> list[list[float]]:
    x, y, w, h = box
    return [[x, y, x + w, y, x + w, y + h, x, y + h]]


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("crafted")
    anns = [{"id": n, "image_id": i, "category_id": c, "bbox": b, "area": b[2] * b[3], "iscrowd": 0,
             "segmentation": polygon(b)} for n, ((i, c), b) in enumerate(BOXES.items(), 1)]  # fmt: skip
    doc = {"images": [{"id": i, "file_name": f"{i:012d}.jpg", "height": 100, "width": 120} for i in (1, 2)],
           "annotations": anns, "categories": [{"id": 9, "name": "nine"}, {"id": 5, "name": "five"}]}  # fmt: skip
    path = root / "instances.json"
    path.write_text(json.dumps(doc))
    return path


def rle_of(box: list[float]) -> dict:
    rle = mask_api.merge(mask_api.frPyObjects(polygon(box), 100, 120))
    return {"size": [100, 120], "counts": rle["counts"].decode()}


def crafted_results(categories=(5, 9), masks: bool = False) -> list[dict]:
    out = []
    for (i, c), b in BOXES.items():
        if c in categories:
            out.append({"image_id": i, "category_id": c, "bbox": b, "score": 0.9})
            if masks:
                out[-1]["segmentation"] = rle_of(b)
    return out


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> Path:
    return make_coco_folder(tmp_path_factory.mktemp("coco") / "set", train=4, val=8, size=(48, 64), classes=3)


# --------------------------------------------------------------------------- figures known by hand


@pytest.mark.parametrize("kinds", [("bbox",), ("bbox", "segm")])
def test_perfect_predictions_score_100_and_half_the_categories_50(crafted, kinds, capsys):
    masks = "segm" in kinds
    perfect = evaluate_results(crafted, crafted_results(masks=masks), kinds)
    half = evaluate_results(crafted, crafted_results((5,), masks=masks), kinds)
    for kind in kinds:
        assert list(perfect[kind]) == list(STATS)
        assert perfect[kind]["AP"] == pytest.approx(100) and perfect[kind]["AP50"] == pytest.approx(100)
        assert perfect[kind]["AR100"] == pytest.approx(100)
        assert half[kind]["AP"] == pytest.approx(50) and half[kind]["AR100"] == pytest.approx(50)
        assert perfect[kind]["APl"] == -1  # no object above 96^2 pixels: undefined, as pycocotools says
    assert capsys.readouterr().out == ""  # pycocotools' printing is kept from the terminal


def test_empty_predictions_score_0(crafted):
    figures = evaluate_results(crafted, [], ("bbox", "segm"))
    assert figures["bbox"]["AP"] == 0 and figures["segm"]["AR100"] == 0 and figures["bbox"]["APl"] == -1


def test_image_ids_restrict_the_evaluation(crafted):
    only_first = [r for r in crafted_results() if r["image_id"] == 1]
    assert evaluate_results(crafted, only_first, image_ids=[1])["bbox"]["AP"] == pytest.approx(100)
    # image 2 missed: each category recalls 1 of 2 at precision 1, i.e. 51 of COCO's 101 recall points
    assert evaluate_results(crafted, only_first)["bbox"]["AP"] == pytest.approx(100 * 51 / 101)
    with pytest.raises(ValueError, match="image id 3"):
        evaluate_results(crafted, only_first, image_ids=[3])


def direct_cocoeval(annotation_file: Path, results_file: Path, iou_type: str) -> list[float]:
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(annotation_file))
        ev = COCOeval(gt, gt.loadRes(str(results_file)), iou_type)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return [float(v) * 100 if v >= 0 else float(v) for v in ev.stats]


def noisy_results(ds, seed: int = 0) -> list[dict]:
    """The ground truth of ``ds`` jittered, some categories wrong, some objects missed, spurious boxes: a
    prediction whose AP is neither 0 nor 100."""
    g = torch.Generator().manual_seed(seed)
    preds = []
    for i in range(len(ds)):
        t = ds.target(i)
        n = len(t["boxes"])
        boxes = torch.cat([t["boxes"] + torch.randn(n, 4, generator=g) * 2, torch.rand(2, 4, generator=g) * 40])
        boxes[:, 2:] = torch.maximum(boxes[:, 2:], boxes[:, :2] + 1)
        labels = torch.cat([t["labels"], torch.randint(0, ds.num_classes, (2,), generator=g)])
        labels[torch.rand(n + 2, generator=g) < 0.2] = 0
        masks = torch.cat([t["masks"].float(), torch.zeros(2, *t["masks"].shape[1:])])
        masks[: n // 2] = masks[: n // 2].roll(3, -1)
        preds.append({"image_id": ds.image_ids[i], "boxes": boxes, "scores": torch.rand(n + 2, generator=g),
                      "labels": labels, "masks": masks})  # fmt: skip
    return to_coco_results(preds, ds)


def test_evaluate_results_equals_a_direct_cocoeval_run(coco, tmp_path):
    ds = open_coco(f"coco:{coco}", "val")
    results = noisy_results(ds)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    loaded = load_predictions(path, ds)
    summaries: dict[str, str] = {}
    figures = evaluate_results(ds.annotation_file, loaded, ("bbox", "segm"), ds.image_ids, summaries)
    for kind in ("bbox", "segm"):
        ours = [figures[kind][s] for s in STATS]
        assert 0 < figures[kind]["AP"] < 100
        # pycocotools given the file itself (its bbox branch takes both keys; for masks, masks alone as DETR does)
        only = [{k: v for k, v in r.items() if k != ("segmentation" if kind == "bbox" else "bbox")} for r in results]
        path.write_text(json.dumps(only))
        assert ours == pytest.approx(direct_cocoeval(ds.annotation_file, path, kind), abs=1e-9)
        assert "Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ]" in summaries[kind]


# --------------------------------------------------------------------------- results in and out


def test_to_coco_results_writes_xywh_category_ids_and_rle(coco):
    ds = open_coco(f"coco:{coco}", "val")
    t = ds.target(0)
    pred = {"boxes": t["boxes"], "scores": torch.ones(len(t["boxes"])), "labels": t["labels"],
            "masks": t["masks"].float() * 0.7}  # fmt: skip
    rows = to_coco_results([pred], ds, image_ids=[ds.image_ids[0]])
    assert len(rows) == len(t["boxes"])
    for row, box, label, mask in zip(rows, t["boxes"].tolist(), t["labels"].tolist(), t["masks"]):
        assert row["image_id"] == ds.image_ids[0] and row["category_id"] == ds.cat_ids[label]
        assert row["bbox"] == pytest.approx([box[0], box[1], box[2] - box[0], box[3] - box[1]], abs=1e-5)
        assert isinstance(row["segmentation"]["counts"], str)
        decoded = mask_api.decode({"size": row["segmentation"]["size"], "counts": row["segmentation"]["counts"]})
        assert np.array_equal(decoded, mask.numpy())
    with pytest.raises(ValueError, match="label 3"):
        to_coco_results([{**pred, "labels": torch.full_like(t["labels"], 3)}], ds, image_ids=[1])
    with pytest.raises(ValueError, match="no image_id"):
        to_coco_results([pred], ds)


BAD_RESULTS = {
    "object": ({"image_id": 2}, "not a list"),
    "no score": ([{"image_id": 2, "category_id": 1, "bbox": [0, 0, 1, 1]}], "finite score"),
    "no geometry": ([{"image_id": 2, "category_id": 1, "score": 1.0}], "neither a bbox nor a segmentation"),
    "unknown image": ([{"image_id": 12345, "category_id": 1, "bbox": [0, 0, 1, 1], "score": 1}], "image id 12345"),
    "unknown category": ([{"image_id": 2, "category_id": 2, "bbox": [0, 0, 1, 1], "score": 1}], "category id 2"),
    "bad box": ([{"image_id": 2, "category_id": 1, "bbox": [0, 0, -1, 1], "score": 1}], "bbox"),
    "bad rle": ([{"image_id": 2, "category_id": 1, "segmentation": {"size": [48, 64], "counts": "0"}, "score": 1}],
                "cover"),
    "rle size": ([{"image_id": 2, "category_id": 1, "segmentation": {"size": [4, 4], "counts": "0`0"}, "score": 1}],
                 "size"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_RESULTS))
def test_load_predictions_refuses_bad_files_in_one_line(coco, tmp_path, case):
    content, match = BAD_RESULTS[case]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(content))
    with pytest.raises(DataFileError) as e:
        load_predictions(path, open_coco(f"coco:{coco}", "val"))
    assert match in str(e.value) and "\n" not in str(e.value)


def test_load_predictions_without_data_checks_form_and_evaluate_checks_ids(coco, tmp_path, crafted):
    path = tmp_path / "results.json"
    for content in (b"[", b"\xff", b"[{}]"):
        path.write_bytes(content)
        with pytest.raises(DataFileError):
            load_predictions(path)
    path.write_text(json.dumps(crafted_results()))
    assert evaluate_results(crafted, load_predictions(path))["bbox"]["AP"] == pytest.approx(100)
    wrong = [{**r, "category_id": 6} for r in crafted_results()]
    with pytest.raises(ValueError, match="category id 6"):
        evaluate_results(crafted, wrong)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes need POSIX")
def test_results_file_that_is_a_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "results.json"
    os.mkfifo(fifo)
    with pytest.raises(DataFileError, match="named pipe"):
        unblocked(lambda: load_predictions(fifo), fifo)


# --------------------------------------------------------------------------- evaluating a detector


class Oracle(nn.Module):
    """A fake detector keeping the contract: it predicts the ground truth, read from the dataset in the file's
    pixels (``exact``) or scaled back from the batch's resized targets; ``noise`` shifts its boxes."""

    def __init__(self, ds, exact: bool = True, masks: bool = True, with_loss: bool = True, noise: float = 0.0):
        super().__init__()
        self.ds, self.exact, self.masks, self.with_loss, self.noise = ds, exact, masks, with_loss, noise
        self.scale = nn.Parameter(torch.ones(()))
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        return {"images": batch.images.mean() * self.scale}

    def loss(self, batch, outputs):
        if not self.with_loss:
            raise ValueError("no loss in evaluation mode")
        return outputs["images"] * 0 + 2.5, {}

    def predict(self, batch, outputs):
        preds = []
        for t in batch.targets:
            if self.exact:
                truth = self.ds.target(self.ds.image_ids.index(int(t["image_id"])))
                boxes, labels = truth["boxes"], truth["labels"]
            else:
                (h, w), (oh, ow) = t["size"].tolist(), t["orig_size"].tolist()
                boxes, labels = t["boxes"] * torch.tensor([ow / w, oh / h, ow / w, oh / h]), t["labels"]
            boxes = boxes + self.noise
            pred = {"boxes": boxes, "scores": torch.linspace(1, 0.5, len(boxes)), "labels": labels}
            if self.masks:
                pred["masks"] = truth["masks"].float()
            preds.append(pred)
        return preds


def test_evaluate_detector_scores_the_ground_truth_100(coco):
    ds = open_coco(f"coco:{coco}", "val")
    model = Oracle(ds).train()
    ev = evaluate_detector(model, ds, "cpu", size=48, batch_size=3)
    assert ev["bbox"]["AP"] == pytest.approx(100) and ev["segm"]["AP"] == pytest.approx(100)
    assert ev["n"] == len(ds) == 8 and ev["img_s"] > 0 and ev["loss"] == pytest.approx(2.5)
    assert model.training and model.calls == 3  # batches of 3, 3, 2; the mode given back
    scaled = evaluate_detector(Oracle(ds, exact=False, masks=False), ds, "cpu", size=72, batch_size=2, limit=5,
                               keep_results=True)  # fmt: skip
    assert "segm" not in scaled and scaled["n"] == 5 and scaled["bbox"]["AP"] == pytest.approx(100)
    assert {r["image_id"] for r in scaled["results"]} <= set(ds.image_ids[:5])


def test_evaluate_detector_agrees_with_evaluate_results_on_imperfect_boxes(coco):
    ds = open_coco(f"coco:{coco}", "val")
    ev = evaluate_detector(Oracle(ds, with_loss=False, noise=3.0), ds, "cpu", size=48, keep_results=True)
    assert ev["loss"] is None and 0 < ev["bbox"]["AP"] < 100
    assert ev["bbox"] == evaluate_results(ds.annotation_file, ev["results"], ("bbox",))["bbox"]
