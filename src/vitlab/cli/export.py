"""``vitlab export``: a model to ONNX or TorchScript (a dynamic input size where it can vary), checked against eager.

The file is written atomically (a temporary file renamed over ``--out`` when complete). ``--check`` runs the
written export at batch 1, 2 and 3 (and at twice the size where the size is dynamic) against eager PyTorch before
it replaces ``--out``: a failed check is one line and leaves ``--out`` as it was. A model whose ONNX weights go to
a companion file (``OUT.data``, over :data:`vitlab.interop.export.EXTERNAL_DATA_BYTES`) writes two files that
belong together: the command then holds the output folder's lock (:class:`vitlab.common.rundir.RunLock`), so that
two exports to one name cannot mix their halves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from ..common import options as opt
from ..common.io import check_writable_file
from ..common.rundir import RunLock
from ..interop.export import (
    _export_size,
    check_onnx,
    check_shapes,
    compare,
    example_input,
    export_onnx,
    save_torchscript,
    to_torchscript,
    writes_companion,
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
        "--batch",
        type=opt.positive_int,
        default=1,
        help="example batch size (ONNX: the batch axis is dynamic anyway; a batch of 1 is exported as 2)",
    )
    p.add_argument("--static-size", action="store_true", help="ONNX: fixed height and width even where they could vary")
    p.add_argument(
        "--check",
        action="store_true",
        help="run the export at batch 1, 2 and 3 (and at twice the size where it is dynamic) against eager PyTorch "
        "before writing it, and print the errors",
    )


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
    checked: dict[str, dict[str, float]] = {}
    if args.format == "onnx":
        dynamic = not args.static_size and supports_dynamic_size(model)

        def check(path: Path) -> None:
            checked.update(check_onnx(model, path, x, dynamic))

        # two files (OUT and OUT.data) are one export: the folder's lock keeps another export from mixing in
        lock = RunLock(out.parent, "vitlab export", _note) if writes_companion(model) else contextlib.nullcontext()
        with lock:
            export_onnx(model, x, out, dynamic_size=dynamic, check=check if args.check else None)
        result: dict[str, Any] = {"out": str(out), "dynamic_size": dynamic}
    else:
        traced = to_torchscript(model, x)
        if args.check:  # a trace records the example's shape, with the batch size free
            checked = compare(model, traced, check_shapes(x, False), "the TorchScript trace")
        save_torchscript(traced, out)
        result = {"out": str(out)}
    if args.check:
        result["max_abs_error"] = max(e["abs"] for e in checked.values())
        result["max_rel_error"] = max(e["rel"] for e in checked.values())
        result["checked"] = checked
    print(json.dumps({"model": args.model, "format": args.format, **result}))
    return 0


def _note(line: str) -> None:
    print(line, file=sys.stderr)  # stdout's last line is the JSON result
