"""A training run's checkpoints: what goes in, how a run continues from one, and the best one.

After every epoch ``OUT/last.pt`` holds everything that carries state (weights, optimizer, schedule, EMA,
gradient scaler, every process's RNG streams, the log rows so far), written atomically, so a run killed at
any moment and resumed ends with the same weights, bit for bit, as one never interrupted (same number of
processes, thread count and hardware). ``OUT/best.pt`` is the checkpoint of the epoch with the best
held-out top-1 so far (a hard link to that epoch's ``last.pt`` where the file system allows).

The file layer at the end of this module is the same for ``vitlab train`` and ``vitlab lm train``.
:func:`write_run_checkpoint` is collective: every rank calls it. Without sharding the run's state, weights
and optimizer state included, goes into one file written by rank 0 (:func:`vitlab.checkpoint.save_checkpoint`).
A sharded run (FSDP) keeps its weights and optimizer state out of the file: every rank writes its part into
``shards/<name>`` beside it through ``torch.distributed.checkpoint`` (:mod:`vitlab.checkpoint.sharded`), and
the file records that folder with ``model`` and ``optimizer`` None. The file is written last, so it is the
commit point: a run killed while the shards are written still has its previous checkpoint. A resumed run loads
the weights and optimizer state back, re-sliced for its own number of processes (one included), with
:func:`restore_optimization`. Every rank's RNG streams are saved (:func:`gather_rng_states`) and continue where
the number of processes is unchanged, bit-identically (:func:`restore_rng_streams`); elsewhere the run says so
and starts fresh streams.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..checkpoint.format import save_checkpoint
from ..checkpoint.load import load_checkpoint, load_state_checked, shard_folder
from ..checkpoint.sharded import SHARDS, load_sharded, remove_unused_shards, save_sharded
from ..common.distributed import World, gather_objects
from ..common.io import copy_atomic, write_csv_atomic, write_json_atomic
from ..data import derive_seed
from .config import Context, Progress, Run, TrainConfig
from .ema import ModelEma
from .optim import Optimization
from .tasks import score_key

# options that define the run: resuming with another value cannot continue the same training
RESUME_FIXED = ("model", "model_args", "data", "img_size", "holdout", "train_limit", "batch_size", "dist_token", "seed")
RESUME_FIXED += ("fsdp", "accum_steps", "aug_repeats", "token_label", "dense_root", "task")
# options a resumed run may change (said in a note: it is then not the run that was started)
RESUME_NOTED = (
    "epochs",
    "lr",
    "min_lr",
    "warmup_epochs",
    "lr_drop",
    "weight_decay",
    "clip_grad",
    "drop_path",
    "smoothing",
)
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
    last = tally or (rows[-1] if rows else {})  # the run's wall time up to its checkpoint
    return Progress(epoch, step, rows, best, ckpt.get("loader"), tally, elapsed_before=last.get("elapsed_s", 0.0))


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
    state = run_state(run, epoch, rngs, metrics=None, tally={**tally, "elapsed_s": run.elapsed()})
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


# the run checkpoint's file layer (also ``vitlab lm train``'s)


def write_run_checkpoint(
    path: str | Path,
    state: dict[str, Any],
    world: World,
    sharded: str | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path | None:
    """A training run's checkpoint at ``path`` (collective: every rank calls it; rank 0 writes the file and
    gets its path back, the others None).

    Without ``sharded``, ``state`` (weights and optimizer state included) goes into the one file. With it,
    ``model`` and ``optimizer`` are written by every rank through ``torch.distributed.checkpoint`` into the
    folder ``shards/<sharded>`` beside ``path``, and the file records that folder instead of the tensors
    (:func:`prune_shards` then removes the shard folders no checkpoint file points to any more)."""
    path = Path(path)
    if sharded is not None:
        save_sharded(path.parent / SHARDS / sharded, model, optimizer, world)
        state = {**state, "model": None, "optimizer": None, "sharded": f"{SHARDS}/{sharded}"}
    if not world.main:
        return None
    save_checkpoint(state, path)
    return path


def prune_shards(folder: str | Path) -> None:
    """Remove the shard folders in ``folder/shards`` that no checkpoint file of ``folder`` points to."""
    folder = Path(folder)
    if not (folder / SHARDS).is_dir():
        return
    pointed = []
    for file in folder.glob("*.pt"):
        try:
            pointed.append(load_checkpoint(file, weights=False).get("sharded") or "")
        except (ValueError, FileNotFoundError):
            continue
    remove_unused_shards(folder, pointed)


def restore_weights_and_optimizer(ckpt: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a run's checkpoint into ``model`` and ``optimizer``: from the file, or from its shards, re-sliced
    for this run's processes or whole (collective under FSDP)."""
    if ckpt.get("sharded"):
        load_sharded(shard_folder(ckpt), model, optimizer)
    else:
        load_state_checked(model, ckpt["model"], f"checkpoint {ckpt['path']}")
        optimizer.load_state_dict(ckpt["optimizer"])


def optimization_state(model: nn.Module, opt: Optimization, sharded: bool) -> dict[str, Any]:
    """The checkpoint entries of the weights and the optimization (``model`` and ``optimizer`` None when the
    run is sharded: :func:`write_run_checkpoint` writes them as shards)."""
    return {
        "model": None if sharded else model.state_dict(),
        "optimizer": None if sharded else opt.optimizer.state_dict(),
        "scheduler": opt.sched.state_dict(),
        "scaler": opt.scaler.state_dict(),
    }


def restore_optimization(ckpt: dict[str, Any], model: nn.Module, opt: Optimization) -> None:
    """The weights, optimizer state, schedule and gradient scaler a checkpoint holds, loaded in place."""
    restore_weights_and_optimizer(ckpt, model, opt.optimizer)
    opt.sched.load_state_dict(ckpt["scheduler"])
    if ckpt.get("scaler"):
        opt.scaler.load_state_dict(ckpt["scaler"])


# --------------------------------------------------------------------------- random streams


def rng_state(device: torch.device) -> dict[str, Tensor | None]:
    """This process's torch RNG state (and its GPU's)."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict[str, Tensor | None] | Tensor, device: torch.device) -> None:
    """Set what :func:`rng_state` returned (or a bare CPU state, as ``vitlab lm train`` wrote before)."""
    state = {"torch": state} if isinstance(state, Tensor) else state
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_rng_states(device: torch.device, world: World) -> list[dict[str, Tensor | None]]:
    """Every rank's RNG state, in rank order (collective: every rank calls it)."""
    return gather_objects(rng_state(device), world)


def restore_rng_streams(states: Any, world: World, device: torch.device) -> bool:
    """Continue this rank's RNG stream from :func:`gather_rng_states`' list; False (nothing set) when the
    checkpoint was written by another number of processes, whose streams cannot be dealt out again."""
    states = [states] if isinstance(states, Tensor) else list(states or [])  # one bare state: older lm files
    if len(states) != world.size:
        return False
    set_rng_state(states[world.rank], device)
    return True
