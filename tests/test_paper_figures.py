"""The papers' figures that vitlab prints and documents agree with their one source: the registry's ``top1``,
each recipe's ``reference``, the recipe table of docs/training.md, and the paper-scale schedules of
docs/scale.md (the commands parse, and their steps are the paper's epochs)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from vitlab.engine.recipes import load_recipe, shipped_recipes
from vitlab.models import get_config

DOCS = Path(__file__).resolve().parents[1] / "docs"
# recipes of another experiment than their model's registered figure: a random start of a row the registry
# gives fine-tuned (AFT Table 8)
OTHER_EXPERIMENT = {"aft_conv_base_384_rand"}


def recipe_table() -> dict[str, tuple[str, str]]:
    """docs/training.md's table: recipe -> (model, figure as printed)."""
    rows = {}
    for line in (DOCS / "training.md").read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = (cells[1].strip("`"), cells[2])
    return rows


def test_the_recipe_table_prints_each_recipe_model_and_figure():
    table = recipe_table()
    assert sorted(table) == sorted(shipped_recipes())
    for name, (model, figure) in table.items():
        _, options, reference = load_recipe(name)
        assert model == options["model"], name
        assert (None if figure == "–" else float(figure)) == reference["top1"], name


def test_a_recipe_of_a_registered_row_quotes_the_registry_figure():
    """A recipe that trains its model's own experiment (ImageNet, no teacher, no starting checkpoint) gives the
    registry's figure: TNT-S is 81.5 in both, not 81.3 in one."""
    checked = 0
    for name in shipped_recipes():
        _, options, reference = load_recipe(name)
        own = not options.get("distillation") and "init_from" not in reference.get("needs", {})
        if own and name not in OTHER_EXPERIMENT and "data" not in reference.get("needs", {}):
            assert reference["top1"] == get_config(options["model"]).top1, name
            checked += 1
    assert checked >= 25


def lm_commands() -> list[list[str]]:
    """The `vitlab lm train` commands of docs/scale.md, as argument lists after `lm train`."""
    text = (DOCS / "scale.md").read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if "-m vitlab.cli lm train" in line:
            commands.append(shlex.split(line.split("-m vitlab.cli lm train", 1)[1]))
    return commands


@pytest.mark.parametrize(
    ("model", "epochs", "examples_per_epoch"),
    [("aft_local_256_cifar", 200, 50_000), ("aft_local_32_enwik8", 100, 90_000_000 / 1024)],
)
def test_the_paper_scale_sequence_commands_run_the_paper_schedules(model, epochs, examples_per_epoch):
    """AFT Table 2: CIFAR-10 at batch 128 for 200 epochs; Table 4: enwik8 at batch 128 for 100 epochs of its 90M
    training bytes in windows of 1,024."""
    from vitlab.cli.lm import _train_args

    (argv,) = [c for c in lm_commands() if model in c]
    parser = argparse.ArgumentParser()
    _train_args(parser)
    args = parser.parse_args(argv)
    assert args.batch_size == 128
    assert args.steps * args.batch_size / examples_per_epoch == pytest.approx(epochs, rel=1e-3)
    if "cifar" in model:
        assert args.lr == 3e-3 and args.weight_decay == 0.1
    else:
        assert args.weight_decay == 0.5 and re.search(r"--holdout 5000000 --valid 5000000", " ".join(argv))
