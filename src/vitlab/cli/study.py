"""``vitlab study NAME``: one table of a paper, trained and tabulated beside the paper's own numbers; ``--list`` shows them."""

from __future__ import annotations

import argparse

from ..experiments.papers import STUDIES
from ..experiments.reproduce import (
    SCALES,
    STUDY_DEFAULTS,
    StudyReport,
    list_studies,
    resolve,
    variants,
)
from ..experiments.resolution import RESOLUTION_STUDIES, run_resolution
from ..experiments.resolution import add_arguments as add_resolution_arguments
from ..experiments.runner import RECIPE, add_run_arguments, run_variants


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="the study to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the studies: name, paper table, rows")
    p.add_argument(
        "--scale", choices=SCALES, default=None, help="small: the *_mini rows (default); full: the paper-size models"
    )
    p.add_argument(
        "--config", default=None, help="recipe file: a YAML or TOML mapping of training options (flags override it)"
    )
    p.add_argument("--speed", action="store_true", help="also time each row's inference (img/s)")
    add_resolution_arguments(p)
    add_run_arguments(p, None, "runs/study/NAME", {**RECIPE, **STUDY_DEFAULTS})


def run(args: argparse.Namespace) -> int:
    if args.list:
        print(list_studies())
        return 0
    if not args.name:
        raise ValueError("name a study to run, e.g. `vitlab study cpvt-padding` (`vitlab study --list` shows them)")
    if args.name in RESOLUTION_STUDIES:
        return run_resolution(args)
    study = STUDIES.get(args.name)
    recipe, scale = resolve(args, study)
    if study.score != "top1" and (args.data == "mnist" or args.speed):
        what = {"miou": ("segmentation models", "voc:ROOT or ade20k:ROOT", "seg synth DIR` writes a small VOC-layout"),
                "box_ap": ("detectors", "coco:ROOT", "det synth DIR` writes a small COCO-layout")}[study.score]  # fmt: skip
        raise ValueError(
            f"{study.name} trains {what[0]}: give --data {what[1]} (`vitlab {what[2]} one), without --speed"
        )
    if args.out == "runs/study/NAME":
        args.out = f"runs/study/{study.name}" + ("" if scale == "small" else "-full")
    report = StudyReport(study, scale)
    command = f"vitlab study {study.name}" + ("" if scale == "small" else f" --scale {scale}")
    return run_variants(args, variants(study, scale), recipe, command, report, speed=args.speed)
