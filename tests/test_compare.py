"""vitlab compare: a two-variant run on a small budget writes the table, logs and plots; bad input is one line."""

from __future__ import annotations

import csv
import json

import pytest
import torch

import vitlab
from vitlab.cli import main as cli_main
from vitlab.common.report import render_markdown, render_text
from vitlab.experiments.runner import adapt_to_size, method_of
from vitlab.experiments.tables import COLUMNS, TEXT_COLUMNS
from vitlab.measure.flops import count_macs


def test_adaptation_gives_a_4x4_grid_on_mnist():
    for name in ("deit_mini", "cpvt_mini", "tnt_mini", "aft_conv_mini", "refiner_vit_mini"):
        model = vitlab.create_model(name, img_size=28, in_chans=1, num_classes=10, **adapt_to_size(name, 28))
        feats = model.forward_features(torch.randn(2, 1, 28, 28))
        assert feats.shape[1] - model.num_prefix == 16, name
    if "eamlp_mini" in vitlab.list_models():
        m = vitlab.create_model(
            "eamlp_mini", img_size=28, in_chans=1, num_classes=10, **adapt_to_size("eamlp_mini", 28)
        )
        assert m.grid == (4, 4)
    assert adapt_to_size("deit_mini", 32) == {} and adapt_to_size("deit_small_patch16_224", 28) == {}
    assert method_of("aft_conv_mini") == "AFT-conv" and method_of("aft_full_mini") == "AFT-full"


def test_tables_render_missing_values():
    rows = [{"model": "a", "method": "m", "top1": 90.123, "params_m": 0.2}, {"model": "b", "method": "n"}]
    text = render_text(rows, COLUMNS, TEXT_COLUMNS)
    assert "90.12" in text and text.count("\n") == 3
    md = render_markdown(rows, "note", COLUMNS, TEXT_COLUMNS)
    assert md.splitlines()[1].startswith("|---|---|---:") and "| b | n | - |" in md


def run_compare(out, *extra: str) -> list[str]:
    argv = [
        "compare",
        "--models",
        "deit_mini,cpvt_mini",
        "--epochs",
        "2",
        "--train-limit",
        "64",
        "--out",
        str(out),
        *extra,
    ]
    assert cli_main(argv) == 0
    return argv


def test_compare_two_variants_end_to_end(tmp_path, capsys):
    out = tmp_path / "cmp"
    run_compare(out)
    printed = capsys.readouterr().out
    assert "deit_mini" in printed and "cpvt_mini" in printed and "wall time" in printed
    for f in ("table.csv", "table.json", "table.md", "curves.png", "acc_vs_speed.png"):
        assert (out / f).stat().st_size > 0, f
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    table = json.loads((out / "table.json").read_text())
    rows = {r["model"]: r for r in table["rows"]}
    assert table["meta"]["train_images"] == 64 and table["meta"]["heldout_images"] == 1000
    for name, row in rows.items():
        log = json.loads((out / name / "log.json").read_text())
        assert [r["epoch"] for r in log] == [1, 2] and row["top1"] == log[-1]["val_top1"]
        assert (out / name / "log.csv").exists() and "epoch 2/2" in (out / name / "train.log").read_text()
        assert row["infer_img_s"] > 0 and row["train_img_s"] > 0 and row["peak_mib"] > row["train_mem_mib"] > 0
        kw = dict(img_size=28, in_chans=1, num_classes=10, **adapt_to_size(name, 28))
        with torch.device("meta"):
            model = vitlab.create_model(name, **kw)
        assert row["mmacs"] == pytest.approx(count_macs(model, (1, 28, 28)).total / 1e6)
        assert row["params_m"] == pytest.approx(sum(p.numel() for p in model.parameters()) / 1e6)
    with open(out / "table.csv") as f:
        assert [r["model"] for r in csv.DictReader(f)] == ["deit_mini", "cpvt_mini"]
    # the caption says what ran: the learning rate of run.json, one interval per accuracy, the columns it has
    ran = json.loads((out / "deit_mini" / "run.json").read_text())["lr"]
    note = (out / "table.md").read_text()
    assert f"peak lr {ran:.3g}" in note and "95% CI" in note and "peak MiB" in note
    for row in rows.values():
        n = row["val_n"]
        assert n == 1000 and row["top1_lo"] < row["top1"] < row["top1_hi"]
        # the Wilson interval, checked against its normal approximation (close at n = 1000 away from 0 and 100)
        half = 196 * (row["top1"] / 100 * (1 - row["top1"] / 100) / n) ** 0.5
        assert row["top1_hi"] - row["top1_lo"] == pytest.approx(2 * half, rel=0.1)


@pytest.mark.slow
def test_compare_resume_reuses_finished_and_continues_unfinished(tmp_path, capsys):
    out = tmp_path / "cmp"
    run_compare(out, "--no-plots", "--isolation", "subprocess")
    first = {r["model"]: r for r in json.loads((out / "table.json").read_text())["rows"]}
    # cpvt_mini loses its result and its last epoch: it is resumed, deit_mini is reused
    (out / "cpvt_mini" / "result.json").unlink()
    ckpt = torch.load(out / "cpvt_mini" / "last.pt", weights_only=True)
    from vitlab.engine import save_checkpoint

    save_checkpoint(
        {**{k: v for k, v in ckpt.items() if k not in ("format", "version")}, "epoch": 1}, out / "cpvt_mini" / "last.pt"
    )
    capsys.readouterr()
    run_compare(out, "--no-plots", "--resume")
    printed = capsys.readouterr()
    assert "[deit_mini] finished before: reused" in printed.out
    rows = {r["model"]: r for r in json.loads((out / "table.json").read_text())["rows"]}
    assert rows["deit_mini"]["top1"] == first["deit_mini"]["top1"]
    assert rows["cpvt_mini"]["top1"] is not None


def test_compare_resume_finishes_a_trained_run_without_retraining_it(tmp_path, capsys):
    """Killed after the last epoch's checkpoint but before its result.json: --resume reports the trained run
    from its checkpoint (same figures, no epoch trained again) instead of starting it over."""
    out = tmp_path / "cmp"
    argv = ["compare", "--models", "deit_mini", "--epochs", "1", "--train-limit", "32", "--out", str(out)]
    assert cli_main([*argv, "--no-plots"]) == 0
    first = json.loads((out / "table.json").read_text())["rows"][0]
    (out / "deit_mini" / "result.json").unlink()
    capsys.readouterr()
    assert cli_main([*argv, "--no-plots", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "starting over" not in printed and "epoch 1/1" not in printed, printed
    again = json.loads((out / "table.json").read_text())["rows"][0]
    assert again["top1"] == first["top1"] and again["epoch_img_s"] == first["epoch_img_s"]
    assert again["peak_mib"] is None  # the training process is gone: not measured, not the completing one's
    assert not list((out / "deit_mini").glob("*.previous*")) and not list(out.glob("deit_mini.*"))
    for name in ("result.json", "summary.json"):  # stopped before the engine wrote its summary: completed
        (out / "deit_mini" / name).unlink()
    assert cli_main([*argv, "--no-plots", "--resume"]) == 0
    assert "starting over" not in capsys.readouterr().out
    assert json.loads((out / "table.json").read_text())["rows"][0]["top1"] == first["top1"]


def test_compare_user_errors_are_one_line(tmp_path, capsys):
    def error(*argv: str) -> str:
        assert cli_main(["compare", "--out", str(tmp_path), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Traceback" not in err, err
        return err

    assert "unknown model 'deit_mni'" in error("--models", "deit_mini,deit_mni")
    (tmp_path / "run.json").write_text("{}")  # a `vitlab train` run's folder is not compare's
    assert "holds a `vitlab train` run (run.json)" in error("--models", "deit_mini", "--resume")
    (tmp_path / "run.json").unlink()
    assert "does not exist" in error("--data", f"mnist-idx:{tmp_path / 'none'}")
    assert "argument --threads: must be an integer in 1..1024, got '0'" in error("--threads", "0")


def test_compare_seeds_and_image_size(tmp_path, capsys):
    """``--seeds 2``: one run per seed (folders VARIANT/seedS), mean ± std in the table; ``--img-size 32`` resizes
    the 28-px digits, so the mini configs run as registered (patch 4: an 8x8 grid)."""
    out = tmp_path / "cmp"
    argv = ["compare", "--models", "deit_mini", "--epochs", "1", "--train-limit", "48", "--batch-size", "16"]
    assert cli_main([*argv, "--seeds", "2", "--img-size", "32", "--seed", "5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = json.loads((out / "table.json").read_text())
    row = table["rows"][0]
    assert table["meta"]["seeds"] == 2 and table["meta"]["img_size"] == 32
    finals = [json.loads((out / "deit_mini" / f"seed{s}" / "log.json").read_text())[-1]["val_top1"] for s in (5, 6)]
    assert row["top1_seeds"] == finals and row["top1"] == pytest.approx(sum(finals) / 2)
    assert row["top1_std"] == pytest.approx(abs(finals[0] - finals[1]) / 2**0.5)
    assert f"{row['top1']:.2f} ± {row['top1_std']:.2f}" in printed and " ± " in (out / "table.md").read_text()
    with torch.device("meta"):
        model = vitlab.create_model("deit_mini", img_size=32, in_chans=1, num_classes=10)
    assert row["mmacs"] == pytest.approx(count_macs(model, (1, 32, 32)).total / 1e6)  # not adapted to 28 px
    cfg = json.loads((out / "deit_mini" / "seed6" / "result.json").read_text())["config"]
    assert cfg["seed"] == 6 and cfg["img_size"] == 32
    assert cli_main([*argv, "--seeds", "0", "--out", str(tmp_path / "x")]) == 2
    assert "argument --seeds: must be an integer >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize(("percent", "n"), [(95.3, 1000), (100.0, 18), (0.0, 50), (50.0, 7)])
def test_the_accuracy_interval_is_the_wilson_score_interval(percent, n):
    from scipy.stats import binomtest

    from vitlab.experiments.runner import wilson_interval

    k = round(percent * n / 100)
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = wilson_interval(100 * k / n, n)
    assert (lo, hi) == pytest.approx((100 * ci.low, 100 * ci.high), abs=1e-3)
