"""Run folders defend themselves: one owner at a time, no symlink followed, no log row lost, nothing of an old
run beside a new one, and every write failure or wrong output path one line with the previous file intact."""

from __future__ import annotations

import errno
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import vitlab.common.io
from vitlab.checkpoint import load_checkpoint, save_checkpoint
from vitlab.cli import main as cli_main
from vitlab.common.io import (
    WriteError,
    check_writable_file,
    check_writable_folder,
    remove_temp_files,
    write_csv_atomic,
    write_figure_atomic,
    write_json_atomic,
    write_text_atomic,
)
from vitlab.common.rundir import LOCK_NAME, RunDirError, RunLock
from vitlab.interop.convert import save_weights

REPO = Path(__file__).resolve().parents[1]
# a tiny DeiT: 4x4 grid of 7-px patches, 1 block of width 32, 64 images: about a second per epoch
TINY_RUN = [
    "--model", "deit_mini", "--model-arg", "patch_size=7", "--model-arg", "depth=1", "--model-arg", "embed_dim=32",
    "--train-limit", "64", "--holdout", "100", "--batch-size", "32", "--threads", "1", "--no-progress",
]  # fmt: skip
OLD_RUN = ("last.pt", "best.pt", "log.json", "log.csv", "summary.json", "steps.jsonl", "run.json")  # what a run writes


def train(out: Path, *extra: str) -> int:
    return cli_main(["train", *TINY_RUN, "--epochs", "1", "--out", str(out), *extra])


def lm_train(out: Path, text: Path, *extra: str) -> int:
    args = ["--model", "tiny_aft_simple", "--data", str(text), "--seq-len", "16", "--steps", "2", "--batch-size", "2"]
    return cli_main(["lm", "train", *args, "--eval-every", "2", "--eval-symbols", "32", "--out", str(out), *extra])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def python(code: str, *args: str, **kw) -> subprocess.Popen:
    path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", code, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


# --------------------------------------------------------------------------- one owner per folder


def test_a_second_writer_is_refused_with_the_owner_named(tmp_path, capsys):
    out = tmp_path / "run"
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)
    with RunLock(out, "vitlab train", log=lambda line: None):
        owner = json.loads((out / LOCK_NAME).read_text())
        assert owner["pid"] == os.getpid() and owner["tool"] == "vitlab train"
        for argv in (
            ["train", *TINY_RUN, "--out", str(out)],
            ["train", *TINY_RUN, "--out", str(out), "--resume"],
            ["compare", "--models", "deit_mini", "--out", str(out)],
        ):
            assert cli_main(argv) == 2
            err = one_line_error(capsys)
            assert f"{out} is in use by vitlab train (pid {os.getpid()} on " in err and "since 20" in err, err
        assert lm_train(out, text) == 2
        assert f"in use by vitlab train (pid {os.getpid()}" in one_line_error(capsys)
    assert not out.exists()  # the lock created the folder and removed it, empty, on release


# a `vitlab` command whose synthetic images wait for a gate file (argv[1]) to exist: a writer held mid-write
GATED_SYNTH = """
import sys, time
from pathlib import Path
import vitlab.data.synth as synth
gate, real = Path(sys.argv[1]), synth.synth_image
def gated(*args, **kwargs):
    while not gate.exists():
        time.sleep(0.05)
    return real(*args, **kwargs)
synth.synth_image = gated
from vitlab.cli import main
sys.exit(main(sys.argv[2:]))
"""
SYNTH = ["--classes", "2", "--train-per-class", "3", "--val-per-class", "1", "--size", "40", "30"]


def wait_for_owner(folder: Path, pid: int, proc: subprocess.Popen) -> None:
    """Until ``pid`` has recorded itself in ``folder``'s lock file (or the process has ended: a failure)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads((folder / LOCK_NAME).read_text()).get("pid") == pid:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()  # the process this test started, stuck before its lock
    raise AssertionError(f"the writer never locked {folder} (exit {proc.wait()}): {proc.communicate()[1]}")


def test_a_second_data_writer_is_refused_and_the_first_completes_intact(tmp_path, capsys):
    """Two real processes: `vitlab data synth` holds OUT mid-write; `data synth` and `data shards` into the same
    OUT are refused with one line naming the folder and the holder, and the first writes every image."""
    src, out, gate = tmp_path / "src", tmp_path / "out", tmp_path / "gate"
    assert cli_main(["data", "synth", str(src), *SYNTH]) == 0
    first = python(GATED_SYNTH, str(gate), "data", "synth", str(out), *SYNTH, "--seed", "1")
    try:
        wait_for_owner(out, first.pid, first)
        capsys.readouterr()
        for argv in (["data", "synth", str(out), *SYNTH], ["data", "shards", f"folder:{src}", str(out)]):
            assert cli_main(argv) == 2
            err = one_line_error(capsys)
            assert f"{out} is in use by vitlab data synth (pid {first.pid} on " in err, err
        gate.touch()
        stdout, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr
    assert "wrote 8 JPEGs" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["train", "val"]  # no shard, no lock left
    assert len(list(out.rglob("*.JPEG"))) == 8


def test_shards_and_analyze_hold_their_output_folder(tmp_path, capsys):
    """`vitlab data shards` and `vitlab analyze` refuse a folder another command holds (nothing written into it);
    free, `data shards` takes SRC as `vitlab train --data` does (folder:PATH) or as a path, and refuses other
    data in one line."""
    src, out = tmp_path / "src", tmp_path / "out"
    assert cli_main(["data", "synth", str(src), *SYNTH]) == 0
    analyze = ["analyze", "deit_mini", "--img-size", "28", "--in-chans", "1", "--num-classes", "10", "--num-images",
               "1", "--what", "evolution", "--out", str(out)]  # fmt: skip
    with RunLock(out, "vitlab train", log=lambda line: None):
        capsys.readouterr()
        for argv in (["data", "shards", f"folder:{src}", str(out)], analyze):
            assert cli_main(argv) == 2
            err = one_line_error(capsys)
            assert f"{out} is in use by vitlab train (pid {os.getpid()} on " in err, err
        assert [p.name for p in out.iterdir()] == [LOCK_NAME]
    for spec, force in ((f"folder:{src}", []), (str(src), ["--force"])):
        assert cli_main(["data", "shards", spec, str(out), "--shard-size", "4", *force]) == 0
        assert json.loads((out / "shards.json").read_text())["splits"]["train"]["counts"] == [4, 2]
    assert not (out / LOCK_NAME).exists()
    # one after the other: the second writer's shards never mix with the first's (a smaller shard size would
    # leave the first's extra shards beside a manifest that does not list them)
    (replaced,) = out.glob(".replaced-*")
    assert sorted(p.name for p in replaced.iterdir()) == ["shards.json", "train-000000.tar", "train-000001.tar",
                                                          "val-000000.tar"]  # fmt: skip
    capsys.readouterr()
    assert cli_main(["data", "shards", str(src), str(out), "--shard-size", "2"]) == 2
    assert "already holds shards.json, train-000000.tar, train-000001.tar and 1 more; pass --force" in (
        one_line_error(capsys)
    )
    assert cli_main(["data", "synth", str(src), *SYNTH]) == 2
    assert "already holds train, val; pass --force" in one_line_error(capsys)
    for spec, words in (("mnist", "is mnist data"), (f"wds:{out}", "is wds data"), ("folder:", "needs a path")):
        assert cli_main(["data", "shards", spec, str(tmp_path / "other")]) == 2
        assert words in one_line_error(capsys)
    assert not (tmp_path / "other").exists()


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path):
    out = tmp_path / "run"
    holder = python(
        "import sys, time\nfrom vitlab.common.rundir import RunLock\n"
        "lock = RunLock(sys.argv[1], 'vitlab train')\nprint('locked', flush=True)\ntime.sleep(120)",
        str(out),
    )
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        with pytest.raises(RunDirError, match=rf"in use by vitlab train \(pid {holder.pid} on .*\) since"):
            RunLock(out, "vitlab compare")
        holder.send_signal(signal.SIGKILL)  # the process this test started
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.kill()
    notes: list[str] = []
    with RunLock(out, "vitlab train", log=notes.append) as lock:
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert lock.fd is not None
    assert any(f"pid {holder.pid}" in n and "taken over" in n for n in notes), notes
    assert not (out / LOCK_NAME).exists()


# --------------------------------------------------------------------------- no symlink is ever followed


def plant(folder: Path, names: list[str], candidates: list[str], victim: Path) -> list[Path]:
    """Symlinks to ``victim`` at every temporary name a write of ``names`` could use: the fixed names of old
    versions and the first names ``mkstemp`` will try (patched to ``candidates``)."""
    links = []
    for name in names:
        for tmp in [f".{name}.tmp", *(f".{name}.{c}.tmp" for c in candidates)]:
            (folder / tmp).symlink_to(victim)
            links.append(folder / tmp)
    return links


def test_symlinks_at_every_temporary_name_cannot_redirect_a_write(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    candidates = ["aaaaaaaa", "bbbbbbbb", "cccccccc"]
    monkeypatch.setattr(
        tempfile, "_get_candidate_names", lambda: itertools.chain(candidates, tempfile._RandomNameSequence())
    )
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    names = ["log.json", "log.csv", "summary.json", "last.pt", "w.safetensors", "n.txt", "c.png"]
    links = plant(out, names, candidates, victim)
    fig = plt.figure()
    write_json_atomic(out / "log.json", [{"epoch": 1}])
    write_csv_atomic(out / "log.csv", [{"epoch": 1}])
    write_json_atomic(out / "summary.json", {})
    save_checkpoint({"a": torch.zeros(3)}, out / "last.pt")
    save_weights({"a": torch.zeros(3)}, out / "w.safetensors")
    write_text_atomic(out / "n.txt", "new")
    write_figure_atomic(fig, out / "c.png")
    plt.close(fig)
    assert victim.read_text() == "precious"
    assert all(link.is_symlink() for link in links)
    assert all((out / n).is_file() and not (out / n).is_symlink() for n in names)


def test_a_run_removes_leftover_temporary_files_and_never_writes_through_links(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    links = plant(out, list(OLD_RUN), ["k1ll3d_x"], victim)  # what a killed writer leaves (here: links)
    (out / ".last.pt.zzzzzzzz.tmp").write_bytes(b"half a checkpoint")
    past = time.time() - 60
    for p in [*links, out / ".last.pt.zzzzzzzz.tmp"]:
        os.utime(p, (past, past), follow_symlinks=False)
    assert train(out) == 0
    assert f"removed {len(OLD_RUN) + 1} temporary file(s)" in capsys.readouterr().out
    assert victim.read_text() == "precious"
    left = sorted(p.name for p in out.iterdir())
    assert left == sorted([*OLD_RUN, *(f".{n}.tmp" for n in OLD_RUN)])  # old fixed names: not ours to remove
    assert json.loads((out / "log.json").read_text())[0]["epoch"] == 1


# --------------------------------------------------------------------------- no log row lost, no old file left


def test_a_kill_between_checkpoint_and_log_write_loses_no_row(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out) == 0
    row = json.loads((out / "log.json").read_text())[0]
    # as if killed after last.pt's rename, before the log files were rewritten: the epoch's row is missing
    write_json_atomic(out / "log.json", [])
    (out / "log.csv").write_text("epoch\n")
    capsys.readouterr()
    assert cli_main(["train", *TINY_RUN, "--epochs", "2", "--out", str(out), "--resume"]) == 0
    assert "lacked rows the checkpoint carries (0 of 1); restored" in capsys.readouterr().out
    log = json.loads((out / "log.json").read_text())
    assert [r["epoch"] for r in log] == [1, 2] and log[0] == row
    assert (out / "log.csv").read_text().count("\n") == 3
    assert [r["epoch"] for r in load_checkpoint(out)["log"]] == [1, 2]


def test_force_moves_the_old_run_aside_even_if_the_new_run_crashes(tmp_path, monkeypatch, capsys):
    from vitlab.engine import loop as engine

    out = tmp_path / "run"
    assert train(out) == 0
    old = {n: (out / n).read_bytes() for n in OLD_RUN}
    assert train(out, "--model", "deit_mni", "--force") == 2  # a mistake found before any work: the old run stays put
    assert all((out / n).read_bytes() == old[n] for n in OLD_RUN)

    def crash(run, epoch):
        raise engine.TrainingError("the machine fell over")

    monkeypatch.setattr(engine, "train_epoch", crash)
    capsys.readouterr()
    assert train(out, "--force") == 2
    printed = capsys.readouterr().out
    (aside,) = out.glob(".replaced-*")
    assert f"starting over: moved the previous run's {', '.join(OLD_RUN)} to {aside}" in printed
    assert sorted(p.name for p in out.iterdir()) == [aside.name]  # nothing of the old run beside the new one
    assert {n: (aside / n).read_bytes() for n in OLD_RUN} == old


def killed_at(where: str, out: Path, *extra: str) -> None:
    """``vitlab train`` into ``out``, SIGKILLed by itself when it reaches ``where`` (``module.function`` in
    ``vitlab.engine``; a real kill: no handler, no finally, no lock release)."""
    module, name = where.split(".")
    proc = python(
        f"import os, signal, sys\nfrom vitlab.engine import {module}\n"
        f"assert hasattr({module}, {name!r}), 'nothing to patch'\n"
        f"setattr({module}, {name!r}, lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))\n"
        "from vitlab.cli import main\nsys.exit(main(sys.argv[1:]))",
        *["train", *TINY_RUN, "--out", str(out), *extra],
    )
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, stderr


@pytest.mark.slow
def test_sigkill_between_checkpoint_and_log_then_resume_loses_no_row(tmp_path, capsys):
    out = tmp_path / "run"
    killed_at("checkpointing.write_log", out, "--epochs", "1")  # last.pt renamed into place, the log never written
    assert (out / "last.pt").exists() and not (out / "log.json").exists()
    assert cli_main(["train", *TINY_RUN, "--epochs", "2", "--out", str(out), "--resume"]) == 0
    assert "lacked rows the checkpoint carries (0 of 1); restored" in capsys.readouterr().out
    assert [r["epoch"] for r in json.loads((out / "log.json").read_text())] == [1, 2]


@pytest.mark.slow
def test_force_then_sigkill_leaves_nothing_of_the_old_run_beside_the_new(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out) == 0
    old = {n: (out / n).read_bytes() for n in OLD_RUN}
    killed_at("loop.train_epoch", out, "--epochs", "1", "--force")  # the old run moved aside, then the kill
    (aside,) = out.glob(".replaced-*")
    assert {n: (aside / n).read_bytes() for n in OLD_RUN} == old
    assert not [n for n in OLD_RUN if (out / n).exists()]
    assert train(out) == 0  # the killed run's lock is taken over; the folder holds no run, so no flag is needed
    assert "taken over" in capsys.readouterr().out


def test_lm_train_refuses_an_existing_run_unless_resumed_or_forced(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)
    out = tmp_path / "lm"
    assert lm_train(out, text) == 0
    metrics = (out / "metrics.json").read_bytes()
    assert lm_train(out, text) == 2
    assert f"{out} already holds a run (last.pt, metrics.json, steps.jsonl); pass --resume" in one_line_error(capsys)
    assert (out / "metrics.json").read_bytes() == metrics
    for argv in (["eval", str(out), "--json", str(tmp_path)], ["sample", str(out / "last.pt"), "--out", str(out)]):
        assert cli_main(["lm", *argv]) == 2
        assert "is a folder; give a file name" in one_line_error(capsys)
    assert lm_train(out, text, "--force") == 0
    (aside,) = out.glob(".replaced-*")
    assert (aside / "metrics.json").read_bytes() == metrics and (out / "metrics.json").exists()


def test_compare_refuses_an_earlier_comparison_and_a_mistake_moves_nothing(tmp_path, capsys):
    out = tmp_path / "cmp"
    (out / "deit_mini").mkdir(parents=True)
    (out / "deit_mini" / "result.json").write_text("{}")
    (out / "table.json").write_text("{}")
    assert cli_main(["compare", "--models", "deit_mini", "--out", str(out)]) == 2
    assert "already holds a run (table.json, deit_mini); pass --resume" in one_line_error(capsys)
    assert cli_main(["compare", "--models", "deit_mni", "--out", str(out), "--force"]) == 2
    assert "unknown model" in one_line_error(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["deit_mini", "table.json"]


# --------------------------------------------------------------------------- preflight and write failures


def test_wrong_output_paths_are_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert train(a_file) == 2
    assert "--out" in one_line_error(capsys) and a_file.read_text() == "x"
    assert train(a_file / "sub") == 2
    assert "is a file, so no folder can be created there" in one_line_error(capsys)
    ckpt = tmp_path / "c.pt"
    save_checkpoint({"format": "x"}, ckpt)
    for argv in (["eval", str(ckpt), "--json", str(tmp_path)], ["export", "deit_mini", "--out", str(tmp_path)]):
        assert cli_main(argv) == 2
        assert f"{tmp_path} is a folder; give a file name" in one_line_error(capsys)
    with pytest.raises(WriteError, match="is a folder"):
        check_writable_file(tmp_path)
    monkeypatch.setattr(vitlab.common.io.os, "access", lambda *a, **k: False)  # what a read-only or foreign folder says
    with pytest.raises(WriteError, match="cannot write in"):
        check_writable_folder(tmp_path / "new")


def test_too_little_space_for_a_checkpoint_is_one_line_before_training(tmp_path, monkeypatch, capsys):
    import shutil

    from vitlab.common import rundir

    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 2**20))
    assert train(tmp_path / "run") == 2
    assert "has 1 MiB free, one checkpoint needs about" in one_line_error(capsys)
    assert not (tmp_path / "run").exists()


def test_a_failed_write_is_one_line_and_the_previous_file_is_intact(tmp_path, monkeypatch):
    path = write_text_atomic(tmp_path / "a.txt", "old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(vitlab.common.io.os, "fsync", full)
    with pytest.raises(WriteError, match=r"could not write .*a.txt: no space left .*ENOSPC.*previous a.txt is intact"):
        write_text_atomic(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]


def test_a_file_size_limit_during_a_checkpoint_write_is_one_line(tmp_path):
    out = tmp_path / "run"
    assert train(out) == 0
    before = (out / "last.pt").read_bytes()
    limit = len(before) // 2
    proc = python(
        "import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
        "from vitlab.cli import main\nsys.exit(main(sys.argv[1:]))",
        *["train", *TINY_RUN, "--epochs", "2", "--out", str(out), "--resume"],
    )
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 2, stderr
    err = stderr.strip()
    assert err.count("\n") == 0, err
    assert f"could not write {out / 'last.pt'}: the file-size limit was reached (EFBIG)" in err
    assert "the previous last.pt is intact" in err
    assert (out / "last.pt").read_bytes() == before
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_only_old_files_of_the_temporary_pattern_are_removed(tmp_path):
    names = [".last.pt.ab12cd34.tmp", ".log.json.k_9zzzzz.tmp", "keep.tmp", ".x.short.tmp", "last.pt"]
    for n in names:
        (tmp_path / n).write_text("x")
    (tmp_path / ".dir.abcdefgh.tmp").mkdir()
    removed = remove_temp_files(tmp_path, before=time.time() + 10)
    assert sorted(p.name for p in removed) == [".last.pt.ab12cd34.tmp", ".log.json.k_9zzzzz.tmp"]
    (tmp_path / ".new.abcdefgh.tmp").write_text("being written")
    assert remove_temp_files(tmp_path, before=time.time() - 10) == []
