"""``vitlab compare``: train a set of variants on the same data and budget, evaluate them, one table (CSV / JSON / Markdown) and plots."""

from __future__ import annotations

import argparse

from ..experiments.runner import (
    DEFAULT_MODELS,
    RECIPE,
    Variant,
    add_run_arguments,
    resolve_models,
    run_variants,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models", default=",".join(DEFAULT_MODELS), help="comma-separated registered models (default: %(default)s)"
    )
    add_run_arguments(p, RECIPE, "runs/compare")


def run(args: argparse.Namespace) -> int:
    variants = [Variant(n, n) for n in resolve_models(args.models)]
    recipe = {**RECIPE, **{k: getattr(args, k) for k in ("epochs", "batch_size", "lr", "ema")}}
    return run_variants(args, variants, recipe, "vitlab compare")
