"""Every shipped recipe and every study row starts: the first optimisation step of each, as shipped, at a size
that fits a test (tiny synthetic data, a small image, batch 2).

The fast form keeps everything a recipe says (its loss, augmentation, mixing, token labelling, distillation,
schedule, ``model_args``) and trains the small model of the recipe's family in place of the paper-size one
(:func:`mini_of`); the slow form trains the recipe's own model. Study rows start as ``vitlab study`` builds
them: the small rows on the embedded digits at 28 px, the paper-size rows (slow) with their switches.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from vitlab.common.distributed import World
from vitlab.data.synth import synthesize
from vitlab.engine.config import TrainConfig
from vitlab.engine.loop import forward_backward, optimizer_step, train
from vitlab.engine.recipes import load_recipe, paper_line, shipped_recipes
from vitlab.engine.setup import setup
from vitlab.experiments.papers import STUDIES
from vitlab.experiments.runner import adapt_to_size
from vitlab.models import get_config, list_models

RECIPES = list(shipped_recipes())
SIZE_WORDS = {"ti", "s", "m", "b", "l", "tiny", "small", "medium", "base", "large", "distilled"}
# the size overrides: everything else is the recipe's (its epochs too: the schedule keeps its warmup)
SMALL = dict(img_size=32, batch_size=2, workers=0, threads=1, eval_batch_size=2, device="cpu")


def quiet(line: str) -> None:
    pass


def mini_of(model: str) -> str:
    """The small registered model of ``model``'s family: its name without the size words (``s``, ``small``,
    ``patch16``, ``224``, ...), cut from the right until ``<prefix>_mini`` is registered (``cpvt_ti_gap`` ->
    ``cpvt_gap_mini``, ``deepvit_16b`` -> ``deepvit_16b_mini``, ``aft_conv_small_384_11`` -> ``aft_conv_mini``)."""
    minis = {m for m in list_models() if m.endswith("_mini")}
    words = [w for w in model.split("_") if w not in SIZE_WORDS and not w.isdigit() and not w.startswith("patch")]
    for k in range(len(words), 0, -1):
        if (name := "_".join(words[:k]) + "_mini") in minis:
            return name
    raise AssertionError(f"no *_mini model of {model}'s family")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Four training and two held-out images of two classes, with dense token-labelling targets beside them."""
    root = tmp_path_factory.mktemp("recipes") / "data"
    synthesize(root, num_classes=2, train_per_class=2, val_per_class=1, size=(40, 36), seed=0)
    rng = np.random.default_rng(0)
    for image in root.rglob("*.JPEG"):
        scores = np.sort(rng.random((2, 4, 4)), axis=0)[::-1]  # top-2 scores, the best first
        classes = np.stack([np.zeros((4, 4)), np.ones((4, 4))])
        np.save(image.with_name(image.name + ".tl.npy"), np.stack([scores, classes]).astype(np.float16))
    return root


@pytest.fixture(scope="module")
def teacher(data, tmp_path_factory) -> Path:
    """A tiny trained classifier of the data: the teacher the distillation recipes ask for."""
    out = tmp_path_factory.mktemp("recipes") / "teacher"
    cfg = TrainConfig(model="deit_mini", model_args={"depth": 1}, data=f"folder:{data}", out=str(out),
                      epochs=1, batch_size=2, img_size=32, threads=1, progress=False, device="cpu")  # fmt: skip
    train(cfg, quiet)
    return out / "last.pt"


def recipe_config(name: str, data: Path, out: Path, teacher: Path, whole_model: bool = False) -> TrainConfig:
    """The recipe's options with the size overrides: tiny data, 32 px, batch 2, one epoch, no workers; the
    model's small form unless ``whole_model``; the teacher where the recipe distils."""
    _, values, _ = load_recipe(name)
    values = {**values, **SMALL, "data": f"folder:{data}", "out": str(out), "progress": False}
    distilled = bool(get_config(values["model"]).kwargs.get("dist_token"))
    if not whole_model:
        values["model"] = mini_of(values["model"])
        values["dist_token"] = distilled  # the small model gets the distillation token the recipe's model has
    else:
        values["img_size"] = 64  # a 4x4 grid of the paper models' 16-px patches
    if distilled:
        values["teacher"] = str(teacher)
    return TrainConfig(**values)


def first_step(cfg: TrainConfig) -> tuple[float, float]:
    """Set the run up as ``vitlab train`` does and take its first optimizer step: (its loss, the gradient norm).
    The step itself runs at the warmup's first learning rate (0 for the recipes), so a working step shows in its
    gradients, and in the learning rate it leaves for the next step (checked positive)."""
    run = setup(cfg, quiet, World(), torch.device("cpu"), time.perf_counter())
    try:
        run.net.model.train()
        run.data.loader.set_epoch(0)
        batch = next(iter(run.data.loader))
        loss, _ = forward_backward(run, batch, 1.0, True)
        norm = optimizer_step(run)
        assert run.step == 1 and run.opt.optimizer.param_groups[0]["lr"] > 0
    finally:
        run.steps.close()
    return loss.item(), norm.item()


def started(loss: float, norm: float) -> bool:
    return math.isfinite(loss) and math.isfinite(norm) and norm > 0


def test_every_recipe_has_a_small_model_and_the_whole_recipe():
    assert len(RECIPES) >= 30
    for name in RECIPES:
        _, values, reference = load_recipe(name)
        mini = mini_of(values["model"])
        assert get_config(mini).arch == get_config(values["model"]).arch, (name, mini)
        assert set(reference) >= {"paper", "source"}, name
    assert mini_of("cpvt_ti_gap") == "cpvt_gap_mini" and mini_of("deepvit_24b") == "deepvit_24b_mini"
    assert mini_of("refiner_vit_l") == "refiner_vit_mini" and mini_of("aft_conv_small_384_15") == "aft_conv_mini"


def test_token_labelling_recipes_build_the_aux_head():
    for name in RECIPES:
        _, values, _ = load_recipe(name)
        if values.get("token_label"):
            assert values.get("model_args", {}).get("aux_head") is True, name


def test_every_recipe_takes_its_first_step(data, teacher, tmp_path):
    """One optimizer step per recipe file, its options as shipped (the size overrides aside)."""
    for name in RECIPES:
        cfg = recipe_config(name, data, tmp_path / name, teacher)
        assert started(*first_step(cfg)), name


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_takes_its_first_step_with_its_own_model(name, data, teacher, tmp_path):
    assert started(*first_step(recipe_config(name, data, tmp_path / name, teacher, whole_model=True)))


# the classification studies (the segmentation studies train on mask folders: tests/test_seg.py runs each of them)
STUDY_ROWS = [(s, r) for s in STUDIES.names() if STUDIES.get(s).score == "top1" for r in STUDIES.get(s).rows]


def row_config(small: bool, model: str, model_args: dict, out: Path, data: Path) -> TrainConfig:
    """A study row's run as ``vitlab study`` builds it: the small rows on the embedded digits (adapted to 28 px),
    the paper-size rows on the folder at 64 px; one epoch of batch 2."""
    if small:
        args = {**adapt_to_size(model, 28), **model_args}
        return TrainConfig(model=model, model_args=args, data="mnist", train_limit=4, holdout=2,
                           **{**SMALL, "img_size": None}, out=str(out), progress=False)  # fmt: skip
    return TrainConfig(model=model, model_args=model_args, data=f"folder:{data}", **{**SMALL, "img_size": 64},
                       out=str(out), progress=False)  # fmt: skip


def test_every_small_study_row_takes_its_first_step(tmp_path, data):
    seen = set()
    for study, row in STUDY_ROWS:
        run = f"{row.small}{sorted(row.small_args.items())}"
        if run in seen:  # a small model with the same switch in several studies is the same run
            continue
        seen.add(run)
        out = tmp_path / f"{study}-{row.key}"
        assert started(*first_step(row_config(True, row.small, dict(row.small_args), out, data))), (study, row.key)


@pytest.mark.slow
@pytest.mark.parametrize("study_row", STUDY_ROWS, ids=[f"{s}-{r.key}" for s, r in STUDY_ROWS])
def test_every_full_study_row_takes_its_first_step(study_row, tmp_path, data):
    _, row = study_row
    assert started(*first_step(row_config(False, row.full, dict(row.full_args), tmp_path / "run", data)))


def test_the_run_prints_the_papers_figure_beside_its_own():
    reference = load_recipe("tnt_small")[2]
    summary = {"final": {"val_top1": 12.5}, "best": {"val_top1": 25.0}}
    line = paper_line(reference, summary)
    assert line.startswith("this run: held-out top-1 12.50 % (best 25.00 %)") and "81.5 % top-1" in line
    assert reference["source"] in line
    assert paper_line({"source": "none given"}, summary) is None


def test_a_recipe_whose_warmup_outlasts_the_run_warms_up_all_run(data, teacher, tmp_path):
    """deit_small's 5 warmup epochs in a 1-epoch run: the whole run is warmup (no error)."""
    cfg = dataclasses.replace(recipe_config("deit_small", data, tmp_path / "short", teacher), epochs=1)
    assert started(*first_step(cfg))
