"""The training engine as a library: ``train(TrainConfig(...))`` (setup, then the loop), evaluation, the
optimizer and schedule, EMA, checkpoints. Every command that trains calls it (``vitlab train``, ``seg train``,
``points train``, the rows of ``compare`` and ``study``); a task beyond classification plugs in its hooks
(:mod:`.tasks`)."""

from ..checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from .ema import ModelEma
from .loop import TrainConfig, evaluate, train
from .optim import WarmupCosine, create_optimizer, param_groups

__all__ = [
    "ModelEma",
    "TrainConfig",
    "WarmupCosine",
    "create_optimizer",
    "evaluate",
    "load_checkpoint",
    "model_from_checkpoint",
    "param_groups",
    "save_checkpoint",
    "train",
]
