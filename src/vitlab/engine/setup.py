"""The setup of a training run: a sequence of steps, each returning its pieces, assembled once into a :class:`Run`.

:func:`setup` is the one place the steps meet, in the order their data flows: the checkpoint to resume
(checked before anything is built), the data, the model (its input shape and classes come from the data),
the loaders (the model's patch size decides MixToken's grid), the optimization (the schedule's length comes
from the loader), then the resumed progress (it fills the optimization's state). The random streams are drawn
in this order too: the model's initialisation is seeded first, every rank's dropout stream after the
optimizer, and a resumed run's streams last.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import check_image_classifier, check_model_name, load_checkpoint
from ..common.device import amp_dtype
from ..common.distributed import World, parallelize
from ..data import BatchLoader, derive_seed
from .checkpointing import check_resume, open_checkpoint, restore
from .config import Context, ModelParts, Progress, Run, RunData, TrainConfig, TrainingError
from .data import build_loaders, data_shape, open_data
from .ema import ModelEma
from .losses import make_criterion
from .optim import Optimization, build_optimization
from .tasks import task_hooks
from .tracking import StepLog, memory_probe


def setup(cfg: TrainConfig, log: Callable[[str], None], world: World, device: torch.device, t_start: float) -> Run:
    """Resume checkpoint, data, model, loaders, optimization and progress; the model spread over the processes."""
    if cfg.auto_threads > 0:
        torch.set_num_threads(cfg.auto_threads)
    ctx = Context(
        cfg,
        log if world.main else (lambda line: None),
        world,
        device,
        amp_dtype(cfg.amp, device),
        Path(cfg.out),
        t_start,
        StepLog(cfg.out if world.main else None, cfg.log_every, cfg.tensorboard, memory_probe(device)),
    )
    ckpt = open_checkpoint(cfg, ctx.out)
    train_ds, val_ds = open_run_data(ctx)
    warn_one_class(train_ds)
    net = setup_model(ctx, train_ds, ckpt)
    data = build_run_loaders(ctx, train_ds, val_ds, net)
    opt, ema = setup_optimizer(ctx, net.raw, steps_per_epoch(cfg, data.loader))
    progress = restore(ctx, ckpt, net.raw, opt, ema) if ckpt is not None else Progress()
    del ckpt
    run = Run(**vars(ctx), data=data, net=net, opt=opt, ema=ema, progress=progress)
    run.log(describe(run))
    return run


def describe(run: Run) -> str:
    """The run's first line: model size, data, schedule, how it is spread and sped up."""
    cfg, device, world = run.cfg, run.device, run.world
    n_params = sum(p.numel() for p in run.net.raw.parameters())
    how = f" on {world.size} processes ({'FSDP' if cfg.fsdp else 'DDP'})" if world.size > 1 else ""
    extras = [f"autocast {run.dtype}" if run.dtype else "", "compiled" * cfg.compile]
    extras += ["gradient checkpointing" * cfg.grad_checkpointing, "TF32" * (cfg.tf32 and device.type == "cuda")]
    return (
        f"{cfg.model}: {n_params / 1e6:.3f}M parameters, {len(run.data.train_ds)} train / {len(run.data.val_ds)} "
        f"held-out {'images at ' + str(run.net.kwargs['img_size']) + 'px' if 'img_size' in run.net.kwargs else 'samples'}, "
        f"{cfg.epochs} epochs x "
        f"{steps_per_epoch(cfg, run.data.loader)} steps of {cfg.global_batch} (lr {cfg.peak_lr:.3g}){how}, "
        f"{device}{''.join(', ' + e for e in extras if e)}"
    )


# --------------------------------------------------------------------------- data


@dataclass
class _DataDraft:
    """What :func:`vitlab.engine.data.open_data` and :func:`~vitlab.engine.data.build_loaders` read and fill:
    they take the object to fill, so each step below hands them a fresh draft and returns what they put in
    it (nothing else sees the draft)."""

    cfg: TrainConfig
    world: World
    device: torch.device
    train_ds: Any = None
    val_ds: Any = None
    kwargs: dict[str, Any] | None = None
    raw: nn.Module | None = None
    loader: BatchLoader | None = None
    val_loader: BatchLoader | None = None
    data_cfg: dict[str, Any] | None = None

    @property
    def per_rank(self) -> int:
        return self.cfg.batch_size // self.world.size


def open_run_data(ctx: Context) -> tuple[Any, Any]:
    """(training subset, held-out set): nothing decoded yet for streaming sources."""
    draft = _DataDraft(ctx.cfg, ctx.world, ctx.device)
    task = task_hooks(ctx.cfg)
    (task.open_data if task is not None else open_data)(draft)
    return draft.train_ds, draft.val_ds


def build_run_loaders(ctx: Context, train_ds: Any, val_ds: Any, net: ModelParts) -> RunData:
    """This rank's training loader and the held-out loader, with the evaluation data configuration."""
    draft = _DataDraft(ctx.cfg, ctx.world, ctx.device, train_ds, val_ds, net.kwargs, net.raw)
    task = task_hooks(ctx.cfg)
    (task.build_loaders if task is not None else build_loaders)(draft)
    return RunData(train_ds, val_ds, draft.loader, draft.val_loader, draft.data_cfg)


def warn_one_class(train_ds: Any) -> None:
    """A warning when every training image has the same label: the model then learns to answer that class
    whatever it sees (the training loss goes to 0 and says nothing)."""
    if not hasattr(train_ds, "labels"):  # shard streams: the labels are inside the shards
        return
    labels = torch.unique(train_ds.labels)
    if len(labels) == 1:
        warnings.warn(
            f"all {len(train_ds)} training images are of one class (label {labels.item()}): the model can only "
            "learn to predict it; use more data (a larger --train-limit) or data with several classes",
            stacklevel=2,
        )


# --------------------------------------------------------------------------- model


def model_kwargs(cfg: TrainConfig, train_ds: Any) -> dict[str, Any]:
    """The model's constructor options: the data's input shape and classes, then ``model_args`` and the flags."""
    kw = dict(**data_shape(cfg, train_ds), **cfg.model_args)
    if cfg.drop_path > 0:
        kw["drop_path_rate"] = cfg.drop_path
    if cfg.dist_token:
        kw["dist_token"] = True
    return kw


def init_weights_from(model: nn.Module, path: str) -> str:
    """``--init-from``: copy what fits from a checkpoint (vitlab's own, or official/timm ones that
    ``vitlab.interop`` reads); a DeiT checkpoint into an AFT model is the AFT paper's transfer; a model with
    ``init_target()`` (a detector) initialises that part (its backbone). One line back."""
    from ..interop import init_from

    try:
        ckpt = load_checkpoint(path)
    except ValueError:
        ckpt = None  # another format: vitlab.interop reads it (weights_only / safetensors)
    if ckpt is not None:
        check_image_classifier(ckpt)  # a sequence model's tensors are no start for an image model
    target = model.init_target() if hasattr(model, "init_target") else model  # a detector: its backbone
    report = init_from(target, path if ckpt is None else ckpt["model"])
    if not report.matched:
        raise TrainingError(f"--init-from {path}: no tensor fits {type(target).__name__} ({report.problems()})")
    return f"initialised {len(report.matched)} tensors from {path} (not taken: {report.problems()})"


def setup_model(ctx: Context, train_ds: Any, ckpt: dict[str, Any] | None) -> ModelParts:
    """Model (identical initial weights on every rank), its loss (teacher, token labels), the model spread
    over the processes (DDP, or FSDP before the optimizer sees its parameters)."""
    from ..models import build_model

    cfg, task = ctx.cfg, task_hooks(ctx.cfg)
    kwargs = task.model_kwargs(cfg, train_ds) if task is not None else model_kwargs(cfg, train_ds)
    if ckpt is not None:
        check_model_name(ckpt, cfg.model)
        check_resume(ckpt, cfg, ctx.log)
    torch.manual_seed(cfg.seed)
    model = task.build_model(cfg.model, kwargs) if task is not None else build_model(cfg.model, **kwargs)
    if cfg.init_from and ckpt is None:
        ctx.log(init_weights_from(model, cfg.init_from))
    if cfg.grad_checkpointing:
        if not hasattr(model, "set_grad_checkpointing"):
            raise TrainingError(f"{cfg.model} cannot recompute its blocks (no set_grad_checkpointing); drop the flag")
        model.set_grad_checkpointing(True)
    if cfg.fsdp and getattr(model, "regularization_loss", lambda: None)() is not None:
        raise TrainingError(
            f"{cfg.model} adds a penalty on its parameters to the loss, computed outside the forward pass where "
            "FSDP keeps them sharded; train it with DDP (drop --fsdp)"
        )
    model.to(ctx.device)
    if task is not None:
        criterion = task.criterion(cfg, model)
    else:
        criterion = make_criterion(cfg, model, kwargs["in_chans"], ctx.device)
    spread = parallelize(model, ctx.device, ctx.world, cfg.fsdp)
    if cfg.compile:
        # static shapes: one graph per input shape (training drops its last short batch; evaluation adds at most
        # one more). Symbolic sizes give slower kernels, and inductor failed on them on CUDA (torch 2.11).
        spread = torch.compile(spread, dynamic=False)
    return ModelParts(model, spread, kwargs, criterion)


# --------------------------------------------------------------------------- optimization


def steps_per_epoch(cfg: TrainConfig, loader: BatchLoader) -> int:
    """Optimizer steps per epoch: the loader's batches in groups of ``accum_steps`` (the last may be short)."""
    return math.ceil(len(loader) / cfg.accum_steps)


def setup_optimizer(ctx: Context, model: nn.Module, steps: int) -> tuple[Optimization, ModelEma | None]:
    """Optimizer at the peak learning rate (scaled by the global batch with ``base_lr``), schedule over
    ``steps`` per epoch, scaler; the EMA; then every rank's own dropout / drop-path stream."""
    cfg = ctx.cfg
    total = cfg.epochs * steps
    warmup = min(round(cfg.warmup_epochs * steps), total)  # a paper recipe's warmup in a shorter run: all warmup
    drop = None if cfg.lr_drop is None else round(cfg.lr_drop * steps)
    opt = build_optimization(model, cfg.peak_lr, cfg.weight_decay, total, warmup, cfg.min_lr, ctx.device, ctx.dtype,
                             drop)  # fmt: skip
    ema = ModelEma(model, cfg.ema) if cfg.ema > 0 else None
    torch.manual_seed(derive_seed(cfg.seed, ctx.world.rank))  # dropout / drop-path streams, one per rank
    return opt, ema
