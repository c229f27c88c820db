"""``vitlab analyze``: look inside a model (random or a checkpoint) on a few images.

The analyses are the library :mod:`vitlab.analysis` (:func:`~vitlab.analysis.analyze`); this module reads
the options, loads the model (:func:`vitlab.interop.pretrained.load_model`) and the images, and prints a summary.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..analysis.analyses import ANALYSES, analyze, parse_what
from ..analysis.inputs import load_images
from ..common import options as opt
from ..common.device import add_device_argument, resolve_device
from ..common.io import check_writable_folder
from ..common.rundir import RunLock
from ..data.spec import SPEC_HELP, data_spec
from ..interop.pretrained import load_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registered model name (see `vitlab models`)")
    p.add_argument(
        "--checkpoint",
        help="weights: a `vitlab train` checkpoint, .safetensors, or a state dict (vitlab's or an official "
        "implementation's names); default: random init",
    )
    p.add_argument("--ema", action="store_true", help="use the EMA weights of a `vitlab train` checkpoint")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--data",
        type=data_spec,
        help=f"dataset, as `vitlab train` takes it: {SPEC_HELP} (default: the one a `vitlab train` checkpoint was "
        "trained on, else mnist)",
    )
    src.add_argument("--images", nargs="+", metavar="FILE", help="image files instead of a dataset")
    p.add_argument("--split", default="test", choices=("train", "test"), help="dataset split (default: test)")
    p.add_argument(
        "--num-images", type=opt.positive_int, default=4, help="images to analyse (default: 4; the first is plotted)"
    )
    p.add_argument(
        "--query",
        type=opt.Validated(parse_query, "cls or a patch index"),
        default=None,
        help="query token of the attention maps: 'cls' or a patch index (row-major); default: cls, "
        "or the centre patch for models without a class token",
    )
    p.add_argument("--threshold", type=opt.probability, default=0.9, help="similarity above which a block is 'similar'")
    p.add_argument(
        "--what",
        type=opt.Validated(parse_what, "analysis names"),
        default=parse_what("all"),
        help=f"comma-separated analyses: {', '.join(ANALYSES)}, aft (both aft_*), tnt (the three tnt_*), or all",
    )
    p.add_argument(
        "--slots",
        type=opt.Validated(parse_slots, "slot indices"),
        default=[0, 1],
        help="external attention memory slots to show (default: 0,1)",
    )
    p.add_argument(
        "--max-heads", type=opt.positive_int, default=24, help="heads / key channels shown per layer (default: 24)"
    )
    p.add_argument("--img-size", type=opt.image_size, help="build the model for this input size")
    p.add_argument("--in-chans", type=opt.positive_int, help="build the model for this many input channels")
    p.add_argument(
        "--num-classes", type=opt.positive_int, help="classes of the head (default: the checkpoint's, else 1000)"
    )
    p.add_argument("--batch-size", type=opt.positive_int, default=8, help="images per forward pass (default: 8)")
    add_device_argument(p)
    p.add_argument("--seed", type=opt.seed, default=0, help="seed of the random initialisation (default: 0)")
    p.add_argument("--out", default="analysis", help="output folder (default: ./analysis)")


def parse_query(spec: str) -> str:
    """``cls`` or a patch index (whether the grid has it is known once the model is built)."""
    if spec.strip().lower() != "cls" and not spec.strip().isdigit():
        raise ValueError(f"--query must be 'cls' or a patch index (0, 1, ...), got {spec!r}")
    return spec.strip()


def parse_slots(spec: str) -> list[int]:
    try:
        slots = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--slots must be comma-separated slot indices, got {spec!r}") from None
    if not slots or min(slots) < 0:
        raise ValueError(f"--slots must be non-negative slot indices, got {spec!r}")
    return slots


def run(args: argparse.Namespace) -> int:
    check_writable_folder(args.out)
    with RunLock(args.out, "vitlab analyze", print):  # owned before the model and the images are loaded
        return analyze_into(args)


def analyze_into(args: argparse.Namespace) -> int:
    """The analysis ``args`` describe, written to ``args.out`` (owned by the caller)."""
    what, slots = args.what, args.slots  # parsed and checked with the command line
    sizes = (("img_size", args.img_size), ("in_chans", args.in_chans), ("num_classes", args.num_classes))
    torch.manual_seed(args.seed)
    model = load_model(args.model, args.checkpoint or None, ema=args.ema, **{k: v for k, v in sizes if v is not None})
    model.to(resolve_device(args.device))
    weights = model.meta["weights"] if args.checkpoint else f"random init (seed {args.seed})"
    data = args.data or (None if args.images else model.pretrained_cfg.get("data"))
    images, x, data = load_images(model, data=data, files=args.images, split=args.split, num_images=args.num_images)
    print(f"{args.model} [{weights}] on {data}; analyses: {', '.join(what)}")
    report = analyze(
        model,
        images,
        x,
        what,
        args.out,
        query=args.query,
        threshold=args.threshold,
        slots=slots,
        max_heads=args.max_heads,
        batch_size=args.batch_size,
        lock=False,
    )
    diff = report["explicit_path_max_abs_logit_diff"]
    print(f"explicit path vs model(x): max |logit difference| = {diff:.2e}; summary: {Path(args.out) / 'summary.json'}")
    return 0
