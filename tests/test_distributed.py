"""Training across processes on the CPU (gloo), as CI runs it: DDP on two "nodes" of localhost (two torchrun
launches meeting at a rendezvous endpoint), FSDP2 against one process, sharded checkpoints resumed on another
number of processes, ``vitlab lm train`` under DDP with gradient accumulation; and the safe reading of
sharded checkpoints (:mod:`vitlab.common.distributed`).

Why the runs agree: without augmentation, dropout and stochastic depth, every process count sees the same
samples in the same global batches (rank r takes every r-th sample of the global order), and DDP / FSDP
average the ranks' half-batch mean gradients, i.e. the full-batch mean: only the order of float32 sums
differs. After 8 AdamW steps at lr 1e-3 that is ~1e-6 per weight (measured 2.2e-6 for DDP); 2e-5 leaves ten
times that, while every weight moves more than 1e-3 from its initial value (a different run fails by far).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitlab
from vitlab.checkpoint import load_checkpoint, save_checkpoint
from vitlab.checkpoint.sharded import ShardError, read_sharded_weights, save_sharded
from vitlab.common.distributed import World, blocks_of
from vitlab.engine.optim import create_optimizer

# a tiny DeiT (4x4 grid of 7-px patches, 1 block of width 32) on 128 digits: 4 steps of 32 per epoch
TINY_RUN = [
    "--model", "deit_mini", "--model-arg", "patch_size=7", "--model-arg", "depth=1", "--model-arg", "embed_dim=32",
    "--train-limit", "128", "--holdout", "200", "--batch-size", "32", "--threads", "1", "--no-progress",
    "--drop-path", "0", "--crop-padding", "0", "--device", "cpu",
]  # fmt: skip
TOLERANCE = 2e-5
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def vitlab_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "vitlab.cli", *args]


def torchrun(nproc: int, *args: str, nnodes: int = 1, node_rank: int = 0, endpoint: str | None = None) -> list[str]:
    """``torchrun`` starting ``vitlab ARGS`` in ``nproc`` processes (of ``nnodes`` launches meeting at
    ``endpoint``; one launch alone is ``--standalone``)."""
    launch = ["--standalone"] if endpoint is None else ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    launch += [] if endpoint is None else ["--rdzv-endpoint", endpoint]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launch,
        f"--nproc-per-node={nproc}",
        "-m",
        "vitlab.cli",
        *args,
    ]


def run_all(*commands: list[str], timeout: float = 300) -> list[str]:
    """Run the commands side by side; their outputs (each must succeed)."""
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV) for c in commands
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights(out: Path) -> dict[str, torch.Tensor]:
    """The final weights of a run (a sharded run's gathered from its shards)."""
    return load_checkpoint(out / "last.pt")["model"]


def assert_same_run(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = TOLERANCE) -> None:
    assert a.keys() == b.keys()
    diffs = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a}
    assert max(diffs.values()) < tol, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    """The reference: one process, 2 epochs of the global batch 32 (8 steps)."""
    out = tmp_path_factory.mktemp("single") / "run"
    run_all(vitlab_cmd("train", *TINY_RUN, "--epochs", "2", "--out", str(out)))
    ckpt = load_checkpoint(out / "last.pt")
    torch.manual_seed(0)
    init = vitlab.create_model("deit_mini", **ckpt["model_kwargs"]).state_dict()
    assert ckpt["step"] == 8 and min((ckpt["model"][k] - init[k]).abs().max().item() for k in init) > 1e-3
    return out


# --------------------------------------------------------------------------- across launches and shards


def test_two_nodes_on_localhost_match_one_process(single_run, tmp_path):
    """Two torchrun launches (--nnodes 2, one process each) meeting at 127.0.0.1: the multi-node path."""
    out, endpoint = tmp_path / "nodes", f"127.0.0.1:{free_port()}"
    args = ["train", *TINY_RUN, "--epochs", "2", "--out", str(out)]
    logs = run_all(*(torchrun(1, *args, nnodes=2, node_rank=r, endpoint=endpoint) for r in (0, 1)))
    assert "on 2 processes (DDP)" in logs[0]
    assert_same_run(weights(single_run), weights(out))


def test_fsdp_on_two_processes_matches_one_process(single_run, tmp_path):
    out = tmp_path / "fsdp"
    (log,) = run_all(torchrun(2, "train", *TINY_RUN, "--epochs", "2", "--fsdp", "--out", str(out)))
    assert "on 2 processes (FSDP)" in log
    ckpt = load_checkpoint(out / "last.pt", weights=False)
    assert ckpt["model"] is None and ckpt["sharded"] == "shards/epoch-0002" and ckpt["world_size"] == 2
    best = load_checkpoint(out / "best.pt", weights=False)["sharded"]  # epoch 1's or 2's, whichever scored higher
    # the shard folders left are those a checkpoint file points to: an older epoch's only if it is the best
    assert sorted(p.name for p in (out / "shards").iterdir()) == sorted({"epoch-0002", Path(best).name})
    assert_same_run(weights(single_run), weights(out))


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_one_and_on_two_processes(single_run, tmp_path):
    """Saved sharded by 2 processes after epoch 1, resumed by 2 (bit-identical to an uninterrupted run)
    and by 1 (the same training within round-off; fresh RNG streams, said in a note)."""
    full, half = tmp_path / "full", tmp_path / "half"
    fsdp = ["train", *TINY_RUN, "--fsdp"]
    run_all(
        torchrun(2, *fsdp, "--epochs", "2", "--out", str(full)), torchrun(2, *fsdp, "--epochs", "1", "--out", str(half))
    )
    on_one = tmp_path / "on_one"
    shutil.copytree(half, on_one)
    logs = run_all(
        torchrun(2, *fsdp, "--epochs", "2", "--out", str(half), "--resume"),
        vitlab_cmd(*fsdp, "--epochs", "2", "--out", str(on_one), "--resume"),
    )
    assert "resumed" in logs[0] and "written by 2 processes, now 1" in logs[1]
    a, b = weights(full), weights(half)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same world size: bit for bit
    assert_same_run(weights(single_run), weights(on_one))
    steps = [json.loads(line)["step"] for line in (half / "steps.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))  # one row per step, none twice


# runs `vitlab ARGS`, stopping every rank right after the run's first mid-epoch checkpoint (as a kill would)
STOP_AFTER_FIRST_SAVE = """
import sys
import vitlab.engine.loop as loop
real = loop.save_position
def save_then_stop(run, epoch, tally):
    real(run, epoch, tally)
    raise KeyboardInterrupt
loop.save_position = save_then_stop
from vitlab.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("mode", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_resumed_epoch_row_on_two_processes_equals_the_uninterrupted_one(mode, tmp_path):
    """Killed after the mid-epoch checkpoint of step 2 (of 4) and resumed on 2 processes: the epoch's loss and
    accuracy are the uninterrupted run's. The checkpoint holds the sums over both ranks; were each rank to
    restore them, the first half of the epoch would count twice."""
    script = tmp_path / "stop.py"
    script.write_text(STOP_AFTER_FIRST_SAVE)
    args = ["train", *TINY_RUN, "--epochs", "1", "--save-every", "2", *(["--fsdp"] if mode == "fsdp" else [])]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    launch = torchrun(2, "train")[: -len(["-m", "vitlab.cli", "train"])]
    stopped = subprocess.run([*launch, str(script), *args, "--out", str(cut)], env=ENV, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert stopped.returncode != 0 and load_checkpoint(cut / "last.pt", weights=False)["step"] == 2, stopped.stdout
    run_all(torchrun(2, *args, "--out", str(whole)), torchrun(2, *args, "--out", str(cut), "--resume"))
    (a,), (b,) = (json.loads((out / "log.json").read_text()) for out in (whole, cut))
    assert a["train_acc"] == b["train_acc"] and a["step"] == b["step"] == 4 and a["lr"] == b["lr"]
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-6)  # the sums added in another order
    assert a["val_top1"] == b["val_top1"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_stop_with_their_torchrun(tmp_path):
    """SIGKILL of torchrun alone (as a scheduler or a killed `vitlab study` ends it) ends its workers at once,
    though they run in sessions of their own, instead of training on until a collective times out."""
    import signal
    import time

    from test_study import descendants

    out = tmp_path / "run"
    proc = subprocess.Popen(torchrun(2, "train", *TINY_RUN, "--epochs", "500", "--out", str(out)), env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (out / "last.pt").exists() and time.time() < deadline:  # both workers in the process group
            time.sleep(0.2)
        assert (out / "last.pt").exists(), "the workers never reached their first checkpoint"
        workers = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 10
        while any(Path(f"/proc/{w}").exists() for w in workers) and time.time() < deadline:
            time.sleep(0.1)
        alive = [w for w in workers if Path(f"/proc/{w}").exists() and "Z" not in _state(w)]
        assert not alive, f"workers {alive} outlived their torchrun"
    finally:
        for w in descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


# runs `vitlab ARGS` with FSDP's reduce-scatter counted, the count written to PREFIX-rank<r>.json
COUNT_REDUCE_SCATTER = """
import json, os, sys
import torch.distributed as dist
calls, real = [0], dist.reduce_scatter_single
def counted(*args, **kwargs):
    calls[0] += 1
    return real(*args, **kwargs)
dist.reduce_scatter_single = counted
from vitlab.cli import main
code = main(sys.argv[2:])
with open(f"{sys.argv[1]}-rank{os.environ['RANK']}.json", "w") as f:
    json.dump(calls[0], f)
sys.exit(code)
"""


@pytest.mark.slow
def test_fsdp_with_accumulation_syncs_once_per_step_and_matches_the_larger_batch(single_run, tmp_path):
    """2 processes x 2 micro-batches of 8 under FSDP2 = one process with the batch of 32 (within the float32
    round-off of the module docstring), and the gradients are reduce-scattered once per optimizer step: one
    collective per FSDP unit (the block and the root) per step, none on the first micro-batch."""
    script, out = tmp_path / "count.py", tmp_path / "accum"
    script.write_text(COUNT_REDUCE_SCATTER)
    launch = torchrun(2, "train")[: -len(["-m", "vitlab.cli", "train"])]
    args = ["train", *TINY_RUN, "--epochs", "2", "--fsdp", "--batch-size", "16", "--accum-steps", "2"]
    (log,) = run_all([*launch, str(script), str(tmp_path / "calls"), *args, "--out", str(out)])
    assert "on 2 processes (FSDP)" in log and load_checkpoint(out / "last.pt", weights=False)["step"] == 8
    units, steps = 2, 8  # depth 1: one block + the root
    calls = [json.loads((tmp_path / f"calls-rank{r}.json").read_text()) for r in (0, 1)]
    assert calls == [units * steps] * 2, calls  # syncing every micro-batch would double them
    assert_same_run(weights(single_run), weights(out))


def test_lm_train_under_ddp_with_accumulation_matches_one_process(tmp_path):
    """2 processes x 2 micro-batches of 2 sequences = one process with the batch of 8."""
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 8)
    args = ["lm", "train", "--model", "tiny_aft_local", "--data", str(text), "--seq-len", "32", "--steps", "4"]
    args += ["--batch-size", "8", "--eval-every", "4", "--eval-symbols", "256", "--dropout", "0", "--threads", "1"]
    args += ["--device", "cpu"]  # gloo, also where a GPU is present
    one, two = tmp_path / "one", tmp_path / "two"
    logs = run_all(vitlab_cmd(*args, "--out", str(one)), torchrun(2, *args, "--accum-steps", "2", "--out", str(two)))
    assert "on 2 processes (DDP)" in logs[1] and "(2 micro-batches)" in logs[1]
    a, b = load_checkpoint(one / "last.pt"), load_checkpoint(two / "last.pt")
    assert a["step"] == b["step"] == 4
    assert_same_run(a["model"], b["model"])
    rows = [json.loads(line) for line in (two / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["sym_s"] > 0 for r in rows)


# --------------------------------------------------------------------------- sharded checkpoints, one process


def sharded_pair(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    model = vitlab.create_model("deit_mini", img_size=28, in_chans=1, num_classes=10, patch_size=7, depth=1)
    opt = create_optimizer(model, 1e-3)
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    opt.step()
    folder = tmp_path / "shards" / "epoch-0001"
    save_sharded(folder, model, opt, World())
    return model, folder


def test_sharded_weights_read_back_whole_in_one_process(tmp_path):
    model, folder = sharded_pair(tmp_path)
    back = read_sharded_weights(folder)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    # a checkpoint file pointing to the shards reads as a whole checkpoint (eval, convert, export)
    save_checkpoint({"model_name": "deit_mini", "model": None, "sharded": "shards/epoch-0001"}, tmp_path / "last.pt")
    assert torch.equal(load_checkpoint(tmp_path / "last.pt")["model"]["head.weight"], model.head.weight)
    save_checkpoint({"model_name": "deit_mini", "model": None, "sharded": "../elsewhere"}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="points outside its folder"):
        load_checkpoint(tmp_path / "bad.pt")


class Planted:
    """What a malicious index could hold: unpickling it would call ``os.system``."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_sharded_checkpoint_never_runs_code(tmp_path):
    _, folder = sharded_pair(tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(Planted()))
    with pytest.raises(ShardError, match=r"refusing to read .*\.metadata: it asks to import posix.system"):
        read_sharded_weights(folder)
    (folder / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ShardError, match="is damaged"):
        read_sharded_weights(folder)
    with pytest.raises(ShardError, match="no sharded checkpoint"):
        read_sharded_weights(tmp_path / "nowhere")


def test_a_sharded_index_cannot_reach_what_an_allowed_module_imports(tmp_path):
    """A dotted name looked up inside DCP's own module (``os.getcwd`` through its ``import os``) is refused:
    only exact (module, name) pairs are resolved, so the index reaches nothing that module imported."""
    _, folder = sharded_pair(tmp_path)
    module, name = b"torch.distributed.checkpoint.metadata", b"os.getcwd"
    # PROTO 4, the two names, STACK_GLOBAL, an empty tuple, REDUCE: os.getcwd() if the name were resolved
    payload = b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93)R."
    (folder / ".metadata").write_bytes(payload)
    with pytest.raises(
        ShardError, match=r"refusing to read .*: it asks to import torch\.distributed\.checkpoint\.metadata\.os\.getcwd"
    ):
        read_sharded_weights(folder)


@pytest.mark.slow
def test_a_models_penalty_trains_the_same_under_ddp(tmp_path):
    """AFT-conv's sparsity penalty (computed from the parameters beside the forward pass) on two processes: the
    same weights as one process, and not those of the run without it (the penalty takes part)."""
    mixer = '("aft_conv", {"num_heads": 16, "kernel_size": 5, "sparsity": %s})'
    run = [*TINY_RUN[2:], "--model", "aft_conv_mini", "--epochs", "2"]
    one, two, free = tmp_path / "one", tmp_path / "two", tmp_path / "free"
    run_all(
        vitlab_cmd("train", *run, "--model-arg", "mixer=" + mixer % 1.0, "--out", str(one)),
        torchrun(2, "train", *run, "--model-arg", "mixer=" + mixer % 1.0, "--out", str(two)),
        vitlab_cmd("train", *run, "--model-arg", "mixer=" + mixer % 0.0, "--out", str(free)),
    )
    assert_same_run(weights(one), weights(two))
    gap = max((weights(one)[k] - weights(free)[k]).abs().max().item() for k in weights(one) if ".mixer." in k)
    assert gap > 10 * TOLERANCE


@pytest.mark.parametrize("name", [n for n in vitlab.list_models() if n.endswith("_mini")])
def test_no_block_returns_a_tensor_it_was_given(name):
    """Under FSDP every block is a unit whose inputs FSDP wraps as views: a block that returned one of them
    (Refined-ViT's shared block handing on the previous map did) makes FSDP warn, 10 times a run, that an
    in-place op on it would skip the all-gather of the backward."""
    from torch.utils._pytree import tree_leaves

    torch.manual_seed(0)
    model = vitlab.create_model(name).train()
    handed_back, calls = [], []

    def hook(module, args, kwargs, output):
        given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        handed_back.extend(t.shape for t in tree_leaves(output) if any(t is g for g in given))
        calls.append(module)

    for block in blocks_of(model):  # FSDP's units
        block.register_forward_hook(hook, with_kwargs=True)
    c, h, w = model.meta["input_size"]
    model(torch.randn(2, c, h, w))
    assert calls and not handed_back
