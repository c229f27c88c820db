"""``vitlab bench-data``: images/s of decode + training transform through DataLoader workers beside a plain PIL pipeline; loader memory."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..bench.data import (
    STEP_MODELS,
    _dataset,
    gemm_share,
    loader_memory,
    report_text,
    step_time,
    throughput,
)
from ..common import options as opt
from ..common.device import add_device_argument, resolve_device
from ..measure.machine import machine_info
from ..measure.sweep import csv_list, write_json, write_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="folder:ROOT to read (default: generate a synthetic ImageNet-like folder)")
    p.add_argument(
        "--images", type=opt.positive_int, default=1000, help="images to generate without --data (default 1000)"
    )
    p.add_argument("--img-size", type=opt.image_size, default=224, help="output size (default 224)")
    p.add_argument(
        "--workers", type=csv_list(opt.non_negative_int), default=[0, 1, 2], help="worker counts (default 0,1,2)"
    )
    p.add_argument("--batch-size", type=opt.positive_int, default=32)
    p.add_argument("--batches", type=opt.positive_int, default=12, help="timed batches per measurement (default 12)")
    p.add_argument("--rounds", type=opt.positive_int, default=2, help="A/B rounds per worker count (default 2)")
    p.add_argument("--decoder", default="auto", choices=["auto", "pillow", "simplejpeg"])
    p.add_argument("--step-models", type=csv_list(str), default=list(STEP_MODELS), help="models for step time")
    p.add_argument(
        "--step-batch", type=opt.positive_int, default=32, help="batch of the training step timing (default 32)"
    )
    p.add_argument("--no-step", action="store_true", help="skip the training step timing")
    add_device_argument(p, default="cpu")  # where the batch stage and the training step run
    p.add_argument("--no-memory", action="store_true", help="skip the loader memory measurement")
    p.add_argument("--out", default="runs/bench-data", help="folder for report.json and report.txt")


def run(args: argparse.Namespace) -> int:
    from ..common.io import check_writable_folder
    from ..data import open_source

    args.device = str(resolve_device(args.device))  # a GPU that is not there: one line, before any work
    out = check_writable_folder(args.out)
    with tempfile.TemporaryDirectory(prefix="vitlab-bench-data-") as tmp:
        root = _dataset(args, Path(tmp))
        source = open_source(f"folder:{root}", "train")
        doc: dict[str, Any] = {"img_size": args.img_size, "images": len(source), "options": vars(args)}
        doc["machine"], doc["loadavg"] = machine_info(), os.getloadavg()[0]
        doc["throughput"] = throughput(source, args)
        per_worker = max(r["img_s"] for r in doc["throughput"] if r["pipeline"] == "vitlab" and r["workers"] == 1) if (
            1 in args.workers) else max(r["img_s"] for r in doc["throughput"] if r["pipeline"] == "vitlab")  # fmt: skip
        if not args.no_step:
            doc["steps"] = []
            for model in args.step_models:
                for dtype in ("fp32", "bf16"):
                    sec = step_time(model, args.step_batch, args.img_size, dtype, device=args.device)
                    img_s = args.step_batch / sec
                    doc["steps"].append({"model": model, "dtype": dtype, "batch": args.step_batch, "seconds": sec,
                                         "img_s": img_s, "workers_needed": img_s / per_worker,
                                         "device": args.device})  # fmt: skip
                    if torch.device(args.device).type == "cuda":
                        share = gemm_share(model, args.step_batch, args.img_size, sec, dtype, args.device)
                        doc["steps"][-1]["gemm_share"] = share
                    print(f"  step {model} {dtype}: {sec:.3f} s ({img_s:.1f} img/s)", flush=True)
        if not args.no_memory:
            doc["memory"] = loader_memory(root, Path(tmp))
    write_json(Path(out) / "report.json", doc)
    text = report_text(doc)
    write_text(Path(out) / "report.txt", text)
    print(text)
    return 0
