"""vitlab study: every study's rows exist and build, recipes, two studies end to end (the rest in the slow suite)."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch

import vitlab
from vitlab.cli import main as cli_main
from vitlab.cli.study import add_arguments
from vitlab.experiments.papers import STUDIES
from vitlab.experiments.reproduce import recipe_options, resolve
from vitlab.experiments.runner import adapt_to_size
from vitlab.models import get_config
from vitlab.tasks.segmentation import build_segmenter

NAMES = STUDIES.names()
QUICK = ("cpvt-padding", "aft-global")  # in the default suite
TINY = ["--epochs", "1", "--train-limit", "48", "--batch-size", "16", "--no-plots"]


def test_list_shows_every_study(capsys):
    assert cli_main(["study", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in NAMES) and len(NAMES) >= 20
    for must in ("refiner-kernel", "tnt-pos", "cpvt-peg-form", "deepvit-depth", "ea-norm", "aft-reparam"):
        assert must in NAMES


def build_detector_where_possible(backbone: str, switches: dict) -> None:
    """A detection row's detector (80 COCO classes); an R-CNN row only where torchvision's compiled ops load."""
    from vitlab.tasks.detection import build_detector
    from vitlab.tasks.detection.rcnn import torchvision_problem

    if switches["detector"] != "detr" and torchvision_problem() is not None:
        return
    build_detector(backbone, num_classes=80, **switches)


@pytest.mark.parametrize("name", NAMES)
def test_rows_are_registered_configs_that_build_small(name):
    study = STUDIES.get(name)
    assert len({r.key for r in study.rows}) == len(study.rows) >= 2
    assert {k for k, *_ in study.measures} >= {k for r in study.rows for k in r.paper}
    for row in study.rows:
        assert row.small.endswith("_mini") and get_config(row.small) and get_config(row.full)
        with torch.device("meta"):  # the size the study trains at on the embedded data (segmentation: 32-px crops)
            if study.score == "miou":
                build_segmenter(row.small, num_classes=21, img_size=32, **row.small_args)
            elif study.score == "box_ap":
                build_detector_where_possible(row.small, row.small_args)
            else:
                vitlab.create_model(
                    row.small,
                    img_size=28,
                    in_chans=1,
                    num_classes=10,
                    **{**adapt_to_size(row.small, 28), **row.small_args},
                )


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_full_rows_build_with_their_switches(name):
    for row in STUDIES.get(name).rows:
        with torch.device("meta"):
            if STUDIES.get(name).score == "miou":
                build_segmenter(row.full, num_classes=21, img_size=224, **row.full_args)
            elif STUDIES.get(name).score == "box_ap":
                build_detector_where_possible(row.full, row.full_args)
            else:
                vitlab.create_model(row.full, **row.full_args)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_recipe_files_and_their_precedence(tmp_path):
    toml = tmp_path / "r.toml"
    toml.write_text('epochs = 3\nbatch-size = 16\nseeds = 2\nweight_decay = 0.1\nscale = "small"\n')
    yaml = tmp_path / "r.yaml"
    yaml.write_text("epochs: 4\nlr: 0.001\ndata: mnist\n")
    assert recipe_options(str(toml)) == {
        "epochs": 3,
        "batch_size": 16,
        "seeds": 2,
        "weight_decay": 0.1,
        "scale": "small",
    }
    assert recipe_options(str(yaml)) == {"epochs": 4, "lr": 0.001, "data": "mnist"}
    study = STUDIES.get("cpvt-padding")
    args = parse("cpvt-padding", "--config", str(toml), "--epochs", "5")
    recipe, scale = resolve(args, study)
    # the flag over the file, the file over the study's defaults (3 seeds), those over compare's recipe
    assert recipe["epochs"] == 5 and recipe["batch_size"] == 16 and recipe["weight_decay"] == 0.1
    assert args.seeds == 2 and args.data == "mnist" and args.seed == 0 and scale == "small"
    assert recipe["lr"] == 3e-3 and "seeds" not in recipe and "scale" not in recipe
    recipe, scale = resolve(parse("cpvt-padding", "--scale", "full"), study)
    assert scale == "full" and recipe["epochs"] == 8


def test_recipe_mistakes_are_one_line(tmp_path, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text("epochz = 3\n")
    with pytest.raises(ValueError, match=r"unknown option.*epochz"):
        recipe_options(str(bad))
    bad.write_text("epochs = [\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        recipe_options(str(bad))
    with pytest.raises(FileNotFoundError, match="no such recipe file"):
        recipe_options(str(tmp_path / "none.yaml"))
    (tmp_path / "r.json").write_text("{}")
    with pytest.raises(ValueError, match=r"\.yaml, \.yml or \.toml"):
        recipe_options(str(tmp_path / "r.json"))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        recipe_options(str(tmp_path / "list.yaml"))
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed
    with pytest.raises(ImportError, match=r"needs yaml.*pip install 'vitlab\[recipes\]'"):
        recipe_options(str(tmp_path / "list.yaml"))


def test_study_user_errors_are_one_line(tmp_path, capsys):
    def error(*argv: str) -> str:
        assert cli_main(["study", *argv, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Traceback" not in err, err
        return err

    assert "cpvt-padding" in error("cpvt-paddin")  # the closest name
    assert "name a study" in error()
    (tmp_path / "r.toml").write_text('scale = "huge"\n')
    assert "scale must be one of" in error("cpvt-padding", "--config", str(tmp_path / "r.toml"))


@pytest.mark.parametrize("name", QUICK)
def test_quick_studies_end_to_end(name, tmp_path, capsys):
    out = tmp_path / name
    recipe = tmp_path / "tiny.toml"
    recipe.write_text("seeds = 2\n")  # the second study also reads its seeds from a recipe file
    extra = ["--seeds", "2"] if name == QUICK[0] else ["--config", str(recipe)]
    assert cli_main(["study", name, *TINY[:-1], *extra, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = json.loads((out / "table.json").read_text())
    study = STUDIES.get(name)
    assert table["meta"]["seeds"] == 2 and table["meta"]["train_images"] == 48
    for row, spec in zip(table["rows"], study.rows):
        assert row["row"] == spec.label and row["model"] == spec.small and row["paper_top1"] == spec.paper["top1"]
        assert len(row["top1_seeds"]) == 2 and row["top1"] == pytest.approx(sum(row["top1_seeds"]) / 2)
        assert row["top1_std"] >= 0
        for seed in (0, 1):
            log = json.loads((out / spec.key / f"seed{seed}" / "log.json").read_text())
            assert log[-1]["val_top1"] == row["top1_seeds"][seed]
        assert spec.label in printed
    md = (out / "table.md").read_text()
    assert " ± " in md and study.source in md and "paper top-1 %" in md
    assert (out / "study.png").read_bytes()[:4] == b"\x89PNG" and (out / "curves.png").exists()
    # the folder is this study's: another study's --resume is refused in one line and changes nothing
    other = next(n for n in QUICK if n != name)
    capsys.readouterr()
    assert cli_main(["study", other, *TINY, "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"holds the runs of `vitlab study {name}`" in err and "\n" not in err, err
    assert (out / "table.md").read_text() == md


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NAMES if n not in QUICK and STUDIES.get(n).score == "top1"])
def test_every_other_study_end_to_end(name, tmp_path):
    out = tmp_path / name
    assert cli_main(["study", name, *TINY, "--seeds", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "table.json").read_text())["rows"]
    assert len(rows) == len(STUDIES.get(name).rows) and all(r["top1"] is not None for r in rows)
    if STUDIES.get(name).extra == "similarity":
        curves = json.loads((out / "similarity.json").read_text())["adjacent_similarity"]
        for row in rows:
            depth = get_config(row["model"]).kwargs["depth"]
            assert len(curves[row["row"]]) == depth - 1 and 0 <= row["similar"] <= depth - 1


def test_resolution_study_evaluates_one_checkpoint_at_each_size(tmp_path, capsys):
    """`vitlab study cpvt-resolution`: a checkpoint trained at one size, evaluated at others (its PEGs adapt),
    each row beside the paper's figure of that model ("not given" for a model the table does not have)."""
    from vitlab.engine.config import TrainConfig
    from vitlab.engine.loop import train
    from vitlab.experiments.resolution import RESOLUTION_STUDIES

    run = tmp_path / "run"
    train(TrainConfig(model="cpvt_mini", model_args={"patch_size": 7}, train_limit=64, holdout=64,
                      epochs=1, batch_size=32, threads=1, progress=False, device="cpu", out=str(run)),
          lambda line: None)  # fmt: skip
    out = tmp_path / "res"
    argv = ["study", "cpvt-resolution", "--checkpoint", str(run), "--sizes", "28", "56", "--out", str(out)]
    assert cli_main(argv) == 0
    table = json.loads((out / "table.json").read_text())
    assert [r["img_size"] for r in table["rows"]] == [28, 56] and all(r["n"] == 64 for r in table["rows"])
    assert all(r["paper_top1"] == "not given" and 0 <= r["top1"] <= 100 for r in table["rows"])
    assert "not given" in capsys.readouterr().out and (out / "table.md").exists()
    assert cli_main(argv) == 2  # the folder holds a table: --force to redo it
    assert "already holds a run" in capsys.readouterr().err
    assert RESOLUTION_STUDIES["cpvt-resolution"].paper["cpvt_ti"] == {224: 73.4, 384: 74.2, 448: 72.6, 512: 70.8}
    assert cli_main(["study", "cpvt-resolution", "--out", str(tmp_path / "x")]) == 2
    assert "pass --checkpoint" in capsys.readouterr().err


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc: torchrun starts its workers in their own process groups)."""
    from pathlib import Path

    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


@pytest.mark.slow
@pytest.mark.skipif(not __import__("pathlib").Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_full_scale_study_under_torchrun_resumes_after_a_kill(tmp_path):
    """`vitlab study deepvit-depth --scale full --nproc-per-node 2` with a paper recipe on a tiny generated folder:
    each row trains under a 2-process torchrun (gloo); killed in the middle of a row, the study run again with
    --resume reuses the finished rows, continues the stopped one from its checkpoint, and writes the table
    beside the paper's figures."""
    import contextlib
    import os
    import signal
    import subprocess
    import time

    from vitlab.checkpoint import load_checkpoint
    from vitlab.data.synth import synthesize

    synthesize(tmp_path / "data", num_classes=2, train_per_class=4, val_per_class=2, size=(40, 36), seed=0)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "vitlab.cli", "study", "deepvit-depth", "--scale", "full", "--nproc-per-node",
            "2", "--data", f"folder:{tmp_path / 'data'}", "--img-size", "32", "--epochs", "3", "--batch-size", "4",
            "--seeds", "1", "--threads", "1", "--no-plots", "--config", "deit_small", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 900
    stopped = None
    while time.time() < deadline and stopped is None:  # the first row to hold its epoch-1 checkpoint
        time.sleep(0.5)
        for row in STUDIES.get("deepvit-depth").rows:
            if (out / row.key / "last.pt").exists() and not (out / row.key / "result.json").exists():
                stopped = row.key
    assert stopped is not None, "no row reached its first checkpoint"
    for pid in [first.pid, *descendants(first.pid)]:  # the study, its torchrun and the workers (own groups)
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.kill(pid, signal.SIGKILL)
    first.wait()
    time.sleep(2)  # the killed workers' files closed
    epoch = load_checkpoint(out / stopped / "last.pt")["epoch"]
    done = subprocess.run([*argv, "--resume"], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    mine = "\n".join(line for line in done.stdout.splitlines() if line.startswith(f"[{stopped}]") and "W1" not in line)
    if epoch < 3:  # killed before its last epoch ended (as nearly always): it continues from there
        assert "resumed" in mine and f"after epoch {epoch}" in mine, mine[-2000:]
    table = json.loads((out / "table.json").read_text())
    for row, spec in zip(table["rows"], STUDIES.get("deepvit-depth").rows):
        assert row["row"] == spec.label and row["paper_top1"] == spec.paper["top1"] and row["top1"] is not None
        result = json.loads((out / spec.key / "result.json").read_text())
        assert result["world_size"] == 2 and result["info"]["summary"]["epochs"] == 3
    # the caption says what ran (the recipe's base_lr 5e-4 x 4 / 512, not compare's lr), how many images the
    # similarity saw (the 4 held-out ones), and names no column the table lacks
    ran = json.loads((out / STUDIES.get("deepvit-depth").rows[0].key / "run.json").read_text())
    note = (out / "table.md").read_text()
    assert ran["lr"] == pytest.approx(5e-4 * 4 / 512) and f"peak lr {ran['lr']:.3g}" in note, note
    assert "on the first 4 held-out images" in note and "peak MiB" not in note
    assert ran["config"]["workers"] == 1  # the recipe's 8 workers capped at the one thread the row has


def test_a_paper_recipe_gives_the_options_and_the_rows_their_models(capsys):
    options = recipe_options("deit_small")
    assert "model" not in options and options["base_lr"] == 5e-4 and options["aug_repeats"] == 3
    assert "model left out" in capsys.readouterr().out
    recipe, scale = resolve(
        parse("deepvit-depth", "--config", "refiner_vit_small", "--scale", "full"), STUDIES.get("deepvit-depth")
    )
    assert "model_args" not in recipe and recipe["token_label"] is True and scale == "full"
