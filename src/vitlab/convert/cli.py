"""``vitlab convert``: an official / timm checkpoint -> a vitlab model -> a safetensors file, with a report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import options as opt
from ..io import check_writable_file
from .keymaps import SOURCES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint of the official code or timm (.pth/.pth.tar/.bin/.safetensors)")
    p.add_argument("--model", required=True, help="registered vitlab model to load it into (see `vitlab models`)")
    p.add_argument(
        "--source",
        default="auto",
        choices=["auto", *SOURCES],
        help="which implementation wrote the checkpoint (default: detected from its key names)",
    )
    p.add_argument(
        "--out", default=None, help="safetensors file to write (default: the checkpoint's name with .safetensors)"
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
        help="build the model for this input size (a learned position table is resampled)",
    )
    p.add_argument("--nested-key", default=None, help="checkpoint entry holding the weights (default: detected)")
    p.add_argument(
        "--no-strict",
        action="store_true",
        help="write whatever fits even if tensors are missing, unexpected or of another shape",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def default_out(src: Path) -> Path:
    name = src.name
    for suffix in (".pth.tar", ".pth", ".pt", ".bin", ".tar", ".ckpt", ".safetensors"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return src.with_name(name + (".vitlab" if src.suffix == ".safetensors" else "") + ".safetensors")


def run(args: argparse.Namespace) -> int:
    from ..models import create_model, get_config
    from .keymaps import check_source, convert_state
    from .load import detect_source, load_reference, read_checkpoint, save_weights

    src = Path(args.checkpoint)
    out = check_writable_file(args.out if args.out else default_out(src))
    get_config(args.model)  # an unknown name fails before the checkpoint is read
    state = read_checkpoint(src, args.nested_key)
    source = detect_source(state) if args.source == "auto" else check_source(args.source)
    overrides = {}
    num_classes = args.num_classes
    if num_classes is None:
        head = convert_state(state, source)[0].get("head.weight")
        num_classes = head.shape[0] if head is not None and head.dim() == 2 else None
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    if args.img_size:
        overrides["img_size"] = args.img_size
    model = create_model(args.model, **overrides)
    report = load_reference(model, state, source=source, strict=False)
    report.origin = str(src)
    if args.json:
        print(
            json.dumps(
                {
                    **report.to_dict(),
                    "model": args.model,
                    "num_classes": num_classes,
                    "out": str(out) if report.ok or args.no_strict else None,
                },
                indent=1,
            )
        )
    else:
        print("\n".join(report.lines()))
    if not report.ok and not args.no_strict:
        raise ValueError(
            f"{src} does not fit {args.model}: {report.problems()} (see the report above); "
            f"nothing written; --no-strict writes the partial conversion"
        )
    meta = {
        "format": "pt",
        "writer": "vitlab convert",
        "model": args.model,
        "source": source,
        "checkpoint": src.name,
        "num_classes": str(num_classes),
    }
    if args.img_size:
        meta["img_size"] = str(args.img_size)
    save_weights(model, out, metadata=meta)
    if not args.json:
        print(f"wrote {out}")
    return 0
