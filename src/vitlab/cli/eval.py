"""``vitlab eval``: top-1 / top-5 and throughput of a checkpoint on held-out data, at its training input size or others (``--img-size 224 288 384``)."""

from __future__ import annotations

import argparse
import sys

from ..common import options as opt
from ..common.device import add_device_argument
from ..data.spec import data_spec
from ..engine.evaluate import (
    evaluate_checkpoint,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        help="a checkpoint written by `vitlab train` (or its output folder), a model folder, or a registered "
        "model name with --weights",
    )
    p.add_argument(
        "--weights",
        default=None,
        help="weights of the named model: an official / timm checkpoint, safetensors, or a model folder; "
        "evaluated with the model's data configuration (resize to size / crop_pct, centre crop, its mean/std)",
    )
    p.add_argument(
        "--img-size",
        type=opt.image_size,
        nargs="+",
        default=None,
        metavar="N",
        help="evaluate at these input sizes (default: the training size)",
    )
    p.add_argument(
        "--data",
        type=data_spec,
        default=None,
        help="dataset spec (default: the one the checkpoint was trained on; required otherwise)",
    )
    p.add_argument(
        "--crop-pct",
        type=opt.Float(0, 2, low_open=True),
        default=None,
        help="evaluation crop of folder:/wds: data: resize the shorter side to size / CROP_PCT, centre crop "
        "(default: the model's)",
    )
    p.add_argument("--model", default=None, help="check that the checkpoint holds this model")
    p.add_argument("--ema", action="store_true", help="evaluate the EMA weights")
    p.add_argument("--batch-size", type=opt.positive_int, default=256, help="evaluation batch size (default 256)")
    p.add_argument("--threads", type=opt.threads, default=2, help="torch threads (0: torch's default; default 2)")
    p.add_argument(
        "--workers",
        type=opt.non_negative_int,
        default=0,
        help="DataLoader workers decoding a folder: dataset (default 0)",
    )
    add_device_argument(p)
    p.add_argument("--amp", default="none", choices=("none", "bf16", "fp16"), help="autocast dtype")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")


def run(args: argparse.Namespace) -> int:
    from ..common.io import check_writable_file, write_json_atomic

    if args.json:
        check_writable_file(args.json, "--json")  # before the evaluation
    rows = evaluate_checkpoint(
        args.checkpoint,
        args.img_size,
        args.data,
        args.model,
        args.ema,
        args.batch_size,
        args.device,
        args.amp,
        args.threads,
        args.weights,
        args.workers,
        args.crop_pct,
    )
    print(f"{'model':20s} {'size':>5s} {'top-1 %':>8s} {'top-5 %':>8s} {'loss':>7s} {'img/s':>8s}  (trained at)")
    for r in rows:
        print(
            f"{r['model']:20s} {r['img_size']:5d} {r['top1']:8.2f} {r['top5']:8.2f} {r['loss']:7.4f} "
            f"{r['img_s']:8.0f}  ({r['trained_at']}px, {r['n']} images"
            + (f", {r['skipped']} unreadable ones skipped)" if r.get("skipped") else ")")
        )
    if args.json:
        write_json_atomic(args.json, rows)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
