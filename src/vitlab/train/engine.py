"""The training loop: one function, setup then loop (nanoGPT style), and evaluation.

``train(TrainConfig(...))`` trains a registered model on a dataset spec (``vitlab.data.load_dataset``) with
AdamW (no decay on norms, biases, tokens, position tables), a per-step warmup + cosine schedule, gradient
clipping, stochastic depth, optional Mixup/CutMix + label smoothing, an EMA of the weights, autocast
(bf16 on CPU, fp16 with a gradient scaler on CUDA) and DeiT hard distillation from a teacher checkpoint.

Determinism: the data order and augmentation are pure functions of ``(seed, epoch, rank, batch)``
(``BatchLoader``); everything else that carries state (model, optimizer, schedule, EMA, scaler, the torch
RNGs that drive dropout and stochastic depth) goes into the checkpoint written atomically after every
epoch, so a run killed at any moment and resumed with ``resume="auto"`` ends with the same weights, bit for
bit, as one never interrupted (same thread count and hardware).

Run under ``torchrun --nproc_per_node=N`` it trains with DistributedDataParallel (gloo on CPU, NCCL on
GPU); ``batch_size`` is the global batch, split evenly over the ranks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .. import options as opt
from ..checkpoint import check_image_classifier, check_model_name, load_checkpoint, load_state_checked, save_checkpoint
from ..data import BatchLoader, MixupCutmix, derive_seed, load_dataset, make_transform, soft_target_cross_entropy
from ..data.augment import RandAugment
from ..data.datasets import data_spec
from ..io import write_csv_atomic, write_json_atomic
from ..models import get_config
from ..optim import WarmupCosine, create_optimizer
from ..rundir import RunLock, check_free_space, checkpoint_bytes
from ..runtime import is_out_of_memory as is_oom
from ..runtime import resolve_device
from .ema import ModelEma

AMP_CHOICES = ("auto", "none", "bf16", "fp16")


class TrainingError(ValueError):
    """Something the user can fix (options, files, memory): the CLI prints it as one line."""


@dataclass
class TrainConfig:
    model: str = "deit_mini"
    model_args: dict[str, Any] = field(default_factory=dict)  # constructor overrides, e.g. {"patch_size": 7}
    data: str = "mnist"
    out: str = "runs/train"
    epochs: int = 10
    batch_size: int = 128  # global batch (split over DDP ranks)
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_epochs: float = 1.0
    weight_decay: float = 0.05
    clip_grad: float = 1.0  # max gradient norm; 0 = off
    drop_path: float = 0.1  # stochastic depth rate of the last block (linear rule)
    smoothing: float = 0.1
    mixup: float = 0.0
    cutmix: float = 0.0
    ema: float = 0.0  # EMA decay; 0 = no EMA
    amp: str = "auto"  # auto: fp16 + scaler on CUDA, off on CPU; bf16: autocast to bfloat16
    seed: int = 0
    threads: int = 2  # torch.set_num_threads per process; 0 = torch's default
    device: str = "auto"
    img_size: int | None = None  # default: the dataset's
    holdout: int | None = None  # held-out images of the embedded MNIST (default 1000)
    train_limit: int | None = None  # train on a seeded random N of the training images (quick runs)
    crop_padding: int = 2
    hflip: float | None = None  # default: 0 for digits, 0.5 otherwise
    auto_augment: str | None = None  # e.g. "rand-m9-n2-mstd0.5"
    teacher: str | None = None  # checkpoint of a teacher: DeiT hard distillation (needs dist_token)
    dist_token: bool = False
    init_from: str | None = None  # initialise the weights from another checkpoint
    resume: str | None = None  # "auto" = OUT/last.pt, or a checkpoint path
    force: bool = False  # start over even if OUT holds a checkpoint
    eval_batch_size: int = 256
    progress: bool = True

    def __post_init__(self) -> None:
        if self.amp not in AMP_CHOICES:
            raise TrainingError(f"amp must be one of {AMP_CHOICES}, got {self.amp!r}")
        for name, check in OPTION_CHECKS.items():  # the ranges the command line checks while parsing
            value = getattr(self, name)
            if value is not None:
                try:
                    check.check(value, "--" + name.replace("_", "-"))
                except ValueError as e:
                    raise TrainingError(str(e)) from None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _registered_model(name: str) -> str:
    get_config(name)  # ValueError naming the closest registered names
    return name


def _rand_augment_spec(spec: str) -> str:
    RandAugment.from_spec(spec)  # ValueError saying what is wrong with it
    return spec


# the range of every option of TrainConfig that has one: the argparse types of `vitlab train` (checked while
# the command line is parsed, before any work) and TrainConfig's own check of values given in code
OPTION_CHECKS: dict[str, opt.Check] = {
    "model": opt.Validated(_registered_model, "a registered model name"),
    "data": data_spec,
    "epochs": opt.positive_int,
    "batch_size": opt.positive_int,
    "lr": opt.positive_float,
    "min_lr": opt.non_negative_float,
    "warmup_epochs": opt.non_negative_float,
    "weight_decay": opt.non_negative_float,
    "clip_grad": opt.non_negative_float,
    "drop_path": opt.rate,
    "smoothing": opt.rate,
    "mixup": opt.non_negative_float,
    "cutmix": opt.non_negative_float,
    "ema": opt.rate,
    "seed": opt.seed,
    "threads": opt.threads,
    "device": opt.device,
    "img_size": opt.image_size,
    "holdout": opt.positive_int,
    "train_limit": opt.positive_int,
    "crop_padding": opt.non_negative_int,
    "hflip": opt.probability,
    "auto_augment": opt.Validated(_rand_augment_spec, "a RandAugment spec"),
    "eval_batch_size": opt.positive_int,
}

# what a run writes into OUT: a folder holding any of them holds a run
RUN_FILES = ("last.pt", "log.json", "log.csv", "summary.json")
# options that define the run: resuming with another value cannot continue the same training
RESUME_FIXED = ("model", "model_args", "data", "img_size", "holdout", "train_limit", "batch_size", "dist_token", "seed")


# --------------------------------------------------------------------------- small helpers


def setup_device(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device); joins the process group when started by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    try:
        dev = resolve_device(device, local)
    except ValueError as e:
        raise TrainingError(str(e)) from None
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return rank, world, dev


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    if amp == "auto":
        return torch.float16 if device.type == "cuda" else None
    if amp == "fp16" and device.type != "cuda":
        raise TrainingError("fp16 autocast needs a GPU; use --amp bf16 on the CPU")
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def rng_state(device: torch.device) -> dict[str, Tensor | None]:
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict[str, Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def write_log(out: Path, rows: list[dict[str, Any]]) -> None:
    """The per-epoch log as JSON and CSV (rewritten each epoch, atomically)."""
    write_json_atomic(out / "log.json", rows)
    write_csv_atomic(out / "log.csv", rows)


def class_targets(y: Tensor) -> Tensor:
    return y.argmax(-1) if y.is_floating_point() else y


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: nn.Module, loader: BatchLoader, device: torch.device, dtype: torch.dtype | None = None) -> dict:
    """Top-1 / top-5 accuracy (%), mean cross-entropy and throughput (img/s) over ``loader``."""
    was_training = model.training
    model.eval()
    n, loss, c1, c5 = 0, 0.0, 0, 0
    t0 = time.perf_counter()
    for x, y in loader:
        with autocast(device, dtype):
            logits = model(x)
        logits = logits.float()
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        top = logits.topk(min(5, logits.shape[-1]), -1).indices
        c1 += int((top[:, 0] == y).sum())
        c5 += int((top == y[:, None]).any(-1).sum())
        n += len(y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    model.train(was_training)
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


def check_resume(ckpt: dict[str, Any], cfg: TrainConfig, log: Callable[[str], None]) -> None:
    old = ckpt.get("config", {})
    bad = [
        f"{k}={old.get(k)!r} (now {getattr(cfg, k)!r})" for k in RESUME_FIXED if k in old and old[k] != getattr(cfg, k)
    ]
    if bad:
        raise TrainingError(
            f"cannot resume from {ckpt['path']}: it was trained with {', '.join(bad)}; rerun with the same "
            "options or start afresh in another --out (or with --force)"
        )
    if ckpt["epoch"] >= cfg.epochs:
        raise TrainingError(
            f"{ckpt['path']} has already trained {ckpt['epoch']} of {cfg.epochs} epochs; pass --epochs > {ckpt['epoch']} to continue"
        )
    changed = [
        f"{k} {old[k]!r} -> {getattr(cfg, k)!r}"
        for k in (
            "epochs",
            "lr",
            "min_lr",
            "warmup_epochs",
            "weight_decay",
            "clip_grad",
            "drop_path",
            "smoothing",
            "mixup",
            "cutmix",
            "ema",
            "amp",
            "threads",
            "teacher",
        )
        if k in old and old[k] != getattr(cfg, k)
    ]
    if changed:
        log(f"note: resuming with changed options ({', '.join(changed)}): not the run that was started")


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


@dataclass
class Run:
    """Everything one training run holds between its steps."""

    cfg: TrainConfig
    log: Callable[[str], None]  # rank 0's progress lines (the other ranks' are dropped)
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype | None
    out: Path
    t_start: float
    train_ds: Any = None
    val_ds: Any = None
    loader: BatchLoader | None = None
    val_loader: BatchLoader | None = None
    model: nn.Module | None = None  # what the step calls: the DDP wrapper under torchrun
    raw: nn.Module | None = None  # the model itself (state dicts, EMA, evaluation)
    kwargs: dict[str, Any] = field(default_factory=dict)
    criterion: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    sched: WarmupCosine | None = None
    ema: ModelEma | None = None
    scaler: torch.amp.GradScaler | None = None
    start_epoch: int = 0
    step: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def per_rank(self) -> int:
        return self.cfg.batch_size // self.world


def print_line(line: str) -> None:
    print(line, flush=True)


def train(cfg: TrainConfig, log: Callable[[str], None] = print_line) -> dict[str, Any]:
    """Train as ``cfg`` says; ``log`` receives rank 0's progress lines. Returns the summary (also written to
    ``OUT/summary.json``) with the per-epoch ``log`` rows: everything a caller needs to report the run."""
    t_start = time.perf_counter()
    rank, world, device = setup_device(cfg.device)
    with own_out(cfg, rank, world, log) as start_over:
        run = setup(cfg, log, rank, world, device, t_start)
        if run.master:  # before the first write: room for a checkpoint, then the old run out of the way
            check_free_space(run.out, checkpoint_bytes(run.raw.state_dict(), 3 if run.ema is None else 4))
            start_over()
        run.model.train()
        for epoch in range(run.start_epoch, cfg.epochs):
            row = train_epoch(run, epoch)
            if run.master:
                row.update(evaluate_epoch(run))
            row["elapsed_s"] = time.perf_counter() - run.t_start
            save_epoch(run, row)
        return finish(run)


@contextlib.contextmanager
def own_out(cfg: TrainConfig, rank: int, world: int, log: Callable[[str], None]) -> Iterator[Callable[[], None]]:
    """Rank 0 owns OUT for the whole run (:class:`vitlab.rundir.RunLock`: a second writer is refused, a folder
    holding a run needs ``resume`` or ``force``); every rank learns the verdict, so none waits for a rank
    that stopped. Yields ``start_over``, which moves an old run's files aside (``force``)."""
    lock, error, old = None, None, []
    if rank == 0:
        try:
            lock = RunLock(cfg.out, "vitlab train", log)
            old = lock.check_fresh(RUN_FILES, resume=bool(cfg.resume), force=cfg.force)
        except ValueError as e:
            error = e
            if lock is not None:
                lock.release()
    verdict = [None if error is None else str(error)]
    if world > 1:
        dist.broadcast_object_list(verdict, src=0)
    if error is not None:
        raise error
    if verdict[0] is not None:
        raise TrainingError(verdict[0])
    try:
        yield lambda: lock.move_aside(old) if lock is not None and old else None
    finally:
        if lock is not None:
            lock.release()


def setup(
    cfg: TrainConfig, log: Callable[[str], None], rank: int, world: int, device: torch.device, t_start: float
) -> Run:
    """Output folder and resume checkpoint, data, model and optimizer state (the device is ``setup_device``'s)."""
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    run = Run(
        cfg,
        log if rank == 0 else (lambda line: None),
        rank,
        world,
        device,
        amp_dtype(cfg.amp, device),
        Path(cfg.out),
        t_start,
    )
    ckpt = open_checkpoint(run)
    setup_data(run)
    setup_model(run, ckpt)
    if ckpt is not None:
        restore(run, ckpt)
    del ckpt
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        run.model = nn.parallel.DistributedDataParallel(run.raw, device_ids=ids)
    n_params = sum(p.numel() for p in run.raw.parameters())
    run.log(
        f"{cfg.model}: {n_params / 1e6:.3f}M parameters, {len(run.train_ds)} train / {len(run.val_ds)} held-out "
        f"images at {run.kwargs['img_size']}px, {cfg.epochs} epochs x {len(run.loader)} steps of {cfg.batch_size}"
        f"{f' on {world} processes' if world > 1 else ''}, {device}{f', autocast {run.dtype}' if run.dtype else ''}"
    )
    return run


def open_checkpoint(run: Run) -> dict[str, Any] | None:
    """The checkpoint to resume from (``resume``), or None (``own_out`` has checked that OUT may be used)."""
    cfg, out = run.cfg, run.out
    if not cfg.resume:
        return None
    path = out / "last.pt" if cfg.resume == "auto" else Path(cfg.resume)
    if cfg.resume == "auto" and not path.exists():
        raise TrainingError(f"nothing to resume: {path} does not exist (drop --resume to start a new run)")
    return load_checkpoint(path)


def setup_data(run: Run) -> None:
    """The training subset, the held-out set, their transforms and the per-rank loaders."""
    cfg = run.cfg
    if cfg.batch_size % run.world:
        raise TrainingError(f"the global batch {cfg.batch_size} must be divisible by the {run.world} processes")
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
    train_tf = make_transform(
        True,
        img_size,
        train_ds.mean,
        train_ds.std,
        crop_padding=cfg.crop_padding or None,
        hflip=hflip,
        auto_augment=cfg.auto_augment,
    )
    mix = None
    if cfg.mixup > 0 or cfg.cutmix > 0:
        mix = MixupCutmix(cfg.mixup, cfg.cutmix, label_smoothing=cfg.smoothing, num_classes=train_ds.num_classes)
    run.loader = BatchLoader(
        train_ds,
        run.per_rank,
        shuffle=True,
        drop_last=True,
        transform=train_tf,
        seed=cfg.seed,
        rank=run.rank,
        world_size=run.world,
        mix=mix,
        device=run.device,
    )
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
    """Model (identical initial weights on every rank), teacher, optimizer, schedule, EMA and scaler."""
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
    model.to(run.device)
    if cfg.teacher:
        from .distill import HardDistillationLoss, load_teacher

        run.criterion = HardDistillationLoss(load_teacher(cfg.teacher, run.device), cfg.smoothing)
        run.criterion.check_student(model, run.train_ds.in_chans)
        model.distilled_training = True
    run.model = run.raw = model
    run.optimizer = create_optimizer(model, cfg.lr, cfg.weight_decay)
    steps = len(run.loader)
    run.sched = WarmupCosine(run.optimizer, cfg.lr, cfg.epochs * steps, round(cfg.warmup_epochs * steps), cfg.min_lr)
    run.ema = ModelEma(model, cfg.ema) if cfg.ema > 0 else None
    run.scaler = torch.amp.GradScaler(run.device.type, enabled=run.dtype == torch.float16)
    torch.manual_seed(derive_seed(cfg.seed, run.rank))  # dropout / drop-path streams, one per rank


def restore(run: Run, ckpt: dict[str, Any]) -> None:
    """Continue a run from its checkpoint: weights, optimizer, schedule, EMA, scaler, RNG streams, log rows."""
    load_state_checked(run.raw, ckpt["model"], f"checkpoint {ckpt['path']}")
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.sched.load_state_dict(ckpt["scheduler"])
    if run.ema is not None:
        if not ckpt.get("ema"):
            raise TrainingError(f"cannot resume with --ema: {ckpt['path']} was trained without an EMA")
        run.ema.load_state_dict(ckpt["ema"])
    if ckpt.get("scaler"):
        run.scaler.load_state_dict(ckpt["scaler"])
    run.start_epoch, run.step = int(ckpt["epoch"]), int(ckpt["step"])
    if run.sched.state_dict()["total_steps"] != ckpt["scheduler"].get("total_steps"):
        run.log("note: the schedule is stretched to the new --epochs from here on")
    rngs = ckpt.get("rng") or []
    if len(rngs) == run.world:
        set_rng_state(rngs[run.rank], run.device)
    else:
        run.log(f"note: the checkpoint was written by {len(rngs)} processes, now {run.world}: fresh random streams")
        torch.manual_seed(derive_seed(run.cfg.seed, run.rank, run.start_epoch))
    restore_log(run, ckpt)
    run.log(f"resumed {ckpt['path']} after epoch {run.start_epoch} (step {run.step})")


def restore_log(run: Run, ckpt: dict[str, Any]) -> None:
    """The log rows up to the checkpoint's epoch. The checkpoint carries them, so a run killed between the
    checkpoint's rename and the log write loses no row: log.json is completed at once (checkpoints
    written before they carried the rows: log.json's rows)."""
    log_file = run.out / "log.json"
    try:
        on_disk = json.loads(log_file.read_text()) if log_file.exists() else []
        on_disk = [r for r in on_disk if r["epoch"] <= run.start_epoch]
    except (ValueError, TypeError, KeyError):
        on_disk = []  # a damaged log: the checkpoint's rows replace it
    run.rows = [r for r in ckpt.get("log") or on_disk if r["epoch"] <= run.start_epoch]
    if run.master and run.rows != on_disk:
        write_log(run.out, run.rows)
        run.log(f"note: {log_file} lacked rows the checkpoint carries ({len(on_disk)} of {len(run.rows)}); restored")


def train_step(run: Run, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """One optimisation step; returns (the loss, the class logits)."""
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
        if cfg.clip_grad > 0:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(run.raw.parameters(), cfg.clip_grad)
        scaler.step(optimizer)
        scaler.update()
    except RuntimeError as e:
        if is_oom(e):
            raise TrainingError(
                f"a batch of {run.per_rank} images does not fit in memory ({str(e).splitlines()[0][:120]}); "
                "use a smaller --batch-size"
            ) from None
        raise
    run.sched.step()
    run.step += 1
    if run.ema is not None:
        run.ema.update(run.raw)
    return loss, outputs[0] if isinstance(outputs, tuple) else outputs


def train_epoch(run: Run, epoch: int) -> dict[str, Any]:
    """One pass over the training data; the epoch's row of the log (loss, accuracy, speed over all ranks)."""
    from tqdm import tqdm

    cfg, device, steps = run.cfg, run.device, len(run.loader)
    run.loader.set_epoch(epoch)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = 0
    show_bar = cfg.progress and run.master and sys.stderr.isatty()
    t0 = time.perf_counter()
    bar = tqdm(
        run.loader,
        total=steps,
        desc=f"epoch {epoch + 1}/{cfg.epochs}",
        leave=False,
        disable=not show_bar,
        dynamic_ncols=True,
    )
    for i, (x, y) in enumerate(bar):
        loss, logits = train_step(run, x, y)
        loss_sum += loss.detach().float() * len(x)
        correct += (logits.argmax(-1) == class_targets(y)).sum()
        seen += len(x)
        if show_bar and (i % 10 == 0 or i == steps - 1):
            rate = seen * run.world / (time.perf_counter() - t0)
            bar.set_postfix_str(
                f"loss {loss_sum.item() / seen:.3f} acc {100 * correct.item() / seen:.1f}% {rate:.0f} img/s"
            )
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_time = time.perf_counter() - t0
    stats = torch.stack([loss_sum, correct.float(), torch.tensor(float(seen), device=device)])
    if run.world > 1:
        dist.all_reduce(stats)
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
    """Held-out top-1/top-5 of the model (and of its EMA)."""
    ev = evaluate(run.raw, run.val_loader, run.device, run.dtype)
    row = {"val_loss": ev["loss"], "val_top1": ev["top1"], "val_top5": ev["top5"], "eval_img_s": ev["img_s"]}
    if run.ema is not None:
        ev_ema = evaluate(run.ema.module, run.val_loader, run.device, run.dtype)
        row.update(ema_top1=ev_ema["top1"], ema_top5=ev_ema["top5"])
    return row


def save_epoch(run: Run, row: dict[str, Any]) -> None:
    """Checkpoint (every rank contributes its RNG state, rank 0 writes), log files and the epoch's line."""
    rngs = [rng_state(run.device)]
    if run.world > 1:
        rngs = [None] * run.world
        dist.all_gather_object(rngs, rng_state(run.device))
    if not run.master:
        return
    cfg = run.cfg
    run.rows.append(row)
    state = {
        "model_name": cfg.model,
        "model_kwargs": run.kwargs,
        "model": run.raw.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.sched.state_dict(),
        "ema": run.ema.state_dict() if run.ema is not None else None,
        "scaler": run.scaler.state_dict(),
        "epoch": row["epoch"],
        "step": run.step,
        "rng": rngs,
        "world_size": run.world,
        "config": asdict(cfg),
        "metrics": row,
        "log": list(run.rows),  # the rows so far: resume restores any the log files lack
    }
    save_checkpoint(state, run.out / "last.pt")
    write_log(run.out, run.rows)
    ema_txt = f"  ema {row['ema_top1']:.2f}%" if run.ema is not None else ""
    run.log(
        f"epoch {row['epoch']}/{cfg.epochs}  loss {row['train_loss']:.4f}  train {row['train_acc']:.1f}%  "
        f"held-out {row['val_top1']:.2f}% (top-5 {row['val_top5']:.1f}%){ema_txt}  lr {row['lr']:.2e}  "
        f"{row['train_img_s']:.0f} img/s  {row['train_time_s']:.1f} s"
    )


def finish(run: Run) -> dict[str, Any]:
    """The run's summary (rank 0; empty elsewhere), written to ``OUT/summary.json`` and returned with the log."""
    summary: dict[str, Any] = {}
    if run.master:
        rows = run.rows
        train_s = sum(r["train_time_s"] for r in rows)
        summary = {
            "model": run.cfg.model,
            "params": sum(p.numel() for p in run.raw.parameters()),
            "epochs": run.cfg.epochs,
            "world_size": run.world,
            "final": rows[-1] if rows else {},
            "train_img_s": sum(r["train_img_s"] * r["train_time_s"] for r in rows) / max(train_s, 1e-9),
            "train_time_s": train_s,
            "wall_s": time.perf_counter() - run.t_start,
            "checkpoint": str(run.out / "last.pt"),
        }
        if run.device.type == "cuda":  # the host RSS says little about a GPU run
            summary["cuda_peak_mib"] = torch.cuda.max_memory_allocated(run.device) / 2**20
        write_json_atomic(run.out / "summary.json", summary)
        summary["log"] = list(rows)
    if run.world > 1:
        dist.barrier()
    return summary
