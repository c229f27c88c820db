"""WebDataset epochs are exact: every sample once per epoch over ranks and DataLoader workers (uneven shards,
a shuffle buffer that never carries a sample into the next epoch), resumable; held-out shards named apart from
the training ones. Each sample's ``.cls`` is its own number, so the labels a loader hands out are the keys."""

from __future__ import annotations

import dataclasses
import io
import os
import socket
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data import create_loader, create_transform, open_source

pytest.importorskip("webdataset")

COUNTS = (7, 3, 11, 5, 9, 1, 4)  # uneven shards, 40 samples


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value % 256, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def write_numbered_shards(root: Path, counts=COUNTS, prefix: str = "train", bad: frozenset = frozenset()) -> str:
    """Shards ``prefix-NNN.tar`` of ``counts`` samples whose class is their number (those in ``bad`` with bytes
    that are no image); their brace pattern."""
    root.mkdir(parents=True, exist_ok=True)
    number = 0
    for s, count in enumerate(counts):
        with tarfile.open(root / f"{prefix}-{s:03d}.tar", "w") as tar:
            for _ in range(count):
                image = b"not an image" if number in bad else _png(number)
                for ext, data in (("png", image), ("cls", str(number).encode())):
                    info = tarfile.TarInfo(f"k{number:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                number += 1
    return str(root / f"{prefix}-{{000..{len(counts) - 1:03d}}}.tar")


def epoch_labels(source, rank: int, world: int, epoch: int, **kw) -> list[int]:
    loader = create_loader(source, create_transform(8, True), 3, is_training=True, workers=2, seed=1, rank=rank,
                           world_size=world, **kw)  # fmt: skip
    loader.set_epoch(epoch)
    return [int(v) for _, y in loader for v in y]


def _rank_main(rank: int, world: int, port: int, pattern: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        source = open_source(f"wds:{pattern}", "train")
        seen = [epoch_labels(source, rank, world, epoch, shuffle_buffer=5) for epoch in (0, 1)]
        gathered = [None] * world
        dist.all_gather_object(gathered, seen)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes with two workers each: ~45 s on the 2-core test machine
def test_one_epoch_over_two_ranks_and_two_workers_shows_every_sample_once(tmp_path):
    """2 ranks (gloo) x 2 DataLoader workers, 7 shards of 1 to 11 samples, a 5-sample shuffle buffer: each epoch
    hands out each of the 40 keys exactly once, 20 per rank, in an order that changes with the epoch."""
    pattern = write_numbered_shards(tmp_path / "shards")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "seen.pt"
    torch.multiprocessing.spawn(_rank_main, args=(2, port, pattern, str(out)), nprocs=2, join=True)
    gathered = torch.load(out)  # [rank][epoch] -> labels
    for epoch in (0, 1):
        keys = [k for rank in gathered for k in rank[epoch]]
        assert Counter(keys) == Counter(range(40)), epoch
        assert [len(rank[epoch]) for rank in gathered] == [20, 20]
    assert gathered[0][0] != gathered[0][1]


def test_exact_epochs_in_process_with_an_uneven_split_and_resume(tmp_path):
    """One process playing 3 ranks: 40 samples give each rank 13 (the 40th waits for a later epoch, a different
    one each epoch), never one twice; evaluation reads all 40 once over the ranks (13/13/14); a rank stopped after
    two batches and resumed hands out exactly the rest; the buffer size is an option (0: off)."""
    source = open_source(f"wds:{write_numbered_shards(tmp_path / 'shards')}", "train")
    left_out = []
    for epoch in (0, 1):
        keys = [k for r in range(3) for k in epoch_labels(source, r, 3, epoch, shuffle_buffer=4)]
        assert len(keys) == 39 and len(set(keys)) == 39
        left_out.append(set(range(40)) - set(keys))
    assert left_out[0] != left_out[1]
    tf = create_transform(8)
    evals = [[int(v) for _, y in create_loader(source, tf, 4, is_training=False, workers=2, rank=r, world_size=3)
              for v in y] for r in range(3)]  # fmt: skip
    assert sorted(k for e in evals for k in e) == list(range(40)) and [len(e) for e in evals] == [13, 13, 14]
    kw = dict(is_training=True, workers=2, seed=1, rank=1, world_size=3, shuffle_buffer=4)
    whole = epoch_labels(source, 1, 3, 0, shuffle_buffer=4)
    first = create_loader(source, create_transform(8, True), 3, **kw)
    taken = [int(v) for _, (_, y) in zip(range(2), first) for v in y]
    resumed = create_loader(source, create_transform(8, True), 3, **kw)
    resumed.load_state_dict(first.state_dict())
    assert taken + [int(v) for _, y in resumed for v in y] == whole
    plain = epoch_labels(source, 0, 1, 0, shuffle_buffer=0)
    assert sorted(plain) == list(range(40)) and plain != epoch_labels(source, 0, 1, 0, shuffle_buffer=16)
    with pytest.raises(ValueError, match="shuffle buffer"):
        create_loader(source, create_transform(8, True), 3, is_training=True, shuffle_buffer=-1)


def test_a_pattern_is_never_its_own_held_out_set(tmp_path, capsys):
    """A single brace pattern names training shards: asking it for held-out data (training, `data info --split
    val`) is one line naming the fix; ``wds:train=...,val=...`` reads each split from its own shards (a brace
    pattern's commas included); plain shards take their class count from --num-classes."""
    from vitlab.cli import main
    from vitlab.data.wds import split_patterns

    train = write_numbered_shards(tmp_path / "s", (4, 4))
    val = write_numbered_shards(tmp_path / "s", (3,), prefix="val")
    with pytest.raises(ValueError, match=r"not held-out data.*wds:train=PATTERN,val=PATTERN"):
        open_source(f"wds:{train}", "val")
    assert main(["data", "info", f"wds:{train}", "--split", "val"]) != 0
    assert "not held-out data" in capsys.readouterr().err
    both = f"wds:train={tmp_path}/s/train-{{000,001}}.tar,val={val}"
    assert split_patterns(both.split(":", 1)[1]) == {"train": f"{tmp_path}/s/train-{{000,001}}.tar", "val": val}
    assert len(open_source(both, "train")) == 8 and len(open_source(both, "val")) == 3
    with pytest.raises(ValueError, match="names no 'val' shards"):
        open_source(f"wds:train={train}", "val")
    with pytest.raises(ValueError, match="each split once"):
        open_source(f"wds:train={train},train={val}", "train")
    plain = open_source(both, "train")
    with pytest.raises(ValueError, match="--num-classes"):
        _ = plain.num_classes
    assert plain.with_num_classes(8).num_classes == 8
    with pytest.raises(ValueError, match=r"class 2 is outside the 2 classes") as e:  # the held-out labels: 0, 1, 2
        list(create_loader(open_source(both, "val").with_num_classes(2), create_transform(8), 4, is_training=False,
                           workers=1))  # fmt: skip
    assert "\n" not in str(e.value)
    assert main(["data", "info", both, "--split", "val"]) == 0
    assert '"images": 3' in capsys.readouterr().out


def test_training_on_plain_shards_evaluates_on_the_named_held_out_shards(tmp_path):
    """`vitlab train --data wds:train=...,val=... --num-classes N` trains on one set and reports the other's size."""
    from vitlab.engine import TrainConfig, train

    train_p = write_numbered_shards(tmp_path / "s", (6, 6))
    val_p = write_numbered_shards(tmp_path / "s", (5,), prefix="val")
    cfg = TrainConfig(model="deit_mini", model_args={"patch_size": 8, "depth": 1, "embed_dim": 16}, img_size=16,
                      data=f"wds:train={train_p},val={val_p}", num_classes=12, out=str(tmp_path / "r"), epochs=1,
                      batch_size=4, threads=1, progress=False, shuffle_buffer=3)  # fmt: skip
    summary = train(cfg, lambda line: None)
    assert summary["log"][-1]["val_n"] == 5 and summary["log"][-1]["val_skipped"] == 0
    with pytest.raises(ValueError, match="--num-classes"):
        train(dataclasses.replace(cfg, num_classes=None, out=str(tmp_path / "r2")), lambda line: None)


def test_unreadable_samples_are_dropped_counted_and_a_wholly_unreadable_training_batch_stops(tmp_path):
    """Evaluation drops and counts unreadable samples (never a substitute); a training batch with no readable
    image stops the run in one line (a rank skipping a step would leave the other ranks waiting)."""
    source = open_source(f"wds:{write_numbered_shards(tmp_path / 's', (6,), bad=frozenset({0, 1, 2}))}", "train")
    loader = create_loader(source, create_transform(8), 2, is_training=False, max_bad_fraction=1.0)
    with pytest.warns(UserWarning, match="unreadable image skipped"):
        assert sorted(int(v) for _, y in loader for v in y) == [3, 4, 5]
    assert len(loader.bad_files) == 3
    train = create_loader(source, create_transform(8, True), 3, is_training=True, shuffle_buffer=0,
                          max_bad_fraction=1.0)  # fmt: skip
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no image of a training batch") as e:
        list(train)
    assert "\n" not in str(e.value)
