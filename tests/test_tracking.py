"""What a run reports while it runs (vitlab.engine.tracking) and writes beside its checkpoints: steps.jsonl,
TensorBoard, progress lines with ETAs when the output is not a terminal, the best checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from vitlab.checkpoint import load_checkpoint
from vitlab.cli import main as cli_main
from vitlab.engine.tracking import Progress, StepLog, fmt_eta

TINY_RUN = [
    "--model", "deit_mini", "--model-arg", "patch_size=7", "--model-arg", "depth=1", "--model-arg", "embed_dim=32",
    "--train-limit", "64", "--holdout", "100", "--batch-size", "16", "--threads", "1",
]  # fmt: skip


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_step_log_writes_every_n_steps_and_resumes_after_its_checkpoint(tmp_path):
    log = StepLog(tmp_path, every=3, memory=lambda: 12.5)
    for step in range(1, 6):
        values = torch.tensor([0.5 * step, 2.0 * step])  # stays on the device until the flush
        log.add(step, 8, {"_names": ("loss", "grad_norm"), "lr": 0.1}, values)
        if step == 2:
            assert not (tmp_path / "steps.jsonl").exists()  # nothing written before the first flush
    assert len(rows_of(tmp_path / "steps.jsonl")) == 3
    log.close()
    rows = rows_of(tmp_path / "steps.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[4] == {**rows[4], "loss": 2.5, "grad_norm": 10.0, "lr": 0.1, "mem_mib": 12.5}
    assert all(r["img_s"] > 0 for r in rows)
    # a run killed after step 5 that resumes from its step-3 checkpoint; the killed writer left half a line
    with open(tmp_path / "steps.jsonl", "a") as f:
        f.write('{"step": 6, "lo')
    assert StepLog(tmp_path).trim(3) == 3
    assert [r["step"] for r in rows_of(tmp_path / "steps.jsonl")] == [1, 2, 3]
    assert StepLog(None).trim(3) == 0  # the other ranks write nothing


def test_tensorboard_writes_event_files_or_names_the_missing_extra(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    log = StepLog(tmp_path, every=1, tensorboard=True)
    log.add(1, 4, {"_names": ("loss",)}, torch.tensor([1.0]))
    log.scalars(1, {"top1": 50.0})
    log.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were not installed
    with pytest.raises(
        ValueError, match=r"--tensorboard needs the tensorboard package: pip install 'vitlab\[tensorboard\]'"
    ):
        StepLog(tmp_path, tensorboard=True)


def test_progress_prints_lines_with_etas_when_not_on_a_terminal():
    lines: list[str] = []
    p = Progress(total=20, done=10, log=lines.append, every_s=0.0, terminal=False)
    p.start("epoch 2/2", 10)
    for i in range(10):
        p.update(4, f"loss {i}" if p.wants_status() else None)
    assert len(lines) == 10
    assert lines[-1].startswith("epoch 2/2 step 10/10  loss 9  ") and "ETA 0:00 (run 0:00)" in lines[-1]
    assert "ETA" in lines[0] and "img/s" in lines[0]
    quiet: list[str] = []
    off = Progress(total=5, done=0, log=quiet.append, enabled=False, terminal=False)
    off.start("x", 5)
    off.update(1, "loss")
    assert not quiet and not off.wants_status()
    assert (fmt_eta(59.6), fmt_eta(3725)) == ("1:00", "1:02:05")


def test_a_run_writes_steps_best_checkpoint_and_progress_lines(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", *TINY_RUN, "--epochs", "2", "--log-every", "3", "--progress-every", "0", "--out", str(out)]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out  # captured: not a terminal, so plain lines
    assert "epoch 1/2 step 1/4" in printed and "ETA" in printed
    rows = rows_of(out / "steps.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9)) and {r["epoch"] for r in rows} == {1, 2}
    assert all({"loss", "lr", "grad_norm", "img_s", "mem_mib"} <= r.keys() for r in rows)
    log = json.loads((out / "log.json").read_text())
    best = max(log, key=lambda r: r["val_top1"])
    assert load_checkpoint(out / "best.pt")["epoch"] == best["epoch"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["epoch"] == best["epoch"] and summary["best"]["val_top1"] == best["val_top1"]
    # resuming drops nothing it keeps and adds the new steps once
    assert cli_main([*args, "--epochs", "3", "--resume", "--no-progress"]) == 0
    assert [r["step"] for r in rows_of(out / "steps.jsonl")] == list(range(1, 13))
