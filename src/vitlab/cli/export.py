"""``vitlab export``: a model to ONNX or TorchScript (a dynamic input size where it can vary), checked against eager."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from ..common import options as opt
from ..common.io import check_writable_file
from ..interop.export import (
    _export_size,
    example_input,
    export_onnx,
    onnx_session,
    run_onnx,
    to_torchscript,
)
from ..models import supports_dynamic_size


# ------------------------------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registered model name (see `vitlab models`)")
    p.add_argument("--format", choices=("onnx", "torchscript"), default="onnx")
    p.add_argument("--out", required=True, help="file to write (.onnx or .pt)")
    p.add_argument(
        "--weights",
        default=None,
        help="weights to load first (vitlab safetensors, a `vitlab train` checkpoint, or any checkpoint "
        "`vitlab convert` reads)",
    )
    p.add_argument(
        "--num-classes",
        type=opt.positive_int,
        default=None,
        help="classifier size (default: from --weights, else the config's)",
    )
    p.add_argument(
        "--img-size",
        type=opt.image_size,
        default=None,
        help="example input size (default: the model's); only models that take any size as built (no position "
        "table of fixed length) accept another",
    )
    p.add_argument(
        "--batch", type=opt.positive_int, default=1, help="example batch size (ONNX: the batch axis is dynamic anyway)"
    )
    p.add_argument("--static-size", action="store_true", help="ONNX: fixed height and width even where they could vary")
    p.add_argument("--check", action="store_true", help="compare the export with eager PyTorch and print the error")


def run(args: argparse.Namespace) -> int:
    from ..interop.pretrained import load_model
    from ..models import list_models

    check_writable_file(args.out)  # before the model is built and exported
    overrides = {"num_classes": args.num_classes} if args.num_classes is not None else {}
    fresh = not args.weights and args.model in list_models()  # random weights: built at --img-size, nothing resized
    if fresh and args.img_size:
        overrides["img_size"] = args.img_size
    # an official checkpoint (source detected), a `vitlab train` checkpoint or a model folder: the model is built
    # as its weights were (channels, input size, classes)
    model = load_model(args.model, args.weights or None, **overrides)
    x = example_input(model, args.batch, _export_size(model, args.img_size))
    out = Path(args.out)
    if args.format == "onnx":
        export_onnx(model, x, out, dynamic_size=False if args.static_size else None)
        result: dict[str, Any] = {
            "out": str(out),
            "dynamic_size": not args.static_size and supports_dynamic_size(model),
        }
        if args.check:
            sess = onnx_session(out)
            with torch.no_grad():
                result["max_abs_error"] = (run_onnx(sess, x) - model(x)).abs().max().item()
    else:
        traced = to_torchscript(model, x, out)
        result = {"out": str(out)}
        if args.check:
            with torch.no_grad():
                result["max_abs_error"] = (traced(x) - model(x)).abs().max().item()
    print(json.dumps({"model": args.model, "format": args.format, **result}))
    return 0
