"""vitlab train / eval: optimizer groups, schedule, EMA, distillation loss, checkpoints, resume, DDP, CLI errors."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.checkpoint import check_model_name, load_state_checked, model_from_checkpoint
from vitlab.cli import main as cli_main
from vitlab.distill.loss import HardDistillationLoss
from vitlab.engine import ModelEma, WarmupCosine, create_optimizer, load_checkpoint, param_groups, save_checkpoint
from vitlab.engine.setup import init_weights_from

REPO = Path(__file__).resolve().parents[1]
# a tiny DeiT: 4x4 grid of 7-px patches, 1 block of width 32 -> a few seconds per epoch
TINY = ["--model", "deit_mini", "--model-arg", "patch_size=7", "--model-arg", "depth=1", "--model-arg", "embed_dim=32"]
TINY_RUN = [*TINY, "--train-limit", "128", "--holdout", "200", "--batch-size", "32", "--threads", "1", "--no-progress"]
TINY_RUN += ["--device", "cpu"]  # the CPU suite (gloo, exact resumes), also where a GPU is present


def mnist_model(name: str = "deit_mini", **kw) -> torch.nn.Module:
    return vitlab.create_model(name, img_size=28, in_chans=1, num_classes=10, patch_size=7, **kw)


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "vitlab.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(out / "last.pt")["model"]


# --------------------------------------------------------------------------- optimizer and schedule


def test_param_groups_exclude_norms_biases_tokens_and_tables():
    model = mnist_model()
    decay, no_decay = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert {"cls_token", "pos_embed", "norm.weight", "norm.bias", "head.bias"} <= nd
    assert "head.weight" in d and "blocks.0.mixer.qkv.weight" in d and "patch_embed.proj.weight" in d
    assert not d & nd and len(d) + len(nd) == len(list(model.parameters()))
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    # names a mixer declares (e.g. position biases) are excluded through model.no_weight_decay()
    aft = vitlab.create_model("aft_full_mini", img_size=28, in_chans=1, num_classes=10)
    names = {id(p): n for n, p in aft.named_parameters()}
    excluded = {names[id(p)] for p in param_groups(aft, 0.05)[1]["params"]}
    assert {"blocks.0.mixer.u", "blocks.0.mixer.v", "blocks.1.mixer.u", "blocks.1.mixer.v"} <= excluded
    aft.blocks[1].mixer.no_weight_decay = lambda: {"qkv.weight"}
    excluded = {names[id(p)] for p in param_groups(aft, 0.05)[1]["params"]}
    assert "blocks.1.mixer.qkv.weight" in excluded and "blocks.0.mixer.qkv.weight" not in excluded


def test_adamw_skips_decay_where_excluded():
    model = mnist_model(depth=1)
    opt = create_optimizer(model, lr=0.1, weight_decay=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradient: only decay moves a weight
    opt.step()
    after = dict(model.named_parameters())
    assert torch.equal(after["pos_embed"], before["pos_embed"]) and torch.equal(
        after["norm.weight"], before["norm.weight"]
    )
    torch.testing.assert_close(after["head.weight"], before["head.weight"] * (1 - 0.1 * 0.5))


def test_warmup_cosine_matches_formula_and_resumes():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    lr, min_lr, total, warm = 3e-3, 1e-5, 50, 10
    sched = WarmupCosine(opt, lr, total, warm, min_lr)
    seen = []
    for _ in range(total + 1):
        seen.append(opt.param_groups[0]["lr"])
        sched.step()

    def naive(t: int) -> float:  # linear warmup from 0, then half a cosine period down to min_lr
        if t < warm:
            return lr * t / warm
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, (t - warm) / (total - warm))))

    assert seen == pytest.approx([naive(t) for t in range(total + 1)], rel=1e-12, abs=1e-15)
    assert seen[0] == 0 and seen[warm] == pytest.approx(lr) and seen[total] == pytest.approx(min_lr)
    # a new scheduler loaded from the state continues the same curve
    opt2 = torch.optim.SGD([p], lr=1.0)
    s2 = WarmupCosine(opt2, lr, total, warm, min_lr)
    s2.load_state_dict({"step_count": 17})
    assert opt2.param_groups[0]["lr"] == pytest.approx(naive(17))
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupCosine(opt, lr, 10, 20)


# --------------------------------------------------------------------------- EMA


def test_ema_is_the_exponential_average_and_copies_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ema = ModelEma(model, decay=0.9, warmup=False)
    shadow = {n: p.detach().clone().double() for n, p in model.named_parameters()}
    for _ in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model.train()(torch.randn(8, 3))  # moves the BatchNorm statistics
        ema.update(model)
        for n, p in model.named_parameters():
            shadow[n] = 0.9 * shadow[n] + 0.1 * p.detach().double()
    for n, p in ema.module.named_parameters():
        torch.testing.assert_close(p.double(), shadow[n], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ema.module[1].running_mean, model[1].running_mean)
    assert not any(p.requires_grad for p in ema.module.parameters())
    warm = ModelEma(model, decay=0.999)
    assert warm.current_decay() == pytest.approx(1 / 10)  # (1 + 0) / (10 + 0): short runs average recent weights


# --------------------------------------------------------------------------- distillation


def test_hard_distillation_loss_is_the_deit_equation():
    torch.manual_seed(0)
    teacher = mnist_model(depth=1).eval()
    student = mnist_model(depth=1, dist_token=True).train()
    student.distilled_training = True
    x, y = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
    crit = HardDistillationLoss(teacher)
    crit.check_student(student, 1)
    cls_logits, dist_logits = out = student(x)
    y_t = teacher(x).argmax(-1)
    naive = 0.5 * F.cross_entropy(cls_logits, y) + 0.5 * F.cross_entropy(dist_logits, y_t)
    torch.testing.assert_close(crit(x, out, y), naive)
    with pytest.raises(ValueError, match="distillation token"):
        crit.check_student(mnist_model(depth=1), 1)


# --------------------------------------------------------------------------- checkpoints


def _ckpt_of(model: torch.nn.Module, name: str = "deit_mini") -> dict:
    return {
        "model_name": name,
        "model_kwargs": dict(img_size=28, in_chans=1, num_classes=10, patch_size=7),
        "model": model.state_dict(),
        "epoch": 1,
        "step": 3,
    }


def test_checkpoint_atomic_roundtrip_and_model_record(tmp_path):
    model = mnist_model()
    path = save_checkpoint(_ckpt_of(model), tmp_path / "last.pt")
    save_checkpoint({**_ckpt_of(model), "epoch": 2}, path)  # replaced in place
    assert sorted(os.listdir(tmp_path)) == ["last.pt"]  # no temp file left behind
    ckpt = load_checkpoint(tmp_path)  # a run folder means its last.pt
    assert ckpt["epoch"] == 2 and ckpt["model_name"] == "deit_mini"
    rebuilt = model_from_checkpoint(ckpt).eval()
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(rebuilt(x), model.eval()(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="holds a 'deit_mini' model, not 'cpvt_mini'"):
        check_model_name(ckpt, "cpvt_mini")
    with pytest.raises(ValueError, match=r"does not fit the model: missing: .*pegs"):
        load_state_checked(
            vitlab.create_model("cpvt_mini", img_size=28, in_chans=1, num_classes=10, patch_size=7),
            ckpt["model"],
            "ckpt",
        )


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_loading_never_runs_code_and_bad_files_are_clear(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evil = tmp_path / "evil.pt"
    torch.save({"format": "vitlab-checkpoint", "model_name": "deit_mini", "x": _Evil()}, evil)
    with pytest.raises(ValueError, match=r"holds Python objects .* could run code"):
        load_checkpoint(evil)
    assert not (tmp_path / "pwned").exists()
    good = save_checkpoint(_ckpt_of(mnist_model()), tmp_path / "good.pt")
    data = good.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_checkpoint(tmp_path / "cut.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="truncated, corrupt or not a PyTorch file"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save(mnist_model().state_dict(), tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not a vitlab checkpoint"):
        load_checkpoint(tmp_path / "plain.pt")
    (tmp_path / "pickled.pt").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError):
        load_checkpoint(tmp_path / "pickled.pt")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")


# --------------------------------------------------------------------------- training runs


def test_accumulation_syncs_gradients_on_the_last_micro_batch_of_each_step(tmp_path, monkeypatch):
    """The training step asks the spread model (DDP or FSDP: :func:`vitlab.common.distributed.gradient_sync`) to skip the
    gradient collective on every micro-batch but a step's last; 5 micro-batches in groups of 2 end with a short
    group of 1 (the FSDP collectives themselves are counted across two processes in test_distributed)."""
    import contextlib

    import vitlab.engine.loop as engine
    from vitlab.engine import TrainConfig, train

    flags = []

    @contextlib.contextmanager
    def record(model, enabled):
        flags.append(enabled)
        yield

    monkeypatch.setattr(engine, "gradient_sync", record)
    cfg = TrainConfig(model="deit_mini", model_args={"patch_size": 7, "depth": 1, "embed_dim": 32}, train_limit=80,
                      holdout=50, batch_size=16, accum_steps=2, epochs=1, threads=1, progress=False, out=str(tmp_path / "r"))  # fmt: skip
    summary = train(cfg, lambda line: None)
    assert flags == [False, True, False, True, True] and summary["final"]["step"] == 3


def test_sigkill_then_resume_gives_bitwise_identical_weights(tmp_path):
    """A real `vitlab train` process killed with SIGKILL after its first checkpoint, then resumed, ends with
    exactly the weights of an uninterrupted run (same options and thread count). Dropout and stochastic depth
    are on, so the restored RNG state matters; the data order is a function of (seed, epoch)."""
    args = [*TINY_RUN, "--epochs", "4", "--drop-path", "0.2", "--crop-padding", "2", "--ema", "0.9"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start(out: Path) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "vitlab.cli", "train", *args, "--out", str(out)]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)

    out = tmp_path / "killed"
    full, proc = start(tmp_path / "full"), start(out)  # side by side: the test waits for the slower only
    try:
        deadline = time.time() + 180
        while not (out / "last.pt").exists():
            assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # the process this test started
        proc.wait(30)
        assert full.wait(180) == 0, full.stderr.read()
    finally:
        for p in (proc, full):
            if p.poll() is None:
                p.kill()
    killed_at = load_checkpoint(out / "last.pt")["epoch"]
    assert proc.returncode == -signal.SIGKILL and killed_at < 4, "the kill did not interrupt the run"

    resumed = run_cli("train", *args, "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed {out / 'last.pt'} after epoch {killed_at}" in resumed.stdout
    a, b = final_weights(tmp_path / "full"), final_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ema_a, ema_b = (load_checkpoint(p / "last.pt")["ema"]["module"] for p in (tmp_path / "full", out))
    assert all(torch.equal(ema_a[k], ema_b[k]) for k in ema_a)
    log = json.loads((out / "log.json").read_text())
    assert [r["epoch"] for r in log] == [1, 2, 3, 4]
    full_log = json.loads((tmp_path / "full" / "log.json").read_text())
    assert [r["train_loss"] for r in log] == [r["train_loss"] for r in full_log]
    assert (out / "log.csv").read_text().count("\n") == 5


def test_train_eval_distill_and_user_errors(tmp_path, capsys):
    """In-process CLI runs: train a teacher, evaluate it at two sizes, distil a student, and the one-line
    errors for bad input."""
    teacher = tmp_path / "teacher"
    assert cli_main(["train", *TINY_RUN, "--epochs", "2", "--out", str(teacher)]) == 0
    log = json.loads((teacher / "log.json").read_text())
    assert log[1]["train_loss"] < log[0]["train_loss"] and 0 <= log[1]["val_top1"] <= 100
    assert {"train_img_s", "val_top5", "lr"} <= set(log[0]) and (teacher / "log.csv").exists()
    ckpt = load_checkpoint(teacher / "last.pt")
    assert {"optimizer", "scheduler", "scaler", "rng", "config", "model_kwargs"} <= set(ckpt)
    assert ckpt["epoch"] == 2 and ckpt["step"] == 2 * 4 and ckpt["model_kwargs"]["patch_size"] == 7
    capsys.readouterr()

    # eval at the training size reproduces the logged accuracy; at 56 px the position table is resampled
    assert (
        cli_main(["eval", str(teacher / "last.pt"), "--img-size", "28", "56", "--json", str(tmp_path / "e.json")]) == 0
    )
    rows = json.loads((tmp_path / "e.json").read_text())
    assert [r["img_size"] for r in rows] == [28, 56]
    assert rows[0]["top1"] == pytest.approx(log[-1]["val_top1"]) and rows[0]["n"] == 200
    assert rows[0]["top5"] >= rows[0]["top1"] and rows[1]["img_s"] > 0

    # a distilled student, initialised from the teacher, trained under bf16 autocast
    student = tmp_path / "student"
    assert (
        cli_main(
            [
                "train",
                *TINY_RUN,
                "--epochs",
                "1",
                "--dist-token",
                "--teacher",
                str(teacher / "last.pt"),
                "--init-from",
                str(teacher / "last.pt"),
                "--amp",
                "bf16",
                "--out",
                str(student),
            ]
        )
        == 0
    )
    assert "head_dist.weight" in load_checkpoint(student)["model"]
    printed = capsys.readouterr().out
    assert "initialised" in printed and "autocast torch.bfloat16" in printed

    # --init-from a DeiT checkpoint into AFT-conv: the AFT paper's transfer (patch embedding, norms, MLPs, V)
    aft = vitlab.create_model(
        "aft_conv_mini", img_size=28, in_chans=1, num_classes=10, patch_size=7, depth=1, embed_dim=32
    )
    assert "initialised" in init_weights_from(aft, str(teacher / "last.pt"))
    for k in ("patch_embed.proj.weight", "blocks.0.mlp.fc1.weight", "norm.weight"):
        assert torch.equal(aft.state_dict()[k], ckpt["model"][k]), k

    def error(*argv: str) -> str:
        assert cli_main(list(argv)) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Traceback" not in err, err
        return err

    assert "unknown model 'deit_minii'" in error("train", "--model", "deit_minii", "--out", str(tmp_path / "x"))
    assert "already holds a run" in error("train", *TINY_RUN, "--epochs", "2", "--out", str(teacher))
    assert "trained with batch_size=32" in error(
        "train", *TINY_RUN, "--epochs", "3", "--out", str(teacher), "--resume", "--batch-size", "16"
    )
    assert "holds a 'deit_mini' model, not 'aft_full_mini'" in error(
        "train", *TINY_RUN, "--epochs", "3", "--out", str(teacher), "--resume", "--model", "aft_full_mini"
    )
    assert "cpvt_mini cannot be built with these options (peg_at indices" in error(  # depth=1: no block 2 for a PEG
        "train", *TINY_RUN, "--epochs", "3", "--out", str(teacher), "--resume", "--model", "cpvt_mini"
    )
    assert "already trained 2 of 2 epochs" in error(
        "train", *TINY_RUN, "--epochs", "2", "--out", str(teacher), "--resume"
    )
    assert "nothing to resume" in error("train", *TINY_RUN, "--out", str(tmp_path / "empty"), "--resume")
    assert "not 'cpvt_mini'" in error("eval", str(teacher), "--model", "cpvt_mini")
    assert "not found" in error("eval", str(tmp_path / "nope.pt"))
    (tmp_path / "bad.pt").write_bytes((teacher / "last.pt").read_bytes()[:1000])
    assert "truncated or corrupt" in error("eval", str(tmp_path / "bad.pt"))
    assert "does not exist" in error(
        "train", *TINY_RUN, "--data", f"cifar10:{tmp_path / 'nodata'}", "--out", str(tmp_path / "y")
    )
    assert "distillation token" in error("train", *TINY_RUN, "--teacher", str(teacher), "--out", str(tmp_path / "z"))
    assert "exceeds the 128 training images" in error(
        "train", *TINY_RUN, "--batch-size", "256", "--out", str(tmp_path / "w")
    )


def test_a_batch_too_big_for_memory_is_one_clear_line(tmp_path, monkeypatch, capsys):
    """An allocation failure in the training step (simulated: CPU allocators raise this RuntimeError)."""
    real = vitlab.models.build_model

    def failing(*args, **kw):
        model = real(*args, **kw)

        def forward(x):
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 123456789012 bytes"
            )

        model.forward = forward
        return model

    monkeypatch.setattr(vitlab.models, "build_model", failing)
    assert cli_main(["train", *TINY_RUN, "--epochs", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "a batch of 32 images does not fit in memory" in err and "--batch-size" in err


@pytest.mark.slow
def test_two_ddp_processes_match_one_process_at_the_same_global_batch(tmp_path):
    """torchrun with 2 CPU processes (gloo), global batch 32 = 2 x 16, against 1 process with batch 32.

    Without augmentation and stochastic depth the two runs see the same samples in the same global batches
    (rank r takes every other sample of the global order), and DDP averages the two half-batch mean
    gradients, i.e. the full-batch mean: only the summation order differs. Tolerance: 2e-5 absolute on
    every weight after 8 AdamW steps at lr 1e-3 (measured: 2.2e-6, ten times below; each weight moves
    more than 1e-3), i.e. float32 round-off amplified by Adam's normalised steps, not a different run.
    """
    args = [*TINY_RUN, "--epochs", "2", "--drop-path", "0", "--crop-padding", "0", "--train-limit", "128"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    ddp = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "vitlab.cli",
            "train",
            *args,
            "--out",
            str(tmp_path / "ddp"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    single = run_cli("train", *args, "--out", str(tmp_path / "one"))
    try:
        log, _ = ddp.communicate(timeout=300)
    finally:
        if ddp.poll() is None:
            ddp.kill()
    assert single.returncode == 0, single.stderr
    assert ddp.returncode == 0, log
    assert "on 2 processes" in log
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "ddp")
    diffs = {k: (one[k].float() - two[k].float()).abs().max().item() for k in one}
    assert max(diffs.values()) < 2e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    # every tensor moved far more than that from the initial weights (seed 0): not two untrained models
    ckpt = load_checkpoint(tmp_path / "one" / "last.pt")
    torch.manual_seed(0)
    init = vitlab.create_model("deit_mini", **ckpt["model_kwargs"]).state_dict()
    assert ckpt["step"] == 8 and min((one[k] - init[k]).abs().max().item() for k in one) > 1e-3


def test_eval_at_another_size_resamples_aft_position_biases(tmp_path):
    """`vitlab eval --img-size`: AFT-full's learned position biases are interpolated like a position table."""
    from vitlab.engine.evaluate import evaluate_checkpoint

    kw = dict(img_size=28, in_chans=1, num_classes=10, patch_size=7, depth=1, embed_dim=32)
    model = vitlab.create_model("aft_full_mini", **kw)
    save_checkpoint(
        {
            "model_name": "aft_full_mini",
            "model_kwargs": kw,
            "model": model.state_dict(),
            "config": {"data": "mnist", "holdout": 200},
        },
        tmp_path / "aft.pt",
    )
    rows = evaluate_checkpoint(tmp_path / "aft.pt", [28, 42], threads=1)
    assert [(r["img_size"], r["n"]) for r in rows] == [(28, 200), (42, 200)]
    with torch.no_grad():  # at the training size the checkpoint's own model is what was evaluated
        x = torch.randn(2, 1, 28, 28)
        torch.testing.assert_close(model_from_checkpoint(load_checkpoint(tmp_path / "aft.pt"))(x), model.eval()(x))


def test_a_models_lr_scale_puts_its_parameters_in_scaled_groups_and_the_schedule_scales_them():
    from torch import nn

    from vitlab.engine.optim import WarmupCosine, create_optimizer, param_groups

    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

        def lr_scale_of(self, name: str) -> float:
            return 0.1 if name.startswith("backbone.") else 1.0

    model = Detector()
    groups = param_groups(model, 0.05)
    plain = [g for g in groups if "lr_scale" not in g]
    assert len(plain) == 2 and [g["weight_decay"] for g in plain] == [0.05, 0.0]  # the two groups checkpoints hold
    assert {id(p) for g in groups if g.get("lr_scale") == 0.1 for p in g["params"]} == {
        id(p) for p in model.backbone.parameters()
    }
    opt = create_optimizer(model, 1e-3)
    sched = WarmupCosine(opt, 1e-3, total_steps=10, warmup_steps=0, drop_step=4)
    for step in range(10):
        rates = {g.get("lr_scale", 1.0): g["lr"] for g in opt.param_groups}
        want = 1e-3 * (0.1 if step >= 4 else 1.0)  # DETR's StepLR: constant, a tenth after the drop
        assert rates[1.0] == pytest.approx(want) and rates[0.1] == pytest.approx(0.1 * want)
        sched.step()
