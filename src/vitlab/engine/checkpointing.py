"""A training run's checkpoints: what goes in, how a run continues from one, and the best one.

After every epoch ``OUT/last.pt`` holds everything that carries state (weights, optimizer, schedule, EMA,
gradient scaler, every process's RNG streams, the log rows so far), written atomically, so a run killed at
any moment and resumed ends with the same weights, bit for bit, as one never interrupted (same number of
processes, thread count and hardware). ``OUT/best.pt`` is the checkpoint of the epoch with the best
held-out top-1 so far (a hard link to that epoch's ``last.pt`` where the file system allows).

An FSDP run writes its weights and optimizer state sharded, every process its own part, through
``torch.distributed.checkpoint`` (:func:`vitlab.checkpoint.write_run_checkpoint`, the same for
``vitlab lm train``); such a checkpoint resumes
on any number of processes, one included. Its RNG streams continue only where the number of processes is
unchanged (there the continuation is bit-identical too); elsewhere the run says so and starts fresh streams.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import load_checkpoint
from ..common.io import copy_atomic, write_csv_atomic, write_json_atomic
from ..data import derive_seed
from .config import Context, Progress, Run, TrainConfig
from .ema import ModelEma
from .optim import Optimization
from .run_state import (
    gather_rng_states,
    optimization_state,
    prune_shards,
    restore_optimization,
    restore_rng_streams,
    write_run_checkpoint,
)
from .tasks import score_key

# options that define the run: resuming with another value cannot continue the same training
RESUME_FIXED = ("model", "model_args", "data", "img_size", "holdout", "train_limit", "batch_size", "dist_token", "seed")
RESUME_FIXED += ("fsdp", "accum_steps", "aug_repeats", "token_label", "dense_root", "task")
# options a resumed run may change (said in a note: it is then not the run that was started)
RESUME_NOTED = ("epochs", "lr", "min_lr", "warmup_epochs", "weight_decay", "clip_grad", "drop_path", "smoothing")
RESUME_NOTED += ("mixup", "cutmix", "ema", "amp", "threads", "teacher", "compile", "grad_checkpointing", "tf32")
RESUME_NOTED += ("base_lr", "reprob", "color_jitter", "crop_pct", "distillation", "distill_alpha", "distill_tau")
RESUME_NOTED += ("token_label_weight", "auto_augment", "workers", "shuffle_buffer", "distill_reduction")


class ResumeError(ValueError):
    """A checkpoint this run cannot continue from: one line."""


def write_log(out: Path, rows: list[dict[str, Any]]) -> None:
    """The per-epoch log as JSON and CSV (rewritten each epoch, atomically)."""
    write_json_atomic(out / "log.json", rows)
    write_csv_atomic(out / "log.csv", rows)


# --------------------------------------------------------------------------- resuming


def open_checkpoint(cfg: TrainConfig, out: Path) -> dict[str, Any] | None:
    """The checkpoint to resume from (``resume``), or None. A sharded checkpoint is read without its
    weights: :func:`restore` loads them into the (sharded) model."""
    if not cfg.resume:
        return None
    path = out / "last.pt" if cfg.resume == "auto" else Path(cfg.resume)
    if cfg.resume == "auto" and not path.exists():
        raise ResumeError(f"nothing to resume: {path} does not exist (drop --resume to start a new run)")
    return load_checkpoint(path, weights=False)


def check_resume(ckpt: dict[str, Any], cfg: TrainConfig, log: Callable[[str], None]) -> None:
    """Refuse a checkpoint of another run (or one already done); note options changed since it was written."""
    old = {"fsdp": False, **ckpt.get("config", {})}  # runs from before FSDP were not sharded
    bad = [f"{k}={old[k]!r} (now {getattr(cfg, k)!r})" for k in RESUME_FIXED if k in old and old[k] != getattr(cfg, k)]
    if bad:
        raise ResumeError(
            f"cannot resume from {ckpt['path']}: it was trained with {', '.join(bad)}; rerun with the same "
            "options or start afresh in another --out (or with --force)"
        )
    done = ckpt["epoch"] >= cfg.epochs
    if done and (ckpt["epoch"] > cfg.epochs or run_is_complete(Path(cfg.out), ckpt["epoch"])):
        raise ResumeError(
            f"{ckpt['path']} has already trained {ckpt['epoch']} of {cfg.epochs} epochs; pass --epochs > {ckpt['epoch']} to continue"
        )
    if done:  # killed after the last checkpoint, before its log row or the summary: complete them, train nothing
        log(f"note: all {cfg.epochs} epochs were trained; completing the log and summary from {ckpt['path']}")
    changed = [f"{k} {old[k]!r} -> {getattr(cfg, k)!r}" for k in RESUME_NOTED if k in old and old[k] != getattr(cfg, k)]
    if changed:
        log(f"note: resuming with changed options ({', '.join(changed)}): not the run that was started")


def run_is_complete(out: Path, epochs: int) -> bool:
    """Whether ``out`` holds the summary and the log row of the last epoch (what a finished run writes last)."""
    try:
        rows = json.loads((out / "log.json").read_text())
        return (out / "summary.json").is_file() and any(r.get("epoch") == epochs for r in rows)
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def restore(ctx: Context, ckpt: dict[str, Any], model: nn.Module, opt: Optimization, ema: ModelEma | None) -> Progress:
    """Continue a run from its checkpoint: weights, optimizer, schedule, scaler and EMA loaded in place, RNG
    streams set; returns the progress it had (epoch, step, log rows, the position within the epoch)."""
    if ema is not None and not ckpt.get("ema"):
        raise ResumeError(f"cannot resume with --ema: {ckpt['path']} was trained without an EMA")
    restore_optimization(ckpt, model, opt)
    if ema is not None:
        ema.load_state_dict(ckpt["ema"])
    epoch, step = int(ckpt["epoch"]), int(ckpt["step"])
    if opt.sched.state_dict()["total_steps"] != ckpt["scheduler"].get("total_steps"):
        ctx.log("note: the schedule is stretched to the new --epochs from here on")
    if not restore_rng_streams(ckpt.get("rng"), ctx.world, ctx.device):
        n = len(ckpt.get("rng") or [])
        ctx.log(f"note: the checkpoint was written by {n} processes, now {ctx.world.size}: fresh random streams")
        torch.manual_seed(derive_seed(ctx.cfg.seed, ctx.world.rank, epoch))
    rows = restore_log(ctx, ckpt, epoch, step)
    key = score_key(ctx.cfg)
    best = max((r[key] for r in rows if key in r), default=None)
    tally = ckpt.get("tally")  # where in the epoch it stopped
    within = f", batch {ckpt['loader']['batch']} of epoch {epoch + 1}" if tally else ""
    ctx.log(f"resumed {ckpt['path']} after epoch {epoch} (step {step}{within})")
    return Progress(epoch, step, rows, best, ckpt.get("loader"), tally)


def restore_log(ctx: Context, ckpt: dict[str, Any], epoch: int, step: int) -> list[dict[str, Any]]:
    """The log rows up to the checkpoint's epoch. The checkpoint carries them, so a run killed between the
    checkpoint's rename and the log write loses no row: log.json is completed at once (checkpoints
    written before they carried the rows: log.json's rows). The per-step log loses the steps after the
    checkpoint."""
    log_file = ctx.out / "log.json"
    try:
        on_disk = json.loads(log_file.read_text()) if log_file.exists() else []
        on_disk = [r for r in on_disk if r["epoch"] <= epoch]
    except (ValueError, TypeError, KeyError):
        on_disk = []  # a damaged log: the checkpoint's rows replace it
    rows = [r for r in ckpt.get("log") or on_disk if r["epoch"] <= epoch]
    if not ctx.master:
        return rows
    if rows != on_disk:
        write_log(ctx.out, rows)
        ctx.log(f"note: {log_file} lacked rows the checkpoint carries ({len(on_disk)} of {len(rows)}); restored")
        top = [r.get("val_top1", -1.0) for r in rows]
        if not ckpt.get("tally") and rows and rows[-1]["epoch"] == epoch and top[-1] > max(top[:-1], default=-1.0):
            copy_atomic(Path(ckpt["path"]), ctx.out / "best.pt")  # the kill may have come before best.pt's copy
    if dropped := ctx.steps.trim(step):
        ctx.log(f"note: dropped {dropped} rows of steps after the checkpoint from {ctx.steps.path}")
    return rows


# --------------------------------------------------------------------------- writing


def run_state(run: Run, epoch: int, rngs: list, **extra: Any) -> dict[str, Any]:
    """What a checkpoint holds after ``epoch`` whole epochs (and, mid-epoch, the loader position and sums)."""
    cfg = run.cfg
    return {
        "model_name": cfg.model,
        "model_kwargs": run.net.kwargs,
        **optimization_state(run.net.raw, run.opt, sharded=cfg.fsdp),
        "ema": run.ema.state_dict() if run.ema is not None else None,
        "epoch": epoch,
        "step": run.step,
        "rng": rngs,
        "world_size": run.world.size,
        "config": asdict(cfg),
        "data_cfg": run.data.data_cfg,  # the evaluation crop and normalisation of streaming data (vitlab eval)
        "label_names": getattr(run.data.train_ds, "classes", None),  # a folder's class names: eval labels by name
        "loader": run.data.loader.state_dict(),
        "log": list(run.progress.rows),  # the rows so far: resume restores any the log files lack
        **extra,
    }


def write_checkpoint(run: Run, state: dict[str, Any], shard_name: str) -> Path | None:
    """``OUT/last.pt`` (collective; its shards ``shards/<shard_name>`` under FSDP); its path on rank 0."""
    name = shard_name if run.cfg.fsdp else None
    return write_run_checkpoint(run.out / "last.pt", state, run.world, name, run.net.raw, run.opt.optimizer)


def write_record(run: Run) -> None:
    """``OUT/run.json`` (rank 0), beside the checkpoint: a run killed before its first one leaves nothing."""
    if run.progress.record is not None:
        write_json_atomic(run.out / "run.json", run.progress.record)
        run.progress.record = None  # once per start


def save_position(run: Run, epoch: int, tally: dict[str, Any]) -> None:
    """A mid-epoch checkpoint (``save_every``): the loader's position and the epoch's sums so far, the
    per-step log flushed first, so a run resumed from it continues exactly where this one stands."""
    run.steps.flush()
    rngs = gather_rng_states(run.device, run.world)
    state = run_state(run, epoch, rngs, metrics=None, tally=tally)
    if write_checkpoint(run, state, f"step-{run.step:09d}") is not None:
        prune_shards(run.out)
        write_record(run)


def save_epoch(run: Run, row: dict[str, Any]) -> None:
    """Checkpoint (every rank contributes its RNG state; rank 0 writes the file, every rank its shards under
    FSDP), the best checkpoint, the log files."""
    progress = run.progress
    rngs = gather_rng_states(run.device, run.world)
    if run.master:
        progress.rows.append(row)
    state = run_state(run, row["epoch"], rngs, metrics=row)
    last = write_checkpoint(run, state, f"epoch-{row['epoch']:04d}")
    if last is None:  # not rank 0
        return
    key = score_key(run.cfg)
    if key in row and (progress.best_top1 is None or row[key] > progress.best_top1):
        progress.best_top1 = row[key]
        copy_atomic(last, run.out / "best.pt")
    prune_shards(run.out)
    write_log(run.out, progress.rows)
    write_record(run)
    run.steps.scalars(run.step, {k: v for k, v in row.items() if k.startswith(("val_", "ema_", "train_"))})
