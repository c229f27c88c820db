"""One table of a paper reproduced (``vitlab study NAME``): its rows trained and tabulated beside the paper's
own numbers.

A study (:mod:`vitlab.experiments.papers`; ``vitlab study --list``) is a set of rows, each a named configuration.
The rows train through ``vitlab compare``'s code (:func:`vitlab.experiments.runner.run_variants`: fresh processes,
``--jobs`` at a time, ``--resume``, one run folder per row and seed), ``--seeds`` times each (default 3), and
the table gives the mean ± standard deviation over the seeds next to the paper's figures and their source.

Scale: ``small`` (default) trains the ``*_mini`` rows on the embedded MNIST or any ``--data`` (on 28-px data
adapted to a 4x4 token grid, as compare does); ``full`` trains the paper-size models (with their switches as
overrides) and wants real data and a real recipe (a paper's shipped recipe too: ``--config deit_small``, its
model left to the rows; ``--nproc-per-node N`` trains each row under torchrun, :mod:`vitlab.experiments.launch`).
``--config FILE`` reads a recipe: a YAML (needs PyYAML:
``pip install 'vitlab[recipes]'``) or TOML mapping of training options (``epochs``, ``batch_size``, ``lr``,
``weight_decay``, ``warmup_epochs``, ``drop_path``, ``mixup``, ``cutmix``, ``amp``, ``device``, ``data``,
``img_size``, ``seeds``, ``scale``, ...). Flags override the file, the file overrides the study's defaults.

Output (``--out``, default ``runs/study/NAME``): ``table.csv/json/md``, ``curves.png``, ``study.png`` (top-1 per
row with error bars, the paper's figures beside), and for DeepViT's depth study ``similarity.png`` /
``similarity.json`` (the cross-layer similarity of attention maps from block to block).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from ..common.io import write_json_atomic
from ..common.report import Column
from ..data import create_loader, open_source
from ..engine.data import whole_image
from ..engine.loop import TrainConfig
from ..engine.recipes import find_recipe, read_recipe
from ..interop.pretrained import load_model
from ..measure.maps import adjacent_similarity, cross_layer_similarity, similar_block_count
from .papers import STUDIES, Study
from .resolution import RESOLUTION_STUDIES
from .runner import RECIPE, Plan, Variant
from .tables import SIMILAR, compare_note, plot_study, write_similarity

SCALES = ("small", "full")
STUDY_DEFAULTS = {"data": "mnist", "seed": 0, "seeds": 3, "scale": "small", "device": "auto"}
# flags a recipe file may also set (the rest of a recipe are TrainConfig fields)
RUN_KEYS = ("data", "img_size", "seed", "seeds", "train_limit", "scale", "device")
# TrainConfig fields a recipe may not set: they belong to each run, not to the recipe
NOT_RECIPE = (
    "model",
    "model_args",
    "out",
    "resume",
    "force",
    "progress",
    "threads",
    "teacher",
    "init_from",
    "dist_token",
)
ROW_OWN = ("model", "model_args")  # what a paper recipe says and a study's rows decide themselves
SIMILARITY_IMAGES = 64


def recipe_keys() -> list[str]:
    return [*RUN_KEYS, *(f.name for f in fields(TrainConfig) if f.name not in NOT_RECIPE and f.name not in RUN_KEYS)]


def recipe_options(path: str) -> dict[str, Any]:
    """A recipe file (a path, or the name of one in ``./recipes`` or shipped in the package) as a flat mapping
    of options (``-`` in names read as ``_``; the ``reference`` notes of a shipped recipe left out); one line for
    every problem."""
    file = find_recipe(path)
    data = {str(k).replace("-", "_"): v for k, v in read_recipe(file).items() if k not in ("reference", "needs")}
    rows_own = sorted(set(data) & set(ROW_OWN))
    if rows_own:  # a paper recipe (`vitlab train --config`) names its model: here every row names its own
        print(f"note: recipe {path}: {', '.join(rows_own)} left out (each row of the study builds its own model)")
        data = {k: v for k, v in data.items() if k not in ROW_OWN}
    unknown = sorted(set(data) - set(recipe_keys()))
    if unknown:
        raise ValueError(f"recipe {path}: unknown option(s) {', '.join(unknown)}; known: {', '.join(recipe_keys())}")
    return data


def resolve(args: argparse.Namespace, study: Study) -> tuple[dict[str, Any], str]:
    """Flags over the recipe file over the study's defaults over compare's recipe: sets the run options on
    ``args`` and returns (the training recipe, the scale)."""
    given = {k: getattr(args, k) for k in recipe_keys() if getattr(args, k, None) is not None}
    merged = {
        **RECIPE,
        **STUDY_DEFAULTS,
        **study.recipe,
        **(recipe_options(args.config) if args.config else {}),
        **given,
    }
    if merged["scale"] not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {merged['scale']!r}")
    for key in ("data", "img_size", "seed", "seeds", "train_limit", "device"):
        setattr(args, key, merged.get(key))
    recipe = {k: v for k, v in merged.items() if k not in RUN_KEYS}
    return recipe, merged["scale"]


def variants(study: Study, scale: str) -> list[Variant]:
    if scale == "small":
        return [Variant(r.key, r.small, dict(r.small_args)) for r in study.rows]
    return [Variant(r.key, r.full, dict(r.full_args)) for r in study.rows]


def list_studies() -> str:
    lines = []
    for name in STUDIES.names():
        s = STUDIES.get(name)
        lines.append(f"{name:28s} {s.title}")
        lines.append(f"{'':28s}   {s.paper}: {s.source}")
        lines.append(f"{'':28s}   rows: {', '.join(r.label for r in s.rows)}")
    for s in RESOLUTION_STUDIES.values():
        lines.append(f"{s.name:28s} {s.title}")
        lines.append(f"{'':28s}   {s.source}; one --checkpoint at {', '.join(map(str, s.sizes))} px")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the study's table and plots


class StudyReport:
    """The study's columns (paper row, our top-1 over seeds, the paper's figures), its note and plots, and the
    extra measure of the trained models (:func:`similarity_curves`)."""

    text_columns = 2

    def __init__(self, study: Study, scale: str) -> None:
        self.study, self.scale = study, scale
        paper = [(f"paper_{k}", header, fmt) for k, header, fmt in study.measures]
        extra: list[Column] = [("similar", "#similar", "{:.1f}")] if study.extra == "similarity" else []
        self.columns: list[Column] = [
            ("row", "row", "{}"),
            ("model", "model", "{}"),
            *(
                [("miou", "mIoU", "{:.2f}")]
                if study.score == "miou"
                else [("box_ap", "box AP", "{:.1f}"), ("mask_ap", "mask AP", "{:.1f}")]
                if study.score == "box_ap"
                else [("top1", "top-1 %", "{:.2f}"), ("top1_ci", "95% CI", "{}")]
            ),
            *extra,
            *paper,
            ("params_m", "params (M)", "{:.3f}"),
            ("mmacs", "MACs (M)", "{:.2f}"),
            ("train_s", "train s", "{:.0f}"),
        ]
        self.files = ("study.png",) + (("similarity.png", "similarity.json") if study.extra == "similarity" else ())
        self.curves: dict[str, list[float]] = {}
        self.similarity_images = 0

    def add(self, plan: Plan, rows: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> None:
        for row, spec, variant in zip(rows, self.study.rows, plan.variants):
            row["row"], row["key"], row["model"] = spec.label, spec.key, variant.model
            row["switch"] = variant.model_args
            for key, *_ in self.study.measures:
                row[f"paper_{key}"] = spec.paper.get(key)
        if self.study.extra == "similarity":
            self.curves, self.similarity_images = similarity_curves(plan, results, rows)
            write_json_atomic(plan.out / "similarity.json", {"threshold": SIMILAR, "adjacent_similarity": self.curves})

    def note(self, meta: dict[str, Any]) -> str:
        scale = "small-scale rows (*_mini)" if self.scale == "small" else "paper-size models"
        return (
            f"{self.study.title}. vitlab: {scale}. "
            + compare_note(meta, self.columns)
            + (
                f" #similar: blocks whose attention maps are over {SIMILAR:.0%} similar to the previous block's, on "
                f"the first {self.similarity_images} held-out images."
                if self.curves
                else ""
            )
            + f"\n\nPaper: {self.study.paper}, {self.study.source}. {self.study.notes}".rstrip()
        )

    def plot(self, out: Path, rows: list[dict[str, Any]]) -> list[Path]:
        written = [plot_study(out / "study.png", self.study, rows)]
        if self.curves:
            written += write_similarity(out, self.curves)
        return written


# --------------------------------------------------------------------------- DeepViT's cross-layer similarity


def similarity_curves(
    plan: Plan, results: dict[str, dict[str, Any]], rows: list[dict[str, Any]]
) -> tuple[dict[str, list[float]], int]:
    """Per row: the similarity of each block's attention maps with the previous block's (DeepViT §3), averaged
    over the seeds, on the first held-out images (their number is returned beside the curves); sets
    ``row["similar"]`` (blocks above 90 %, mean over seeds)."""
    images = heldout_images(plan)
    curves = {}
    for row, variant in zip(rows, plan.variants):
        runs = [r for r in plan.runs[variant.label] if results[r]["status"] == "ok"]
        if not runs:
            continue
        per_seed = [block_similarity(plan.out / r / "last.pt", images) for r in runs]
        row["similar"] = statistics.fmean(similar_block_count(sim, SIMILAR) for sim in per_seed)
        curves[row["row"]] = [statistics.fmean(c) for c in zip(*(adjacent_similarity(s).tolist() for s in per_seed))]
    return curves, len(images)


def heldout_images(plan: Plan) -> torch.Tensor:
    """The first :data:`SIMILARITY_IMAGES` held-out images, transformed as for evaluation."""
    cfg = next(iter(plan.configs.values()))
    source = open_source(cfg.spec, "val", holdout=cfg.holdout)  # the held-out part, as training held it out
    tf = whole_image(plan.img_size, source.mean, source.std)
    return next(iter(create_loader(source, tf, SIMILARITY_IMAGES, is_training=False)))[0]


def block_similarity(checkpoint: Path, images: torch.Tensor) -> torch.Tensor:
    """The (L, L) cross-layer similarity of a trained model's attention maps on ``images``."""
    model = load_model(checkpoint).eval()
    trace = getattr(model, "forward_trace", None) or model.forward_intermediates
    with torch.no_grad():
        out = trace(images, return_aux=True)
    return cross_layer_similarity([aux["attn"] for aux in out["aux"] if "attn" in aux])
