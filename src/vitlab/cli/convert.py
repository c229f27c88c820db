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
from typing import Any

from ..common import options as opt
from ..common.io import check_writable_file, check_writable_folder
from ..interop.keymaps import SOURCES

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
    built = _vitlab_model(src, args)
    model, report, info = built if built is not None else _official_model(src, args)
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


def _vitlab_model(src: Path, args: argparse.Namespace) -> tuple[Any, None, dict[str, Any]] | None:
    """A `vitlab train` checkpoint or a model folder, rebuilt as it was built; None for other files."""
    from ..checkpoint import load_checkpoint
    from ..interop.pretrained import load_folder, load_model
    from ..models.folder import is_model_folder

    if is_model_folder(src):
        model = load_folder(src)
    else:
        try:
            ckpt = load_checkpoint(src)
        except ValueError:  # not a vitlab checkpoint: an official / timm one
            return None
        model = load_model(ckpt["model_name"], ckpt, ema=args.ema)
    if args.model and args.model != model.model_name:
        raise ValueError(f"{src} holds a {model.model_name!r} model, not {args.model!r}")
    if args.num_classes is not None and args.num_classes != model.num_classes:
        raise ValueError(f"{src} was trained for {model.num_classes} classes; its head cannot be converted to another")
    notes = []
    if args.img_size and (args.img_size, args.img_size) != model.img_size:
        notes.append(
            f"input size {model.img_size[0]}x{model.img_size[1]} -> {args.img_size} (position table resampled)"
        )
        model.set_input_size(args.img_size)
    kw = ", ".join(f"{k}={v!r}" for k, v in model.model_kwargs.items())
    summary = f"{model.meta['weights']}: {model.model_name}({kw}); every tensor loaded" + "".join(
        f"; {n}" for n in notes
    )
    info = {
        "source": "vitlab",
        "ok": True,
        "model": model.model_name,
        "model_kwargs": model.model_kwargs,
        "num_classes": model.num_classes,
        "notes": notes,
        "summary": summary,
    }
    return model, None, info


def _official_model(src: Path, args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """An official / timm checkpoint mapped into ``--model`` (non-strict here: the caller decides)."""
    from ..interop.convert import detect_source, load_reference, read_checkpoint
    from ..interop.keymaps import check_source, convert_state
    from ..models import build_model, get_config

    if not args.model:
        raise ValueError(f"{src} is not a vitlab checkpoint; name the vitlab model to load it into with --model")
    get_config(args.model)  # an unknown name fails before the checkpoint is read
    state = read_checkpoint(src, args.nested_key)
    source = detect_source(state) if args.source == "auto" else check_source(args.source)
    num_classes = args.num_classes
    if num_classes is None:
        head = convert_state(state, source)[0].get("head.weight")
        num_classes = head.shape[0] if head is not None and head.dim() == 2 else None
    overrides = {k: v for k, v in (("num_classes", num_classes), ("img_size", args.img_size)) if v}
    model = build_model(args.model, **overrides)
    report = load_reference(model, state, source=source, strict=False)
    report.origin = str(src)
    model.meta["weights"] = f"{src} ({source} weights)"
    return model, report, {**report.to_dict(), "model": args.model, "num_classes": num_classes}
