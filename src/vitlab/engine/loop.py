"""The training loop: one function, setup (:mod:`.setup`) then loop (nanoGPT style), and evaluation.

``train(TrainConfig(...))`` trains a registered model on a dataset spec (``vitlab.data.open_source``) with
AdamW (no decay on norms, biases, tokens, position tables; fused on a GPU), a per-step warmup + cosine
schedule, gradient clipping, stochastic depth, optional Mixup/CutMix + label smoothing, an EMA of the
weights, autocast (bf16 on CPU or GPU, fp16 with a gradient scaler on GPU) and DeiT hard distillation from a
teacher checkpoint. Speed and memory options: ``compile`` (``torch.compile`` of the model),
``grad_checkpointing`` (every block's activations recomputed in the backward pass), ``tf32`` (GPU).

Run under ``torchrun`` (one machine or several: ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``) it trains
with DistributedDataParallel, or with ``fsdp`` sharded by FSDP2, one unit per block (gloo on CPU, NCCL on
GPU); ``batch_size`` is the global batch, split evenly over the processes (:mod:`vitlab.common.distributed`).

Determinism: the data order and augmentation are pure functions of ``(seed, epoch, rank, batch)``
(``BatchLoader``); everything else that carries state goes into the checkpoint written atomically after
every epoch (:mod:`.checkpointing`), so a run killed at any moment and resumed with ``resume="auto"`` ends
with the same weights, bit for bit, as one never interrupted (same processes, threads and hardware).

What a run writes into ``out``: ``last.pt`` and ``best.pt`` (best held-out top-1), ``log.json``/``log.csv``
(one row per epoch), ``steps.jsonl`` (one row per step: loss, learning rate, gradient norm, images/s,
memory; :class:`vitlab.engine.tracking.StepLog`), ``tb/`` with ``tensorboard``, ``summary.json``, and for a
sharded run ``shards/``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..common.device import AMP_CHOICES, amp_dtype, autocast, device_memory, resolve_device, set_tf32
from ..common.distributed import all_reduce_sum, barrier, gradient_sync, init_distributed
from ..common.io import write_json_atomic
from ..common.rundir import check_free_space, checkpoint_bytes, own_folder
from ..common.runtime import is_out_of_memory as is_oom
from ..data import BatchLoader
from .checkpointing import save_epoch, save_position
from .config import OPTION_CHECKS, RUN_FILES, EpochTally, Run, TrainConfig, TrainingError
from .setup import setup
from .tasks import score_key, task_hooks

__all__ = [
    "AMP_CHOICES",
    "OPTION_CHECKS",
    "RUN_FILES",
    "TrainConfig",
    "TrainingError",
    "amp_dtype",
    "evaluate",
    "train",
]


# --------------------------------------------------------------------------- small helpers


def local_value(t: Tensor) -> Tensor:
    """A tensor FSDP returns as a replicated ``DTensor`` (the gradient norm) as a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: nn.Module, loader: BatchLoader, device: torch.device, dtype: torch.dtype | None = None) -> dict:
    """Top-1 / top-5 accuracy (%), mean cross-entropy and throughput (img/s) over ``loader`` (the sums stay on
    the device until the end: one synchronisation); ``skipped``: the unreadable images the loader left out."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, device=device, dtype=torch.float64)  # loss, top-1, top-5, n
    t0 = time.perf_counter()
    for x, y in loader:
        with autocast(device, dtype):
            logits = model(x)
        logits = logits.float()
        top = logits.topk(min(5, logits.shape[-1]), -1).indices
        sums += torch.stack(
            [
                F.cross_entropy(logits, y, reduction="sum").double(),
                (top[:, 0] == y).sum().double(),
                (top == y[:, None]).any(-1).sum().double(),
                torch.tensor(float(len(y)), device=device, dtype=torch.float64),
            ]
        )
    loss, c1, c5, n = sums.tolist()
    seconds = time.perf_counter() - t0
    model.train(was_training)
    n = int(n)
    skipped = len(getattr(loader, "bad_files", ()))
    return {"loss": loss / n, "top1": 100 * c1 / n, "top5": 100 * c5 / n, "n": n, "img_s": n / seconds,
            "skipped": skipped}  # fmt: skip


# --------------------------------------------------------------------------- the loop, as named steps


def print_line(line: str) -> None:
    print(line, flush=True)


def train(cfg: TrainConfig, log: Callable[[str], None] = print_line) -> dict[str, Any]:
    """Train as ``cfg`` says; ``log`` receives rank 0's progress lines. Returns the summary (also written to
    ``OUT/summary.json``) with the per-epoch ``log`` rows: everything a caller needs to report the run."""
    t_start = time.perf_counter()
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        set_tf32(cfg.tf32)
    world = init_distributed(device)
    with own_folder(cfg.out, "vitlab train", RUN_FILES, bool(cfg.resume), cfg.force, log, world) as start_over:
        run = setup(cfg, log, world, device, t_start)
        if run.master:  # before the first write: room for a checkpoint, then the old run out of the way
            check_free_space(run.out, checkpoint_bytes(run.net.raw.state_dict(), 3 if run.ema is None else 4))
            start_over()
            run.progress.record = run_record(run)  # OUT/run.json, written with the first checkpoint
        run.net.model.train()
        try:
            for epoch in range(run.progress.start_epoch, cfg.epochs):
                row = train_epoch(run, epoch)
                if run.evaluates:
                    row.update(evaluate_epoch(run))
                row["elapsed_s"] = run.elapsed()
                save_epoch(run, row)
                report_epoch(run, row)
        finally:
            run.steps.close()
        return finish(run)


def git_revision() -> str | None:
    """The git commit of the vitlab source that runs (None outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def run_record(run: Run) -> dict[str, Any]:
    """``OUT/run.json``: the resolved options, the batch and learning rate they give, the evaluation crop,
    and what produced the run (vitlab and torch versions, the git revision, the command line)."""
    import platform
    import sys
    from dataclasses import asdict

    from .. import __version__

    cfg = run.cfg
    return {
        "config": asdict(cfg),
        "recipe": cfg.recipe,
        "global_batch": cfg.global_batch,
        "batch_per_process": run.per_rank,
        "world_size": run.world.size,
        "base_lr": cfg.base_lr,
        "lr": cfg.peak_lr,
        "data_cfg": run.data.data_cfg,
        "versions": {"vitlab": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "git_revision": git_revision(),
        "command": sys.argv,
    }


@contextlib.contextmanager
def oom_guard(run: Run) -> Iterator[None]:
    """Out of memory in a step as one line saying what to change."""
    try:
        yield
    except RuntimeError as e:
        if is_oom(e):
            raise TrainingError(
                f"a batch of {run.per_rank} images does not fit in memory ({str(e).splitlines()[0][:120]}); "
                "use a smaller --batch-size (or --grad-checkpointing, --accum-steps)"
            ) from None
        raise


def forward_backward(run: Run, batch: tuple, weight: float, sync: bool) -> tuple[Tensor, Tensor]:
    """One micro-batch: forward, loss, backward of ``weight x loss`` (gradients add up over the group; the
    gradient all-reduce of DDP, or reduce-scatter of FSDP, only on the group's last micro-batch). Returns
    (loss, class logits)."""
    x, y = batch[0], batch[1]
    dense = batch[2] if len(batch) > 2 else None
    net = run.net
    spread = getattr(net.model, "_orig_mod", net.model)  # under torch.compile: the DDP or FSDP module inside
    with oom_guard(run), gradient_sync(spread, sync):
        with autocast(run.device, run.dtype):
            outputs = net.model(x)
            loss = net.criterion(x, outputs, y, dense)
            penalty = net.raw.regularization_loss() if hasattr(net.raw, "regularization_loss") else None
            loss = loss if penalty is None else loss + penalty  # a model's own penalty (AFT-conv's sparsity)
        run.opt.scaler.scale(loss * weight).backward()
    return loss, outputs[0] if isinstance(outputs, tuple) else outputs


def optimizer_step(run: Run) -> Tensor:
    """Clip, step, schedule, EMA; returns the gradient norm before clipping."""
    cfg, optimizer, scaler = run.cfg, run.opt.optimizer, run.opt.scaler
    with oom_guard(run):
        scaler.unscale_(optimizer)  # the norm and the clip see the true gradients (no-op without fp16)
        params = [p for p in run.net.raw.parameters() if p.grad is not None]
        if cfg.clip_grad > 0:
            norm = nn.utils.clip_grad_norm_(params, cfg.clip_grad)
        else:
            norm = nn.utils.get_total_norm([p.grad for p in params])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    run.opt.sched.step()
    run.progress.step += 1
    if run.ema is not None:
        run.ema.update(run.net.raw)
    return local_value(norm)


def start_epoch(run: Run, epoch: int) -> EpochTally:
    """Position the loader at the epoch's start, or where a mid-epoch checkpoint left it (with its sums)."""
    progress, loader = run.progress, run.data.loader
    if progress.resume_loader is not None:
        loader.load_state_dict(progress.resume_loader)
    else:
        loader.set_epoch(epoch)
    task = task_hooks(run.cfg)
    # the checkpoint holds the sums over every process: rank 0 carries them on, the others restart from zero
    tally = (task.tally if task is not None else EpochTally.restore)(progress.resume_tally, run.device, run.master)
    progress.resume_loader = progress.resume_tally = None  # the next epoch starts at its beginning
    return tally


def train_epoch(run: Run, epoch: int) -> dict[str, Any]:
    """One pass over the training data; the epoch's row of the log (loss, accuracy, speed over all ranks).
    Every optimizer step's loss (mean over its micro-batches), learning rate and gradient norm go to the
    per-step log; with ``save_every`` a checkpoint is written between steps."""
    from .tracking import Progress

    cfg, loader, accum = run.cfg, run.data.loader, run.cfg.accum_steps
    n_batches = len(loader)
    tally = start_epoch(run, epoch)
    progress = Progress(cfg.epochs * n_batches, epoch * n_batches, run.log, cfg.progress and run.master,
                        cfg.progress_every)  # fmt: skip
    progress.start(f"epoch {epoch + 1}/{cfg.epochs}", n_batches)
    run.steps.restart_clock()  # images/s counts training only (not setup, evaluation, checkpoints)
    tally.start_clock()
    group_loss, group_images = 0.0, 0
    for batch in loader:
        done = loader.state_dict()["batch"]  # batches of the epoch handed out, this one included
        first = (done - 1) // accum * accum
        last = done % accum == 0 or done == n_batches
        lr = run.opt.optimizer.param_groups[0]["lr"]
        loss, logits = forward_backward(run, batch, 1.0 / min(accum, n_batches - first), last)
        tally.add(loss, logits, batch[1])
        group_loss, group_images = group_loss + loss.detach().float(), group_images + len(batch[0])
        if last:
            norm = optimizer_step(run)
            step_loss = all_reduce_sum(group_loss / (done - first), run.world) / run.world.size
            scalars = {"_names": ("loss", "grad_norm"), "epoch": epoch + 1, "lr": lr}
            run.steps.add(run.step, group_images * run.world.size, scalars, torch.stack([step_loss, norm.float()]))
            group_loss, group_images = 0.0, 0
            if cfg.save_every and run.step % cfg.save_every == 0 and done < n_batches:
                save_position(run, epoch, tally.state_dict(run.world))
        progress.update(len(batch[0]) * run.world.size, tally.status() if progress.wants_status() else None)
    progress.close()
    run.steps.flush()  # waits for the device, so the tally's clock reads the work done
    return tally.row(run, epoch)


def evaluate_epoch(run: Run) -> dict[str, Any]:
    """Held-out top-1/top-5 of the model (and of its EMA); a sharded model evaluates on every rank."""
    if (task := task_hooks(run.cfg)) is not None:
        return task.evaluate(run)
    model = run.net.model if run.cfg.fsdp else run.net.raw  # FSDP's forward gathers the shards; the others whole
    ev = evaluate(model, run.data.val_loader, run.device, run.dtype)
    row = {"val_loss": ev["loss"], "val_top1": ev["top1"], "val_top5": ev["top5"], "eval_img_s": ev["img_s"],
           "val_n": ev["n"], "val_skipped": ev["skipped"]}  # fmt: skip
    if run.ema is not None:
        ev_ema = evaluate(run.ema.module, run.data.val_loader, run.device, run.dtype)
        row.update(ema_top1=ev_ema["top1"], ema_top5=ev_ema["top5"])
    return row


def report_epoch(run: Run, row: dict[str, Any]) -> None:
    """The epoch's line."""
    if not run.master:
        return
    if (task := task_hooks(run.cfg)) is not None:
        run.log(task.report(run, row))
        return
    ema_txt = f"  ema {row['ema_top1']:.2f}%" if run.ema is not None else ""
    best = "  (best)" * (row.get("val_top1") == run.progress.best_top1)
    run.log(
        f"epoch {row['epoch']}/{run.cfg.epochs}  loss {row['train_loss']:.4f}  train {row['train_acc']:.1f}%  "
        f"held-out {row['val_top1']:.2f}% (top-5 {row['val_top5']:.1f}%){ema_txt}{best}  lr {row['lr']:.2e}  "
        f"{row['train_img_s']:.0f} img/s  {row['train_time_s']:.1f} s"
    )


def finish(run: Run) -> dict[str, Any]:
    """The run's summary (rank 0; empty elsewhere), written to ``OUT/summary.json`` and returned with the log."""
    summary: dict[str, Any] = {}
    if run.master:
        rows = run.progress.rows
        train_s = sum(r["train_time_s"] for r in rows)
        key = score_key(run.cfg)
        best = max(rows, key=lambda r: r.get(key, -1.0)) if rows else {}
        summary = {
            "model": run.cfg.model,
            "params": sum(p.numel() for p in run.net.raw.parameters()),
            "epochs": run.cfg.epochs,
            "world_size": run.world.size,
            "final": rows[-1] if rows else {},
            "best": {
                "epoch": best.get("epoch"),
                key: best.get(key),
                "checkpoint": str(run.out / "best.pt"),
            },
            "train_img_s": sum(r["train_img_s"] * r["train_time_s"] for r in rows) / max(train_s, 1e-9),
            "train_time_s": train_s,
            "wall_s": run.elapsed(),
            "checkpoint": str(run.out / "last.pt"),
        }
        if (mem := device_memory(run.device)) is not None:  # the host RSS says little about a GPU run
            summary["cuda_peak_mib"] = mem["peak"] / 2**20
        write_json_atomic(run.out / "summary.json", summary)
        summary["log"] = list(rows)
    barrier(run.world)
    return summary
