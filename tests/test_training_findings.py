"""Training runs that must lose nothing and hang nowhere: the last epoch's row and summary after a kill,
and a rank that dies under torchrun."""

from __future__ import annotations

import contextlib
import json

import torch

from vitlab.checkpoint import load_checkpoint
from vitlab.engine import TrainConfig, train

TINY = dict(model="deit_mini", model_args={"patch_size": 7, "depth": 1, "embed_dim": 16}, data="mnist",
            train_limit=64, holdout=32, batch_size=32, threads=1, progress=False, device="cpu")  # fmt: skip


def test_a_kill_between_the_last_checkpoint_and_its_log_row_loses_nothing(tmp_path, monkeypatch):
    """Killed right after the final epoch's checkpoint (before log.json, best.pt and the summary): --resume
    completes log.json, best.pt and summary.json from the checkpoint, trains nothing, and a second --resume
    of the finished run is refused as before."""
    import vitlab.engine.checkpointing as checkpointing

    out = tmp_path / "r"
    cfg = TrainConfig(**TINY, epochs=2, out=str(out))
    real = checkpointing.write_log

    def die_on_the_last_row(folder, rows):
        if rows and rows[-1]["epoch"] == 2:
            raise KeyboardInterrupt
        real(folder, rows)

    monkeypatch.setattr(checkpointing, "write_log", die_on_the_last_row)
    with contextlib.suppress(KeyboardInterrupt):
        train(cfg, lambda line: None)
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


def _hung_peer(rank: int, port: int, out: str) -> None:
    import os
    import time

    import torch.distributed as dist

    from vitlab.common.distributed import init_distributed, peer_failure

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      VITLAB_DIST_TIMEOUT="3")  # fmt: skip
    init_distributed(torch.device("cpu"))
    if rank == 1:  # stops answering (a hung or dead rank), then leaves
        time.sleep(6)
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(1))
        message = "no error"
    except RuntimeError as e:
        message = peer_failure(e) or f"unrecognised: {e}"
    with open(out, "w") as f:
        f.write(message)
    os._exit(0)


def test_a_rank_that_stops_answering_ends_the_others_with_one_line(tmp_path, monkeypatch):
    """Two gloo processes with VITLAB_DIST_TIMEOUT=3: rank 1 stops answering, rank 0's collective gives up
    (instead of waiting forever) and the error reads as one line naming the timeout."""
    import socket

    import pytest

    from vitlab.common.distributed import collective_timeout

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "message"
    torch.multiprocessing.spawn(_hung_peer, args=(port, str(out)), nprocs=2, join=True)
    message = out.read_text()
    assert message.startswith("another process of this run stopped") and "\n" not in message, message
    assert "VITLAB_DIST_TIMEOUT (3 s)" in message
    assert "Timed out" in message  # the timeout ended the wait (rank 1 was still alive)
    monkeypatch.setenv("VITLAB_DIST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VITLAB_DIST_TIMEOUT"):
        collective_timeout()


def test_friction_options_print_config_threads_crop_pct_and_folder_subsets(tmp_path, capsys, monkeypatch):
    """--print-config prints the resolved recipe and flags and trains nothing; threads default to 1 when the
    workers leave no spare core; `vitlab eval --crop-pct` sets the crop of streaming data; --train-limit takes a
    seeded random subset of a folder (shards refuse it in one line)."""
    import types

    import numpy as np
    from PIL import Image

    import vitlab
    from vitlab.cli import main as cli_main
    from vitlab.data import open_source
    from vitlab.engine.data import open_data
    from vitlab.engine.evaluate import _eval_transform

    out = tmp_path / "printed"
    assert cli_main(["train", "--config", "deit_tiny", "--lr", "0.01", "--print-config", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"] == "deit_tiny_patch16_224" and printed["lr"] == 0.01 and printed["base_lr"] is None
    assert printed["epochs"] == 300 and not out.exists()
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert TrainConfig(workers=2).auto_threads == 1 and TrainConfig().auto_threads == 2
    assert TrainConfig(workers=2, threads=3).auto_threads == 3
    for c in ("a", "b"):
        (tmp_path / "f" / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(np.full((12, 12, 3), 20 * i, np.uint8)).save(tmp_path / "f" / c / f"{i}.png")
    folder = open_source(f"folder:{tmp_path / 'f'}", "all")
    model = vitlab.create_model("deit_mini", img_size=16, patch_size=8, depth=1, embed_dim=16, num_classes=2)
    tf = _eval_transform(model, {"trained": False}, folder, 16, crop_pct=0.5)
    assert tf.crop.crop_pct == 0.5 and _eval_transform(model, {"trained": False}, folder, 16).crop.crop_pct != 0.5
    run = types.SimpleNamespace(cfg=TrainConfig(data=f"folder:{tmp_path / 'f'}", train_limit=5, batch_size=2),
                                world=types.SimpleNamespace(size=1))  # fmt: skip
    open_data(run)
    assert len(run.train_ds) == 5 and run.train_ds.num_classes == 2
    assert {str(run.train_ds.path(i)) for i in range(5)} < {str(folder.path(i)) for i in range(12)}


def test_a_saved_config_with_a_huge_depth_is_one_line(tmp_path, capsys):
    """A checkpoint whose recorded constructor options ask for 10^9 blocks: `vitlab eval` refuses in one line
    instead of building it (which ran until killed)."""
    import vitlab
    from vitlab.checkpoint import save_checkpoint
    from vitlab.cli import main as cli_main

    kw = dict(img_size=28, in_chans=1, num_classes=10, patch_size=7, depth=1, embed_dim=16)
    model = vitlab.create_model("deit_mini", **kw)
    save_checkpoint({"model_name": "deit_mini", "model_kwargs": {**kw, "depth": 10**9}, "model": model.state_dict(),
                     "epoch": 1, "config": {"data": "mnist"}}, tmp_path / "huge.pt")  # fmt: skip
    capsys.readouterr()
    assert cli_main(["eval", str(tmp_path / "huge.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "depth=1000000000 is more than 1024 blocks" in err
