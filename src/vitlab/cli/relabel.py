"""``vitlab relabel``: dense token-label maps for an image folder from a teacher (LV-ViT's relabelling), the targets of ``--token-label``."""

from __future__ import annotations

import argparse

import torch

from ..common import options as opt
from ..common.device import add_device_argument
from ..distill.relabel import relabel
from ..distill.teacher import DEFAULT_TIMEOUT_S


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("teacher", help="a vitlab checkpoint (or run folder), a torch.export .pt2 or a TorchScript file")
    p.add_argument("folder", help="image folder: ImageNet layout (train/, val/) or one subfolder per class")
    p.add_argument("--top-k", type=opt.Int(1, 1000), default=5, help="class scores kept per location (default 5)")
    p.add_argument("--img-size", type=opt.image_size, default=None, help="the teacher's input size (default: its own)")
    p.add_argument("--out", default=None, help="write the maps under this folder, laid out as the images")
    p.add_argument("--batch-size", type=opt.positive_int, default=64, help="images per teacher call (default 64)")
    p.add_argument(
        "--teacher-timeout",
        type=opt.positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"end the run with an error if the teacher's first batch takes longer (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--threads", type=opt.threads, default=2, help="torch threads (0: torch's default; default 2)")
    add_device_argument(p)


def run(args: argparse.Namespace) -> int:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    n, skipped = relabel(args.teacher, args.folder, args.top_k, args.img_size, args.out, args.batch_size, args.device,
                         args.teacher_timeout)  # fmt: skip
    unreadable = f"; {len(skipped)} unreadable images skipped" if skipped else ""
    print(f"wrote {n} dense maps (top-{args.top_k}) for {args.folder}{unreadable}")
    return 0
