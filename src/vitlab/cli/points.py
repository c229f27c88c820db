"""``vitlab points``: point-cloud shape classification through the training engine (DDP, AMP, checkpoints,
resume, run folders), and the generated sets in the benchmarks' layouts.

``vitlab points synth OUT`` writes a small ModelNet40-layout HDF5 set (or ShapeNet-Part's text layout);
``vitlab points train --data modelnet40:ROOT --model pct_ea_mini`` trains a PCT-style classifier with external
attention (``pct_sa*``: PCT's self-attention), PCT's augmentation, label smoothing ``--smoothing``, and evaluates
each epoch: ``val_oa`` (overall accuracy, which chooses ``best.pt``), ``val_macc`` (mean-class accuracy);
``vitlab points eval CKPT --data ...`` reports both.
"""

from __future__ import annotations

import argparse
import json

from ..common.options import Choice, Int, seed
from ..engine import arguments as train_cli
from ..tasks.points import POINT_MODELS
from ..tasks.points.data import SPEC_HELP
from ..tasks.points.task import evaluate_checkpoint

POINT_DEFAULTS = {"model": "pct_ea_mini", "smoothing": 0.2, "drop_path": 0.0, "weight_decay": 1e-4, "batch_size": 16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="points_command", metavar="ACTION", required=True)
    t = sub.add_parser("train", help="train a point-cloud classifier or part segmenter (the `vitlab train` options)")
    train_cli.add_arguments(t)
    for action in t._actions:
        if action.dest == "data":
            action.type, action.default, action.required, action.help = str, None, True, f"point data: {SPEC_HELP}"
        elif action.dest == "model":
            action.type = Choice(*POINT_MODELS)
            action.help = f"point model: {', '.join(POINT_MODELS)} (pct_partseg_*: shapenetpart: data)"
        if action.dest in POINT_DEFAULTS:
            action.default = POINT_DEFAULTS[action.dest]
    t.set_defaults(task="points")
    e = sub.add_parser("eval", help="OA and mean-class accuracy of a `vitlab points train` checkpoint")
    e.add_argument("checkpoint", help="OUT/best.pt or OUT/last.pt of vitlab points train")
    e.add_argument("--data", required=True, help=f"point data: {SPEC_HELP}")
    e.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    s = sub.add_parser("synth", help="write a small generated ModelNet40 (HDF5) or ShapeNet-Part set")
    s.add_argument("out", help="folder to write")
    s.add_argument(
        "--layout", choices=("modelnet40", "shapenetpart"), default="modelnet40", help="(default modelnet40)"
    )
    s.add_argument("--shapes", type=Int(2), default=64, help="training shapes (default 64; half as many held out)")
    s.add_argument("--points", type=Int(2), default=256, help="points per shape (default 256)")
    s.add_argument("--seed", type=seed, default=0, help="seed (default 0)")


def run(args: argparse.Namespace) -> int:
    if args.points_command == "synth":
        from pathlib import Path

        from ..tasks.points.synth import make_modelnet40, make_shapenet_part

        if Path(args.out).exists() and any(Path(args.out).iterdir()):
            raise ValueError(f"{args.out} is not empty; give a new folder")
        if args.layout == "modelnet40":
            make_modelnet40(args.out, args.shapes, max(1, args.shapes // 2), args.points, seed=args.seed)
        else:
            make_shapenet_part(args.out, args.shapes, args.points, seed=args.seed)
        print(json.dumps({"out": args.out, "layout": args.layout, "shapes": args.shapes}))
        return 0
    if args.points_command == "eval":
        return run_eval(args)
    cfg = train_cli.config_from_args(args)
    if args.out is None:
        cfg.out = f"runs/points/{args.model}"
    train_cli.run_training(cfg)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    ckpt, ev = evaluate_checkpoint(args.checkpoint, args.data, args.device)
    shown = "  ".join(f"{k} {v:.2f}" for k, v in ev.items() if k != "n")
    print(f"{ckpt['model_name']} on {args.data} ({ev['n']} shapes): {shown}")
    return 0
