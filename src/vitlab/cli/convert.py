"""``vitlab convert``: a checkpoint -> a vitlab safetensors file or model folder, with a report.

The checkpoint is an official / timm one (``--model`` names the vitlab model; keys detected and mapped,
loaded strictly), or a ``vitlab train`` checkpoint / model folder, whose model is rebuilt as it was built
(channels, input size, classes, training data) without asking. ``--format folder`` writes a model folder
(config.json + model.safetensors + README.md) that ``vitlab.from_pretrained`` reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..common import options as opt
from ..common.io import check_writable_file, check_writable_folder
from ..interop.keymaps import SOURCES
from ..interop.rebuild import map_reference_checkpoint, rebuild_vitlab_model

FORMATS = ("safetensors", "folder")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        help="an official / timm checkpoint (.pth/.pth.tar/.bin/.safetensors), a `vitlab train` checkpoint, "
        "or a model folder",
    )
    p.add_argument(
        "--model",
        default=None,
        help="registered vitlab model to load an official / timm checkpoint into (see `vitlab models`); a "
        "`vitlab train` checkpoint names its own",
    )
    p.add_argument(
        "--source",
        default="auto",
        choices=["auto", *SOURCES],
        help="which implementation wrote the checkpoint (default: detected from its key names)",
    )
    p.add_argument("--format", default="safetensors", choices=FORMATS, help="what to write (default: safetensors)")
    p.add_argument(
        "--out",
        default=None,
        help="file (or folder, with --format folder) to write (default: the checkpoint's name, .safetensors or "
        "-vitlab/)",
    )
    p.add_argument(
        "--num-classes",
        type=opt.positive_int,
        default=None,
        help="classifier size (default: taken from the checkpoint's head)",
    )
    p.add_argument(
        "--img-size",
        type=opt.image_size,
        default=None,
        help="build the model for this input size (a learned position table is resampled, and reported)",
    )
    p.add_argument("--ema", action="store_true", help="a `vitlab train` checkpoint: convert its EMA weights")
    p.add_argument("--nested-key", default=None, help="checkpoint entry holding the weights (default: detected)")
    p.add_argument(
        "--no-strict",
        action="store_true",
        help="write whatever fits even if tensors are missing, unexpected or of another shape",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def stem_of(src: Path) -> str:
    name = src.name
    for suffix in (".pth.tar", ".pth", ".pt", ".bin", ".tar", ".ckpt", ".safetensors"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def default_out(src: Path, fmt: str = "safetensors") -> Path:
    if fmt == "folder":
        return src.with_name(stem_of(src) + "-vitlab")
    return src.with_name(stem_of(src) + (".vitlab" if src.suffix == ".safetensors" else "") + ".safetensors")


def run(args: argparse.Namespace) -> int:
    src = Path(args.checkpoint).expanduser()
    out = Path(args.out) if args.out else default_out(src, args.format)
    (check_writable_folder if args.format == "folder" else check_writable_file)(out)
    if not src.exists():
        raise FileNotFoundError(f"checkpoint {src} not found")
    built = rebuild_vitlab_model(src, args.model, args.num_classes, args.img_size, args.ema)
    if built is None:  # not a vitlab checkpoint: an official / timm one
        built = map_reference_checkpoint(src, args.model, args.source, args.nested_key, args.num_classes, args.img_size)
    model, report, info = built
    if args.json:
        ok = report is None or report.ok or args.no_strict
        print(json.dumps({**info, "out": str(out) if ok else None}, indent=1))
    else:
        print("\n".join(report.lines()) if report is not None else info["summary"])
    if report is not None and not report.ok and not args.no_strict:
        raise ValueError(
            f"{src} does not fit {args.model}: {report.problems()} (see the report above); "
            f"nothing written; --no-strict writes the partial conversion"
        )
    if args.format == "folder":
        model.save_pretrained(out)
    else:
        from ..interop.convert import save_weights

        meta = {"format": "pt", "writer": "vitlab convert", "model": model.model_name, "checkpoint": src.name}
        meta["model_kwargs"] = json.dumps(model.model_kwargs)
        save_weights(model, out, metadata=meta)
    if not args.json:
        print(f"wrote {out}")
    return 0
