"""``vitlab eval``: top-1 / top-5 and throughput of a checkpoint on held-out data, at its training input
size or others (``--img-size 28 56``): the CPVT paper's "train at 224, test at 384 without fine-tuning".

At another size the held-out images are resized (bilinear, antialiased) and the model runs on the larger
patch grid: PEG and AFT-conv adapt by construction, a learned position table and AFT-full/local's position
biases are resampled (bicubic over the patch grid).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

from ..device import add_device_argument, resolve_device


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint written by `vitlab train` (or its output folder)")
    p.add_argument(
        "--img-size",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="evaluate at these input sizes (default: the training size)",
    )
    p.add_argument("--data", default=None, help="dataset spec (default: the one the checkpoint was trained on)")
    p.add_argument("--model", default=None, help="check that the checkpoint holds this model")
    p.add_argument("--ema", action="store_true", help="evaluate the EMA weights")
    p.add_argument("--batch-size", type=int, default=256, help="evaluation batch size (default 256)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default; default 2)")
    add_device_argument(p)
    p.add_argument("--amp", default="none", choices=("none", "bf16", "fp16"), help="autocast dtype")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")


def supports_dynamic_size(model_name: str) -> bool:
    from ..models import get_config
    from ..models.registry import architecture

    return "dynamic_img_size" in inspect.signature(architecture(get_config(model_name).arch).__init__).parameters


def evaluate_checkpoint(
    path: str | Path,
    img_sizes: list[int] | None = None,
    data: str | None = None,
    model_name: str | None = None,
    ema: bool = False,
    batch_size: int = 256,
    device: str = "auto",
    amp: str = "none",
    threads: int = 2,
) -> list[dict[str, Any]]:
    """One result row per input size: ``{model, img_size, top1, top5, loss, n, img_s}``."""
    import torch

    from ..checkpoint import load_checkpoint, load_model
    from ..data import BatchLoader, load_dataset, make_transform
    from ..device import amp_dtype
    from .engine import evaluate, is_oom

    if threads > 0:
        torch.set_num_threads(threads)
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    ckpt = load_checkpoint(path)
    cfg = ckpt.get("config", {})
    spec = data or cfg.get("data", "mnist")
    train_size = int(ckpt.get("model_kwargs", {}).get("img_size") or 224)
    sizes = img_sizes or [train_size]
    if any(s < 1 for s in sizes):
        raise ValueError(f"--img-size must be positive, got {sizes}")
    other = any(s != train_size for s in sizes)
    overrides = {"dynamic_img_size": True} if other and supports_dynamic_size(ckpt["model_name"]) else {}
    model = load_model(model_name or ckpt["model_name"], ckpt, ema=ema, **overrides)  # a --model is checked
    if other:  # AFT-full/local: interpolate the learned position biases to the new token count, as the table
        for m in model.modules():
            if isinstance(getattr(m, "resample", None), bool):
                m.resample = True
    dev = resolve_device(device)
    model.to(dev).eval()
    ds = load_dataset(spec, "test", img_size=train_size, holdout=cfg.get("holdout"))
    num_classes = ckpt.get("model_kwargs", {}).get("num_classes")
    if num_classes is not None and ds.num_classes != num_classes:
        raise ValueError(f"{spec!r} has {ds.num_classes} classes, the checkpoint's model predicts {num_classes}")
    if ds.in_chans != ckpt["model_kwargs"].get("in_chans", ds.in_chans):
        raise ValueError(
            f"{spec!r} has {ds.in_chans}-channel images, the model takes {ckpt['model_kwargs']['in_chans']}"
        )
    dtype = amp_dtype(amp, dev)
    rows = []
    for size in sizes:
        loader = BatchLoader(
            ds, batch_size, shuffle=False, transform=make_transform(False, size, ds.mean, ds.std), device=dev
        )
        try:
            res = evaluate(model, loader, dev, dtype)
        except ValueError as e:
            raise ValueError(f"{ckpt['model_name']} cannot run at {size}px: {e}") from None
        except RuntimeError as e:
            if is_oom(e):
                raise ValueError(
                    f"a batch of {batch_size} images at {size}px does not fit in memory; use a smaller --batch-size"
                ) from None
            raise
        rows.append(
            {
                "model": ckpt["model_name"],
                "img_size": size,
                "trained_at": train_size,
                "weights": "ema" if ema else "model",
                **res,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    from ..io import check_writable_file, write_json_atomic

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
    )
    print(f"{'model':20s} {'size':>5s} {'top-1 %':>8s} {'top-5 %':>8s} {'loss':>7s} {'img/s':>8s}  (trained at)")
    for r in rows:
        print(
            f"{r['model']:20s} {r['img_size']:5d} {r['top1']:8.2f} {r['top5']:8.2f} {r['loss']:7.4f} "
            f"{r['img_s']:8.0f}  ({r['trained_at']}px, {r['n']} images)"
        )
    if args.json:
        write_json_atomic(args.json, rows)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
