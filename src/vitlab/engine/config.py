"""What a training run is: its options (:class:`TrainConfig`, the ``vitlab train`` flags) and its pieces
(:class:`Run`: the :class:`Context` it runs in, its data, model and optimization, assembled once by
:func:`vitlab.engine.setup.setup`, and its :class:`Progress`, the one part that changes)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..common import options as opt
from ..common.device import AMP_CHOICES
from ..common.distributed import World
from ..data import BatchLoader
from ..data.augment import RandAugment
from ..data.spec import DataSpec, data_spec
from ..models import get_config
from .ema import ModelEma
from .optim import Optimization
from .tracking import StepLog


class TrainingError(ValueError):
    """Something the user can fix (options, files, memory): the CLI prints it as one line."""


@dataclass
class TrainConfig:
    model: str = "deit_mini"
    task: str = "classification"  # "segmentation", "points", "detection" (vitlab seg|points|det train): engine.tasks
    model_args: dict[str, Any] = field(default_factory=dict)  # constructor overrides, e.g. {"patch_size": 7}
    data: str = "mnist"
    out: str = "runs/train"
    epochs: int = 10
    batch_size: int = 128  # global batch (split over DDP ranks)
    lr: float = 1e-3
    base_lr: float | None = None  # if set: lr = base_lr * global batch / 512 (DeiT's rule)
    accum_steps: int = 1  # micro-batches per optimizer step (global batch = batch_size x accum_steps)
    min_lr: float = 1e-5
    warmup_epochs: float = 1.0
    lr_drop: float | None = None  # DETR's step schedule: constant lr, a tenth from this epoch on (None: cosine)
    weight_decay: float = 0.05
    clip_grad: float = 1.0  # max gradient norm; 0 = off
    drop_path: float = 0.1  # stochastic depth rate of the last block (linear rule)
    smoothing: float = 0.1
    mixup: float = 0.0
    cutmix: float = 0.0
    ema: float = 0.0  # EMA decay; 0 = no EMA
    amp: str = "auto"  # auto: fp16 + scaler on CUDA, off on CPU; bf16: autocast to bfloat16
    seed: int = 0
    threads: int | None = None  # torch.set_num_threads per process; 0 = torch's default; None: auto_threads
    device: str = "auto"
    img_size: int | None = None  # default: the dataset's
    holdout: int | None = None  # held-out images of the embedded MNIST (default 1000)
    train_limit: int | None = None  # train on a seeded random N of the training images (quick runs)
    crop_padding: int = 2
    hflip: float | None = None  # default: 0 for digits, 0.5 otherwise
    auto_augment: str | None = None  # e.g. "rand-m9-n2-mstd0.5"
    color_jitter: float = 0.4  # streaming data: brightness/contrast/saturation jitter (off under RandAugment)
    reprob: float = 0.0  # random erasing probability (per-pixel noise)
    aug_repeats: int = 1  # repeated augmentation (DeiT: 3)
    workers: int = 0  # DataLoader workers per process decoding folder:/wds: data
    shuffle_buffer: int = 2000  # wds: data: samples a DataLoader worker shuffles among (0: stored order)
    num_classes: int | None = None  # wds: shards without a shards.json: their number of classes
    crop_pct: float | None = None  # evaluation crop of streaming data (default: the model's)
    teacher: str | None = None  # teacher: a vitlab checkpoint, a torch.export .pt2 or a TorchScript file
    teacher_img_size: int | None = None  # the teacher's input size (default: what its file says, else the data's)
    teacher_timeout: float = 300.0  # seconds the teacher's first batch may take before the run ends (one line)
    distillation: str = "hard"  # "hard" (DeiT) or "soft" (KL at temperature distill_tau)
    distill_alpha: float = 0.5
    distill_tau: float = 1.0
    distill_reduction: str = "deit"  # soft KL: "deit" (sum / (batch x classes), DeiT's code) or "batchmean"
    dist_token: bool = False
    token_label: bool = False  # LV-ViT token labelling: dense targets beside the images, MixToken, aux loss
    token_label_weight: float = 0.5  # weight of the dense aux loss
    dense_root: str | None = None  # where the dense target files are (default: beside the images)
    init_from: str | None = None  # initialise the weights from another checkpoint
    resume: str | None = None  # "auto" = OUT/last.pt, or a checkpoint path
    force: bool = False  # start over even if OUT holds a checkpoint
    eval_batch_size: int = 256
    save_every: int = 0  # optimizer steps between mid-epoch checkpoints (0: at epoch ends only)
    compile: bool = False  # torch.compile the model
    grad_checkpointing: bool = False  # recompute each block's activations in the backward pass
    tf32: bool = False  # GPU: TF32 tensor cores for fp32 matrix products and convolutions
    fsdp: bool = False  # under torchrun: shard the model with FSDP2 (one unit per block), sharded checkpoints
    tensorboard: bool = False  # also write the per-step and per-epoch scalars to OUT/tb
    log_every: int = 10  # steps per write of OUT/steps.jsonl
    progress_every: float = 30.0  # seconds between progress lines when stdout is not a terminal
    progress: bool = True
    recipe: str | None = None  # the recipe file the options came from (--config)

    @cached_property
    def spec(self) -> DataSpec:
        """``data`` parsed (once per config; ``data`` itself stays the text checkpoints and run records keep)."""
        return DataSpec.parse(self.data)

    @property
    def auto_threads(self) -> int:
        """The torch threads of a process when ``threads`` is not set: 2, fewer when DataLoader workers would
        otherwise share the cores with them (2 threads and 2 workers on 2 cores ran 6-7x slower than 1 thread)."""
        if self.threads is not None:
            return self.threads
        spare = (os.cpu_count() or 2) - self.workers
        return max(1, min(2, spare)) if self.workers else 2

    @property
    def global_batch(self) -> int:
        """Images per optimizer step over all processes: ``batch_size`` (split over them) x ``accum_steps``."""
        return self.batch_size * self.accum_steps

    @property
    def peak_lr(self) -> float:
        """The learning rate after warmup: ``base_lr * global_batch / 512`` when ``base_lr`` is set, else ``lr``."""
        return self.base_lr * self.global_batch / 512 if self.base_lr is not None else self.lr

    def __post_init__(self) -> None:
        if isinstance(self.data, DataSpec):  # the command line's parsed --data: keep it, record its text
            self.__dict__["spec"] = self.data
            self.data = str(self.data)
        if self.amp not in AMP_CHOICES:
            raise TrainingError(f"amp must be one of {AMP_CHOICES}, got {self.amp!r}")
        for f in fields(self):  # the types first (a recipe's `auto_augment: 7`, Python's TrainConfig(lr="1e-3"))
            if why := check_type(f.name, getattr(self, f.name)):
                raise TrainingError(why)
        for name, check in OPTION_CHECKS.items():  # the ranges the command line checks while parsing
            if (name == "data" and self.task != "classification") or (name == "model" and self.task == "points"):
                continue  # the other tasks read their own data layouts (point models: their own names)
            value = getattr(self, name)
            if value is not None:
                try:
                    check.check(value, "--" + name.replace("_", "-"))
                except ValueError as e:
                    raise TrainingError(str(e)) from None
        if self.fsdp and self.ema > 0:
            raise TrainingError("--ema keeps a whole copy of the weights, which --fsdp does not; drop one of them")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


#: the Python types a value of each annotation of :class:`TrainConfig`'s fields may have (what YAML, TOML and the
#: command line give), and how a message names them; ``X | None`` also takes null
VALUE_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "bool": ((bool,), "true or false"),
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "str": ((str,), "a string"),
    "dict[str, Any]": ((dict,), "a mapping of constructor options"),
}


def check_type(key: str, value: Any) -> str | None:
    """Why ``value`` is not of the type of :class:`TrainConfig`'s field ``key`` (from its annotation), or None."""
    annotation = _ANNOTATIONS[key]
    parts = [part.strip() for part in annotation.split("|")]
    optional = "None" in parts
    kinds = [VALUE_TYPES[part] for part in parts if part in VALUE_TYPES]
    if value is None:
        return None if optional or not kinds else f"{key} must be {kinds[0][1]}, got null (leave the key out instead)"
    # a boolean is an int to Python, never a number or a count in a recipe
    fits = any(isinstance(value, types) and (bool in types or not isinstance(value, bool)) for types, _ in kinds)
    if fits or not kinds:
        return None
    what = " or ".join(name for _, name in kinds) + (" (or null)" if optional else "")
    hint = ""
    if isinstance(value, str) and any(float in types for types, _ in kinds):
        with contextlib.suppress(ValueError):
            float(value)
            hint = " (a number as text: drop the quotes; YAML also reads 1e-3 as text, write 1.0e-3)"
    return f"{key} must be {what}, got {value!r}{hint}"


_ANNOTATIONS = {f.name: str(f.type) for f in fields(TrainConfig)}


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
    "task": opt.Choice("classification", "segmentation", "points", "detection"),
    "data": data_spec,
    "epochs": opt.positive_int,
    "batch_size": opt.positive_int,
    "lr": opt.positive_float,
    "base_lr": opt.positive_float,
    "accum_steps": opt.Int(1, 4096),
    "min_lr": opt.non_negative_float,
    "warmup_epochs": opt.non_negative_float,
    "lr_drop": opt.non_negative_float,
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
    "color_jitter": opt.non_negative_float,
    "reprob": opt.probability,
    "aug_repeats": opt.Int(1, 64),
    "workers": opt.Int(0, 256),
    "shuffle_buffer": opt.Int(0, 10**7),
    "num_classes": opt.Int(1, 10**6),
    "crop_pct": opt.Float(0, 2, low_open=True),
    "teacher_img_size": opt.image_size,
    "teacher_timeout": opt.positive_float,
    "distillation": opt.Choice("hard", "soft"),
    "distill_alpha": opt.probability,
    "distill_tau": opt.positive_float,
    "distill_reduction": opt.Choice("deit", "batchmean"),
    "token_label_weight": opt.non_negative_float,
    "save_every": opt.non_negative_int,
    "eval_batch_size": opt.positive_int,
    "log_every": opt.positive_int,
    "progress_every": opt.non_negative_float,
}

# what a run writes into OUT: a folder holding any of them holds a run
RUN_FILES = ("last.pt", "best.pt", "log.json", "log.csv", "summary.json", "steps.jsonl", "tb", "shards", "run.json")


def class_targets(y: Tensor) -> Tensor:
    return y.argmax(-1) if y.is_floating_point() else y


@dataclass
class EpochTally:
    """The running sums of an epoch (loss x images, correct answers, images) on the device, and its training
    time; a mid-epoch checkpoint carries them so the resumed epoch's row equals the uninterrupted one's.

    Every figure of the epoch's row comes from here, resumed or not, on one process or many: the checkpoint
    holds the sums over every process (rank 0 restores them, the others start from zero, so the next
    reduction counts each image once) and the seconds already trained, so images/s divides the epoch's images
    by the epoch's whole training time, not by the resumed part's.
    """

    loss_sum: Tensor
    correct: Tensor
    seen: int = 0
    seconds: float = 0.0  # training time of this epoch before the current process started it
    clock: ClassVar[Callable[[], float]] = time.perf_counter
    _started: float | None = None

    @classmethod
    def restore(cls, state: dict[str, Any] | None, device: torch.device, sums: bool = True) -> EpochTally:
        """The tally a checkpoint recorded (``None``: a fresh epoch); ``sums=False`` keeps only its time (every
        rank but the one that carries the sums)."""
        state = state or {}
        keep = state if sums else {}
        return cls(
            keep.get("loss_sum", torch.zeros(())).to(device),
            keep.get("correct", torch.zeros((), dtype=torch.long)).to(device),
            int(keep.get("seen", 0)),
            float(state.get("seconds", 0.0)),
        )

    def start_clock(self) -> None:
        self._started = self.clock()

    def elapsed(self) -> float:
        """This epoch's training seconds so far, the part before a resume included."""
        return self.seconds + (self.clock() - self._started if self._started is not None else 0.0)

    def _sums(self) -> dict[str, Tensor]:
        """The device sums, by name (a subclass adds its own); ``seen`` is added to them on reduction."""
        return {"loss_sum": self.loss_sum, "correct": self.correct}

    def totals(self, world: World) -> dict[str, float]:
        """The sums over every process (a collective: every rank calls it)."""
        from ..common.distributed import all_reduce_sum

        sums = {**self._sums(), "seen": torch.tensor(float(self.seen), device=self.loss_sum.device)}
        reduced = all_reduce_sum(torch.stack([v.double() for v in sums.values()]), world).tolist()
        return dict(zip(sums, reduced))

    def state_dict(self, world: World) -> dict[str, Any]:
        """The sums over every process and the seconds so far (a collective: every rank calls it)."""
        own = self._sums()
        totals = self.totals(world)
        state = {k: torch.tensor(totals[k], dtype=v.dtype) for k, v in own.items()}
        return {**state, "seen": round(totals["seen"]), "seconds": self.elapsed()}

    def add(self, loss: Tensor, logits: Tensor, y: Tensor) -> None:
        self.loss_sum += loss.detach().float() * len(y)
        self.correct += (logits.argmax(-1) == class_targets(y)).sum()
        self.seen += len(y)

    def status(self) -> str:
        return f"loss {self.loss_sum.item() / self.seen:.3f} acc {100 * self.correct.item() / self.seen:.1f}%"

    def row(self, run: Run, epoch: int) -> dict[str, Any]:
        """The epoch's row of the log, summed over the processes."""
        totals, train_time = self.totals(run.world), self.elapsed()
        train_loss = totals["loss_sum"] / totals["seen"]
        if not math.isfinite(train_loss):
            raise TrainingError(
                f"the training loss became {train_loss} in epoch {epoch + 1}; lower --lr or use --amp none"
            )
        return {
            "epoch": epoch + 1,
            "step": run.step,
            "lr": run.opt.optimizer.param_groups[0]["lr"],
            "train_loss": train_loss,
            "train_acc": self.accuracy(totals),
            "train_img_s": totals["seen"] / max(train_time, 1e-9),
            "train_time_s": train_time,
        }

    def accuracy(self, totals: dict[str, float]) -> float:
        return 100 * totals["correct"] / totals["seen"]


@dataclass(frozen=True)
class Context:
    """Where and how a run trains: its options and the process it runs in (made first, read by every step)."""

    cfg: TrainConfig
    log: Callable[[str], None]  # rank 0's progress lines (the other ranks' are dropped)
    world: World
    device: torch.device
    dtype: torch.dtype | None  # autocast's, or None
    out: Path
    t_start: float
    steps: StepLog  # the per-step log (writes nothing on the other ranks)

    @property
    def master(self) -> bool:
        return self.world.main

    @property
    def per_rank(self) -> int:
        return self.cfg.batch_size // self.world.size

    @property
    def evaluates(self) -> bool:
        """Whether this process evaluates: rank 0, or every rank of a sharded model (the forward is collective)."""
        return self.master or (self.cfg.fsdp and self.world.size > 1)


@dataclass(frozen=True)
class ModelParts:
    """The model a run trains (:func:`vitlab.engine.setup.setup_model`)."""

    raw: nn.Module  # the model itself (state dicts, EMA, evaluation)
    model: nn.Module  # what the step calls: DDP wrapper, sharded model, compiled module
    kwargs: dict[str, Any]  # its constructor options (recorded in the checkpoint)
    criterion: nn.Module  # the loss (teacher, token labels)


@dataclass(frozen=True)
class RunData:
    """The data a run reads (:func:`vitlab.engine.setup.open_run_data`, :func:`~vitlab.engine.setup.build_run_loaders`)."""

    train_ds: Any
    val_ds: Any
    loader: BatchLoader  # this rank's training batches
    val_loader: BatchLoader  # the whole held-out set
    data_cfg: dict[str, Any] | None  # the evaluation data configuration of streaming data


@dataclass
class Progress:
    """What changes as a run advances: the only mutable part of a :class:`Run`."""

    start_epoch: int = 0
    step: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)  # the log, one row per epoch (rank 0)
    best_top1: float | None = None  # the best held-out score so far (top-1; a dense task's own, tasks.score_key)
    resume_loader: dict[str, Any] | None = None  # the loader position a checkpoint recorded (used once)
    resume_tally: dict[str, Any] | None = None  # the epoch's sums a mid-epoch checkpoint recorded (used once)
    record: dict[str, Any] | None = None  # what OUT/run.json says, written with the first checkpoint (rank 0)
    # wall seconds of the processes before a resume, up to their last checkpoint: a resumed run's elapsed_s and
    # wall_s count the whole run, as an uninterrupted one's do (the time a killed process ran past it is lost)
    elapsed_before: float = 0.0


@dataclass(frozen=True)
class Run(Context):
    """A training run, assembled once by :func:`vitlab.engine.setup.setup` from what its steps return."""

    data: RunData
    net: ModelParts
    opt: Optimization
    ema: ModelEma | None
    progress: Progress

    def elapsed(self) -> float:
        """Wall seconds of the run so far, the processes before a resume included."""
        return self.progress.elapsed_before + time.perf_counter() - self.t_start

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return self.progress.step
