"""``vitlab seg``: semantic segmentation.

``vitlab seg synth OUT`` writes a small generated set in the VOC (or ADE20K, Cityscapes) layout;
``vitlab seg train`` trains a segmentation model with the training engine (every ``vitlab train`` option: DDP
under torchrun, AMP, checkpoints, ``--resume``; ``--model`` names the backbone, ``--model-arg decoder=eanet``,
``head=ea|sa|sa_dn|plain`` etc. the decoder); ``vitlab seg eval CKPT`` reports mIoU and per-class IoU with
sliding windows, on whole images, or multi-scale with flips (``--mode msflip --scales ...``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..common.options import Validated, positive_int, seed
from ..engine import arguments as train_cli
from ..tasks.segmentation.data import LAYOUTS, SPEC_HELP, mask_spec
from ..tasks.segmentation.infer import INFER_MODES, MS_SCALES, check_scales
from ..tasks.segmentation.metrics import per_class_lines
from ..tasks.segmentation.task import evaluate_checkpoint


def _scales(text: str) -> tuple[float, ...]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of numbers, e.g. 0.5,1.0,1.5") from None
    return check_scales(values)


#: argparse type of ``--scales``: comma-separated positive factors
scale_list = Validated(_scales, "scales")
SEG_DEFAULTS = {"model": "pcpvt_mini", "smoothing": 0.0, "drop_path": 0.0, "weight_decay": 0.01, "batch_size": 8}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="seg_command", metavar="ACTION", required=True)
    t = sub.add_parser("train", help="train a segmentation model (all `vitlab train` options)")
    train_cli.add_arguments(t)
    for action in t._actions:  # the data are mask folders, not classification specs
        if action.dest == "data":
            action.type, action.default, action.required = mask_spec, None, True
            action.help = f"segmentation data: {SPEC_HELP}"
        elif action.dest == "model":
            action.default = SEG_DEFAULTS["model"]
            action.help = (f"backbone: a registered model (see `vitlab models`) whose features_only pyramid feeds the "
                           f"decoder; --model-arg decoder=pyramid|eanet, head=ea|sa|sa_dn|plain, memory_size=S, "
                           f"ea_norm=double|softmax, channels=C, aux_weight=W (eanet) shape the decoder "
                           f"(default {SEG_DEFAULTS['model']})")  # fmt: skip
        elif action.dest in SEG_DEFAULTS:
            action.default = SEG_DEFAULTS[action.dest]
            action.help = action.help.rsplit(" (default", 1)[0] + f" (default {SEG_DEFAULTS[action.dest]})"
    t.set_defaults(task="segmentation")

    e = sub.add_parser("eval", help="mIoU and per-class IoU of a `vitlab seg train` checkpoint")
    e.add_argument("checkpoint", help="a checkpoint written by vitlab seg train (OUT/best.pt or last.pt)")
    e.add_argument("--data", required=True, type=mask_spec, help=f"segmentation data: {SPEC_HELP}")
    e.add_argument("--split", choices=("val", "train"), default="val", help="split to evaluate (default val)")
    e.add_argument("--mode", choices=INFER_MODES, default="slide", help="sliding windows, the whole image "
                   "resized to the training crop, or msflip: sliding windows over the image resized by each of "
                   "--scales and mirrored, softmax probabilities averaged (default slide)")  # fmt: skip
    e.add_argument(
        "--stride", type=positive_int, default=None, help="window stride in pixels (default 2/3 of the crop)"
    )
    e.add_argument("--scales", type=scale_list, default=None, metavar="S1,S2,...", help="msflip's resize factors "
                   f"(default {','.join(map(str, MS_SCALES))}, EANet's test scales)")  # fmt: skip
    e.add_argument("--no-flip", dest="flip", action="store_false", help="msflip without the mirrored images")
    e.add_argument("--ema", action="store_true", help="evaluate the EMA weights")
    e.add_argument("--limit", type=positive_int, default=None, help="evaluate the first N images only")
    e.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON")
    e.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")

    s = sub.add_parser("synth", help="write a small generated set in the VOC, ADE20K or Cityscapes layout")
    s.add_argument("out", help="folder to write (created)")
    s.add_argument("--layout", choices=tuple(LAYOUTS), default="voc", help="folder layout (default voc)")
    s.add_argument("--train", type=positive_int, default=24, help="training pairs (default 24)")
    s.add_argument("--val", type=positive_int, default=8, help="held-out pairs (default 8)")
    s.add_argument("--height", type=positive_int, default=48, help="image height (default 48)")
    s.add_argument("--width", type=positive_int, default=64, help="image width (default 64)")
    s.add_argument("--classes", type=positive_int, default=5, help="classes drawn, background included (default 5)")
    s.add_argument("--seed", type=seed, default=0, help="seed (default 0)")


def run(args: argparse.Namespace) -> int:
    return {"train": run_train, "eval": run_eval, "synth": run_synth}[args.seg_command](args)


def run_train(args: argparse.Namespace) -> int:
    return train_cli.train_task_from_args(args, "seg")


def run_eval(args: argparse.Namespace) -> int:
    if args.mode != "msflip" and (args.scales is not None or not args.flip):
        raise ValueError("--scales and --no-flip belong to --mode msflip")
    scales = args.scales or MS_SCALES
    ckpt, result = evaluate_checkpoint(args.checkpoint, args.data, args.split, args.mode, args.stride, args.device,
                                       args.ema, args.limit, scales, args.flip)  # fmt: skip
    mode = args.mode
    if mode == "msflip":
        mode += f" x{','.join(map(str, scales))}" + ("" if args.flip else ", no flip")
    print(f"{ckpt['model_name']} on {args.data} ({args.split}, {result['n']} images, {mode}): "
          f"mIoU {result['miou']:.2f}  aAcc {result['aacc']:.2f}  mAcc {result['macc']:.2f}")  # fmt: skip
    for line in per_class_lines(result["iou"], result.get("classes")):  # named where the data names its classes
        print(line)
    if args.json:
        from ..common.io import write_json_atomic

        record = {"checkpoint": args.checkpoint, "data": args.data, "mode": args.mode, **result}
        if args.mode == "msflip":
            record.update(scales=list(scales), flip=args.flip)
        write_json_atomic(args.json, record)
    return 0


def run_synth(args: argparse.Namespace) -> int:
    from ..tasks.segmentation.synth import make_mask_folder

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; give a new folder")
    make_mask_folder(out, args.layout, args.train, args.val, (args.height, args.width), args.classes, args.seed)
    print(json.dumps({"out": str(out), "layout": args.layout, "train": args.train, "val": args.val}))
    return 0
