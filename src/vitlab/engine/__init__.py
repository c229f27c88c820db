"""Training, evaluation and comparison of the models: ``vitlab train | eval | compare``."""

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
