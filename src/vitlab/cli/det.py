"""``vitlab det``: object detection and instance segmentation on COCO-layout data.

``vitlab det synth OUT`` writes a small generated set in the official COCO layout (images, boxes, polygon and RLE
masks, crowd regions); ``vitlab det train --data coco:ROOT`` trains a detector with the training engine (every
``vitlab train`` option: DDP under torchrun, AMP, checkpoints, ``--resume``; ``--model`` names the backbone,
``--model-arg detector=detr|faster_rcnn|mask_rcnn`` the detector and ``pos=sine|learned|peg|none`` DETR's
position encoding); ``vitlab det eval CKPT --data coco:ROOT`` reports box (and mask) AP by pycocotools, and
``vitlab det eval --predictions FILE --data coco:ROOT`` scores a COCO results file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..common.options import positive_int, seed
from ..engine import arguments as train_cli

DET_DEFAULTS = {
    "model": "pcpvt_mini",
    "lr": 1e-4,
    "weight_decay": 1e-4,
    "clip_grad": 0.1,
    "smoothing": 0.0,
    "drop_path": 0.0,
    "batch_size": 4,
    "warmup_epochs": 0.0,
}  # fmt: skip  (DETR's optimiser settings)
SPEC_HELP = "coco:ROOT (ROOT/annotations/instances_{train,val}2017.json, ROOT/train2017/, ROOT/val2017/)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..tasks.detection.task import coco_spec

    sub = p.add_subparsers(dest="det_command", metavar="ACTION", required=True)
    t = sub.add_parser("train", help="train a detector (all `vitlab train` options)")
    train_cli.add_arguments(t)
    for action in t._actions:  # the data are COCO folders, not classification specs
        if action.dest == "data":
            action.type, action.default, action.required = coco_spec, None, True
            action.help = f"detection data: {SPEC_HELP}"
        elif action.dest == "model":
            action.help = (f"backbone: a registered model (see `vitlab models`); --model-arg detector=detr|"
                           f"faster_rcnn|mask_rcnn and pos=sine|learned|peg|none shape the detector "
                           f"(default {DET_DEFAULTS['model']}, DETR)")  # fmt: skip
        elif action.dest == "img_size":
            action.help = "shorter image side at evaluation; training draws DETR's scales up to it (default 800)"
        if action.dest in DET_DEFAULTS:
            action.default = DET_DEFAULTS[action.dest]
            action.help = (action.help or "").rsplit(" (default", 1)[0] + f" (default {DET_DEFAULTS[action.dest]})"
    t.set_defaults(task="detection")

    e = sub.add_parser("eval", help="box and mask AP (pycocotools) of a checkpoint or a COCO results file")
    e.add_argument("checkpoint", nargs="?", help="OUT/best.pt or OUT/last.pt of vitlab det train")
    e.add_argument("--data", required=True, type=coco_spec, help=f"detection data: {SPEC_HELP}")
    e.add_argument("--predictions", default=None, metavar="FILE", help="score this COCO results JSON instead of a "
                   "checkpoint's predictions")  # fmt: skip
    e.add_argument("--split", choices=("val", "train"), default="val", help="split to evaluate (default val)")
    e.add_argument("--img-size", type=positive_int, default=None, help="shorter image side (default: the run's)")
    e.add_argument("--ema", action="store_true", help="evaluate the EMA weights")
    e.add_argument("--limit", type=positive_int, default=None, help="evaluate the first N images only")
    e.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    e.add_argument("--save-predictions", default=None, metavar="FILE", help="write the checkpoint's predictions "
                   "as a COCO results JSON")  # fmt: skip
    e.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")

    s = sub.add_parser("synth", help="write a small generated set in the COCO layout")
    s.add_argument("out", help="folder to write (created)")
    s.add_argument("--train", type=positive_int, default=24, help="training images (default 24)")
    s.add_argument("--val", type=positive_int, default=8, help="held-out images (default 8)")
    s.add_argument("--height", type=positive_int, default=64, help="image height (default 64)")
    s.add_argument("--width", type=positive_int, default=80, help="image width (default 80)")
    s.add_argument("--classes", type=positive_int, default=3, help="object categories (default 3)")
    s.add_argument("--seed", type=seed, default=0, help="seed (default 0)")


def run(args: argparse.Namespace) -> int:
    return {"train": run_train, "eval": run_eval, "synth": run_synth}[args.det_command](args)


def run_train(args: argparse.Namespace) -> int:
    return train_cli.train_task_from_args(args, "det")


def print_figures(title: str, figures: dict[str, dict[str, float]]) -> None:
    print(title)
    for kind, stats in figures.items():
        print(f"  {kind:4s} " + "  ".join(f"{k} {v:.1f}" for k, v in stats.items()))


def run_eval(args: argparse.Namespace) -> int:
    from ..common.io import write_json_atomic
    from ..tasks.detection.data import open_coco
    from ..tasks.detection.metrics import evaluate_results, load_predictions

    if (args.checkpoint is None) == (args.predictions is None):
        raise ValueError("give a checkpoint or --predictions FILE (one of the two)")
    if args.predictions:
        ds = open_coco(args.data, args.split)
        results = load_predictions(args.predictions, ds)
        kinds = ("bbox", "segm") if any("segmentation" in r for r in results) else ("bbox",)
        figures = evaluate_results(ds.annotation_file, results, kinds, image_ids=ds.image_ids)
        print_figures(f"{args.predictions} on {args.data} ({args.split}, {len(ds)} images)", figures)
    else:
        from ..tasks.detection.task import evaluate_checkpoint

        ckpt, ev, ds = evaluate_checkpoint(args.checkpoint, args.data, args.split, args.img_size, args.device,
                                           args.ema, args.limit)  # fmt: skip
        figures = {k: ev[k] for k in ("bbox", "segm") if k in ev}
        print_figures(f"{ckpt['model_name']} on {args.data} ({args.split}, {ev['n']} images)", figures)
        if args.save_predictions:
            write_json_atomic(args.save_predictions, ev["results"])
    if args.json:
        write_json_atomic(args.json, {"checkpoint": args.checkpoint, "predictions": args.predictions,
                                      "data": args.data, "split": args.split, **figures})  # fmt: skip
    return 0


def run_synth(args: argparse.Namespace) -> int:
    from ..tasks.detection.synth import make_coco_folder

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; give a new folder")
    make_coco_folder(out, args.train, args.val, (args.height, args.width), args.classes, args.seed)
    print(json.dumps({"out": str(out), "layout": "coco", "train": args.train, "val": args.val}))
    return 0
