"""The training loop: one function, setup then loop (nanoGPT style), and evaluation.

``train(TrainConfig(...))`` trains a registered model on a dataset spec (``vitlab.data.load_dataset``) with
AdamW (no decay on norms, biases, tokens, position tables; fused on a GPU), a per-step warmup + cosine
schedule, gradient clipping, stochastic depth, optional Mixup/CutMix + label smoothing, an EMA of the
weights, autocast (bf16 on CPU or GPU, fp16 with a gradient scaler on GPU) and DeiT hard distillation from a
teacher checkpoint. Speed and memory options: ``compile`` (``torch.compile`` of the model),
``grad_checkpointing`` (every block's activations recomputed in the backward pass), ``tf32`` (GPU).

Run under ``torchrun`` (one machine or several: ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``) it trains
with DistributedDataParallel, or with ``fsdp`` sharded by FSDP2, one unit per block (gloo on CPU, NCCL on
GPU); ``batch_size`` is the global batch, split evenly over the processes (:mod:`vitlab.distributed`).

Determinism: the data order and augmentation are pure functions of ``(seed, epoch, rank, batch)``
(``BatchLoader``); everything else that carries state goes into the checkpoint written atomically after
every epoch (:mod:`.checkpointing`), so a run killed at any moment and resumed with ``resume="auto"`` ends
with the same weights, bit for bit, as one never interrupted (same processes, threads and hardware).

What a run writes into ``out``: ``last.pt`` and ``best.pt`` (best held-out top-1), ``log.json``/``log.csv``
(one row per epoch), ``steps.jsonl`` (one row per step: loss, learning rate, gradient norm, images/s,
memory; :class:`vitlab.tracking.StepLog`), ``tb/`` with ``tensorboard``, ``summary.json``, and for a
sharded run ``shards/``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint import check_image_classifier, check_model_name, load_checkpoint
from ..data import BatchLoader, MixupCutmix, derive_seed, load_dataset, make_transform, soft_target_cross_entropy
from ..device import AMP_CHOICES, amp_dtype, autocast, device_memory, grad_scaler, resolve_device, set_tf32
from ..distributed import World, all_reduce_sum, barrier, init_distributed, parallelize
from ..io import write_json_atomic
from ..optim import WarmupCosine, create_optimizer
from ..rundir import check_free_space, checkpoint_bytes, own_folder
from ..runtime import is_out_of_memory as is_oom
from ..tracking import StepLog, memory_probe
from .checkpointing import check_resume, open_checkpoint, restore, save_epoch
from .config import OPTION_CHECKS, RUN_FILES, Run, TrainConfig, TrainingError
from .ema import ModelEma

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


def class_targets(y: Tensor) -> Tensor:
    return y.argmax(-1) if y.is_floating_point() else y


def local_value(t: Tensor) -> Tensor:
    """A tensor FSDP returns as a replicated ``DTensor`` (the gradient norm) as a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: nn.Module, loader: BatchLoader, device: torch.device, dtype: torch.dtype | None = None) -> dict:
    """Top-1 / top-5 accuracy (%), mean cross-entropy and throughput (img/s) over ``loader`` (the sums stay on
    the device until the end: one synchronisation)."""
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
    return {"loss": loss / n, "top1": 100 * c1 / n, "top5": 100 * c5 / n, "n": n, "img_s": n / seconds}


# --------------------------------------------------------------------------- data and model


def load_data(cfg: TrainConfig, split: str):
    try:
        return load_dataset(cfg.data, split, img_size=cfg.img_size, holdout=cfg.holdout)
    except ImportError as e:
        raise TrainingError(str(e)) from None
    except (EOFError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise TrainingError(f"cannot read dataset {cfg.data!r} ({e}); check or re-create its files") from None


def model_kwargs(cfg: TrainConfig, train_ds) -> dict[str, Any]:
    kw = dict(
        img_size=cfg.img_size or int(train_ds.img_size[0]),
        in_chans=int(train_ds.in_chans),
        num_classes=int(train_ds.num_classes),
        **cfg.model_args,
    )
    if cfg.drop_path > 0:
        kw["drop_path_rate"] = cfg.drop_path
    if cfg.dist_token:
        kw["dist_token"] = True
    return kw


def init_weights_from(model: nn.Module, path: str) -> str:
    """``--init-from``: copy what fits from a checkpoint (vitlab's own, or official/timm ones that
    ``vitlab.convert`` reads); a DeiT checkpoint into an AFT model is the AFT paper's transfer. One line back."""
    from ..convert import init_from

    try:
        ckpt = load_checkpoint(path)
    except ValueError:
        ckpt = None  # another format: vitlab.convert reads it (weights_only / safetensors)
    if ckpt is not None:
        check_image_classifier(ckpt)  # a sequence model's tensors are no start for an image model
    report = init_from(model, path if ckpt is None else ckpt["model"])
    if not report.matched:
        raise TrainingError(f"--init-from {path}: no tensor fits {type(model).__name__} ({report.problems()})")
    return f"initialised {len(report.matched)} tensors from {path} (not taken: {report.problems()})"


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
            check_free_space(run.out, checkpoint_bytes(run.raw.state_dict(), 3 if run.ema is None else 4))
            start_over()
        run.model.train()
        try:
            for epoch in range(run.start_epoch, cfg.epochs):
                row = train_epoch(run, epoch)
                if run.evaluates:
                    row.update(evaluate_epoch(run))
                row["elapsed_s"] = time.perf_counter() - run.t_start
                save_epoch(run, row)
                report_epoch(run, row)
        finally:
            run.steps.close()
        return finish(run)


def setup(cfg: TrainConfig, log: Callable[[str], None], world: World, device: torch.device, t_start: float) -> Run:
    """Resume checkpoint, data, model and optimizer state; the model spread over the processes."""
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    steps = StepLog(cfg.out if world.main else None, cfg.log_every, cfg.tensorboard, memory_probe(device))
    run = Run(cfg, log if world.main else (lambda line: None), world, device, None, Path(cfg.out), t_start, steps)
    run.dtype = amp_dtype(cfg.amp, device)
    ckpt = open_checkpoint(run)
    setup_data(run)
    setup_model(run, ckpt)
    if ckpt is not None:
        restore(run, ckpt)
    del ckpt
    n_params = sum(p.numel() for p in run.raw.parameters())
    how = f" on {world.size} processes ({'FSDP' if cfg.fsdp else 'DDP'})" if world.size > 1 else ""
    extras = [f"autocast {run.dtype}" if run.dtype else "", "compiled" * cfg.compile]
    extras += ["gradient checkpointing" * cfg.grad_checkpointing, "TF32" * (cfg.tf32 and device.type == "cuda")]
    run.log(
        f"{cfg.model}: {n_params / 1e6:.3f}M parameters, {len(run.train_ds)} train / {len(run.val_ds)} held-out "
        f"images at {run.kwargs['img_size']}px, {cfg.epochs} epochs x {len(run.loader)} steps of {cfg.batch_size}"
        f"{how}, {device}{''.join(', ' + e for e in extras if e)}"
    )
    return run


def setup_data(run: Run) -> None:
    """The training subset, the held-out set, their transforms and the per-rank loaders."""
    cfg = run.cfg
    if cfg.batch_size % run.world.size:
        raise TrainingError(f"the global batch {cfg.batch_size} must be divisible by the {run.world.size} processes")
    train_ds, val_ds = load_data(cfg, "train"), load_data(cfg, "test")
    if cfg.train_limit:
        pick = torch.randperm(len(train_ds), generator=torch.Generator().manual_seed(cfg.seed))[: cfg.train_limit]
        train_ds = train_ds.subset(pick.sort().values)  # a seeded random subset (the data may be sorted by class)
    warn_one_class(train_ds)
    if cfg.batch_size > len(train_ds):
        raise TrainingError(
            f"batch size {cfg.batch_size} exceeds the {len(train_ds)} training images; use a smaller --batch-size"
        )
    img_size = cfg.img_size or int(train_ds.img_size[0])
    digits = train_ds.num_classes == 10 and train_ds.in_chans == 1
    hflip = cfg.hflip if cfg.hflip is not None else (0.0 if digits else 0.5)
    aug = dict(crop_padding=cfg.crop_padding or None, hflip=hflip, auto_augment=cfg.auto_augment)
    train_tf = make_transform(True, img_size, train_ds.mean, train_ds.std, **aug)
    mix = None
    if cfg.mixup > 0 or cfg.cutmix > 0:
        mix = MixupCutmix(cfg.mixup, cfg.cutmix, label_smoothing=cfg.smoothing, num_classes=train_ds.num_classes)
    shard = dict(seed=cfg.seed, rank=run.world.rank, world_size=run.world.size, mix=mix, device=run.device)
    run.loader = BatchLoader(train_ds, run.per_rank, shuffle=True, drop_last=True, transform=train_tf, **shard)
    eval_tf = make_transform(False, img_size, val_ds.mean, val_ds.std)
    run.val_loader = BatchLoader(val_ds, cfg.eval_batch_size, shuffle=False, transform=eval_tf, device=run.device)
    if len(run.loader) == 0:
        raise TrainingError(
            f"no full batch of {run.per_rank} per process in {len(train_ds)} images; use a smaller --batch-size"
        )
    run.train_ds, run.val_ds = train_ds, val_ds


def warn_one_class(train_ds) -> None:
    """A warning when every training image has the same label: the model then learns to answer that class
    whatever it sees (the training loss goes to 0 and says nothing)."""
    labels = torch.unique(train_ds.labels)
    if len(labels) == 1:
        warnings.warn(
            f"all {len(train_ds)} training images are of one class (label {labels.item()}): the model can only "
            "learn to predict it; use more data (a larger --train-limit) or data with several classes",
            stacklevel=2,
        )


def setup_model(run: Run, ckpt: dict[str, Any] | None) -> None:
    """Model (identical initial weights on every rank), teacher, the model spread over the processes (DDP,
    or FSDP before the optimizer sees its parameters), optimizer, schedule, EMA, scaler."""
    from ..models import create_model

    cfg = run.cfg
    run.kwargs = model_kwargs(cfg, run.train_ds)
    if ckpt is not None:
        check_model_name(ckpt, cfg.model)
        check_resume(ckpt, cfg, run.log)
    torch.manual_seed(cfg.seed)
    model = create_model(cfg.model, **run.kwargs)
    if cfg.init_from and ckpt is None:
        run.log(init_weights_from(model, cfg.init_from))
    if cfg.grad_checkpointing:
        if not hasattr(model, "set_grad_checkpointing"):
            raise TrainingError(f"{cfg.model} cannot recompute its blocks (no set_grad_checkpointing); drop the flag")
        model.set_grad_checkpointing(True)
    model.to(run.device)
    if cfg.teacher:
        from .distill import HardDistillationLoss, load_teacher

        run.criterion = HardDistillationLoss(load_teacher(cfg.teacher, run.device), cfg.smoothing)
        run.criterion.check_student(model, run.train_ds.in_chans)
        model.distilled_training = True
    run.raw = model
    run.model = parallelize(model, run.device, run.world, cfg.fsdp)
    if cfg.compile:
        run.model = torch.compile(run.model)
    run.optimizer = create_optimizer(model, cfg.lr, cfg.weight_decay)
    steps = len(run.loader)
    run.sched = WarmupCosine(run.optimizer, cfg.lr, cfg.epochs * steps, round(cfg.warmup_epochs * steps), cfg.min_lr)
    run.ema = ModelEma(model, cfg.ema) if cfg.ema > 0 else None
    run.scaler = grad_scaler(run.device, run.dtype)
    torch.manual_seed(derive_seed(cfg.seed, run.world.rank))  # dropout / drop-path streams, one per rank


def train_step(run: Run, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One optimisation step; returns (the loss, the class logits, the gradient norm before clipping)."""
    cfg, optimizer, scaler = run.cfg, run.optimizer, run.scaler
    try:
        with autocast(run.device, run.dtype):
            outputs = run.model(x)
            if run.criterion is not None:
                loss = run.criterion(x, outputs, y)
            else:
                loss = soft_target_cross_entropy(outputs, y, cfg.smoothing)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # the norm and the clip see the true gradients (no-op without fp16)
        params = [p for p in run.raw.parameters() if p.grad is not None]
        if cfg.clip_grad > 0:
            norm = nn.utils.clip_grad_norm_(params, cfg.clip_grad)
        else:
            norm = nn.utils.get_total_norm([p.grad for p in params])
        scaler.step(optimizer)
        scaler.update()
    except RuntimeError as e:
        if is_oom(e):
            raise TrainingError(
                f"a batch of {run.per_rank} images does not fit in memory ({str(e).splitlines()[0][:120]}); "
                "use a smaller --batch-size (or --grad-checkpointing)"
            ) from None
        raise
    run.sched.step()
    run.step += 1
    if run.ema is not None:
        run.ema.update(run.raw)
    return loss, outputs[0] if isinstance(outputs, tuple) else outputs, local_value(norm)


def train_epoch(run: Run, epoch: int) -> dict[str, Any]:
    """One pass over the training data; the epoch's row of the log (loss, accuracy, speed over all ranks).
    Every step's loss, learning rate and gradient norm go to the per-step log."""
    from ..tracking import Progress

    cfg, device, steps = run.cfg, run.device, len(run.loader)
    run.loader.set_epoch(epoch)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = 0
    progress = Progress(cfg.epochs * steps, epoch * steps, run.log, cfg.progress and run.master, cfg.progress_every)
    progress.start(f"epoch {epoch + 1}/{cfg.epochs}", steps)
    run.steps.restart_clock()  # images/s counts training only (not setup, evaluation, checkpoints)
    t0 = time.perf_counter()
    for x, y in run.loader:
        lr = run.optimizer.param_groups[0]["lr"]
        loss, logits, norm = train_step(run, x, y)
        loss_sum += loss.detach().float() * len(x)
        correct += (logits.argmax(-1) == class_targets(y)).sum()
        seen += len(x)
        step_loss = all_reduce_sum(loss.detach().float().clone(), run.world) / run.world.size
        scalars = {"_names": ("loss", "grad_norm"), "epoch": epoch + 1, "lr": lr}
        run.steps.add(run.step, len(x) * run.world.size, scalars, torch.stack([step_loss, norm.float()]))
        status = None
        if progress.wants_status():
            status = f"loss {loss_sum.item() / seen:.3f} acc {100 * correct.item() / seen:.1f}%"
        progress.update(len(x) * run.world.size, status)
    progress.close()
    run.steps.flush()
    train_time = time.perf_counter() - t0  # the flush above waited for the device
    stats = all_reduce_sum(
        torch.stack([loss_sum, correct.float(), torch.tensor(float(seen), device=device)]), run.world
    )
    train_loss = (stats[0] / stats[2]).item()
    if not math.isfinite(train_loss):
        raise TrainingError(f"the training loss became {train_loss} in epoch {epoch + 1}; lower --lr or use --amp none")
    return {
        "epoch": epoch + 1,
        "step": run.step,
        "lr": run.optimizer.param_groups[0]["lr"],
        "train_loss": train_loss,
        "train_acc": (100 * stats[1] / stats[2]).item(),
        "train_img_s": stats[2].item() / train_time,
        "train_time_s": train_time,
    }


def evaluate_epoch(run: Run) -> dict[str, Any]:
    """Held-out top-1/top-5 of the model (and of its EMA); a sharded model evaluates on every rank."""
    model = run.model if run.cfg.fsdp else run.raw  # FSDP's forward gathers the shards; the others run whole
    ev = evaluate(model, run.val_loader, run.device, run.dtype)
    row = {"val_loss": ev["loss"], "val_top1": ev["top1"], "val_top5": ev["top5"], "eval_img_s": ev["img_s"]}
    if run.ema is not None:
        ev_ema = evaluate(run.ema.module, run.val_loader, run.device, run.dtype)
        row.update(ema_top1=ev_ema["top1"], ema_top5=ev_ema["top5"])
    return row


def report_epoch(run: Run, row: dict[str, Any]) -> None:
    """The epoch's line."""
    if not run.master:
        return
    ema_txt = f"  ema {row['ema_top1']:.2f}%" if run.ema is not None else ""
    best = "  (best)" * (row.get("val_top1") == run.best_top1)
    run.log(
        f"epoch {row['epoch']}/{run.cfg.epochs}  loss {row['train_loss']:.4f}  train {row['train_acc']:.1f}%  "
        f"held-out {row['val_top1']:.2f}% (top-5 {row['val_top5']:.1f}%){ema_txt}{best}  lr {row['lr']:.2e}  "
        f"{row['train_img_s']:.0f} img/s  {row['train_time_s']:.1f} s"
    )


def finish(run: Run) -> dict[str, Any]:
    """The run's summary (rank 0; empty elsewhere), written to ``OUT/summary.json`` and returned with the log."""
    summary: dict[str, Any] = {}
    if run.master:
        rows = run.rows
        train_s = sum(r["train_time_s"] for r in rows)
        best = max(rows, key=lambda r: r.get("val_top1", -1.0)) if rows else {}
        summary = {
            "model": run.cfg.model,
            "params": sum(p.numel() for p in run.raw.parameters()),
            "epochs": run.cfg.epochs,
            "world_size": run.world.size,
            "final": rows[-1] if rows else {},
            "best": {
                "epoch": best.get("epoch"),
                "val_top1": best.get("val_top1"),
                "checkpoint": str(run.out / "best.pt"),
            },
            "train_img_s": sum(r["train_img_s"] * r["train_time_s"] for r in rows) / max(train_s, 1e-9),
            "train_time_s": train_s,
            "wall_s": time.perf_counter() - run.t_start,
            "checkpoint": str(run.out / "last.pt"),
        }
        if (mem := device_memory(run.device)) is not None:  # the host RSS says little about a GPU run
            summary["cuda_peak_mib"] = mem["peak"] / 2**20
        write_json_atomic(run.out / "summary.json", summary)
        summary["log"] = list(rows)
    barrier(run.world)
    return summary
