"""``vitlab models``: the registered models with their parameters and MACs."""

from __future__ import annotations

import argparse
import inspect
import json
import sys

from ..common.options import image_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pattern", nargs="?", default="*", help="shell-style name filter, e.g. 'aft_*' (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--no-macs", action="store_true", help="skip counting MACs (faster)")
    p.add_argument("--img-size", type=image_size, default=None, help="count at this input size instead of the default")


def describe(name: str, macs: bool = True, img_size: int | None = None) -> dict:
    import torch

    from ..measure.flops import count_macs
    from ..models import build_model, get_config
    from ..models.registry import architecture

    cfg = get_config(name)
    overrides = {"img_size": img_size} if img_size else {}
    resamples = "dynamic_img_size" in inspect.signature(architecture(cfg.arch)).parameters  # (a CNN: any size)
    if img_size and resamples and cfg.kwargs.get("pos_embed", "learned") == "learned":
        overrides["dynamic_img_size"] = True
    with torch.device("meta"):
        model = build_model(name, **overrides)
    row = {
        "name": name,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
        "input_size": list(model.meta["input_size"]),
        "paper": cfg.paper,
        "source": cfg.source,
    }
    if macs:
        row["gmacs"] = round(count_macs(model, tuple(model.meta["input_size"])).gmacs, 3)
    return row


def run(args: argparse.Namespace) -> int:
    from ..models import list_models

    names = list_models(args.pattern)
    if not names:
        raise ValueError(f"no model matches {args.pattern!r}; try `vitlab models` for the full list")
    rows = []
    if not args.json:
        print(f"{'model':36s} {'params (M)':>10s} {'MACs (G)':>9s} {'input':>12s}  paper")
    for name in names:
        row = describe(name, macs=not args.no_macs, img_size=args.img_size)
        rows.append(row)
        if not args.json:
            gm = f"{row['gmacs']:9.3f}" if "gmacs" in row else f"{'-':>9s}"
            size = "x".join(map(str, row["input_size"]))
            print(f"{name:36s} {row['params_m']:10.2f} {gm} {size:>12s}  {row['paper'].split(',')[0]}", flush=True)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
    return 0
