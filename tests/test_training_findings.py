"""Training runs that must lose nothing and hang nowhere: the last epoch's row and summary after a kill,
and a rank that dies under torchrun."""

from __future__ import annotations

import json

import torch

from vitlab.checkpoint import load_checkpoint
from vitlab.train import TrainConfig, train

TINY = dict(model="deit_mini", model_args={"patch_size": 7, "depth": 1, "embed_dim": 16}, data="mnist",
            train_limit=64, holdout=32, batch_size=32, threads=1, progress=False, device="cpu")  # fmt: skip


def test_a_kill_between_the_last_checkpoint_and_its_log_row_loses_nothing(tmp_path, monkeypatch):
    """Killed right after the final epoch's checkpoint (before log.json, best.pt and the summary): --resume
    completes log.json, best.pt and summary.json from the checkpoint, trains nothing, and a second --resume
    of the finished run is refused as before."""
    import vitlab.train.checkpointing as checkpointing

    out = tmp_path / "r"
    cfg = TrainConfig(**TINY, epochs=2, out=str(out))
    real = checkpointing.write_log

    def die_on_the_last_row(folder, rows):
        if rows and rows[-1]["epoch"] == 2:
            raise KeyboardInterrupt
        real(folder, rows)

    monkeypatch.setattr(checkpointing, "write_log", die_on_the_last_row)
    try:
        train(cfg, lambda line: None)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(checkpointing, "write_log", real)
    assert [r["epoch"] for r in json.loads((out / "log.json").read_text())] == [1]
    assert not (out / "summary.json").exists()
    lines: list[str] = []
    summary = train(TrainConfig(**TINY, epochs=2, out=str(out), resume="auto"), lines.append)
    assert [r["epoch"] for r in json.loads((out / "log.json").read_text())] == [1, 2]
    assert summary["final"]["epoch"] == 2 and (out / "summary.json").is_file()
    assert any("completing the log and summary" in line for line in lines)
    last = load_checkpoint(out / "last.pt")
    assert last["epoch"] == 2 and last["step"] == 4
    best_epoch = max(last["log"], key=lambda r: r["val_top1"])["epoch"]
    assert load_checkpoint(out / "best.pt")["epoch"] == best_epoch
    try:
        train(TrainConfig(**TINY, epochs=2, out=str(out), resume="auto"), lambda line: None)
        raise AssertionError("a finished run was resumed")
    except ValueError as e:
        assert "already trained 2 of 2 epochs" in str(e)
    assert torch.equal(load_checkpoint(out / "last.pt")["model"]["head.weight"], last["model"]["head.weight"])
