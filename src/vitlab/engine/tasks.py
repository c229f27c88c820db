"""The tasks the training engine runs: image classification (its own steps) and the dense tasks that plug
their data, model, loss, epoch sums and evaluation into the same loop, checkpoints, DDP and run folders.

A task registers its hooks here when its package is imported (:func:`register_task`; the engine imports no
task): :class:`vitlab.tasks.segmentation.task.SegmentationTask` and :class:`vitlab.tasks.points.task.PointsTask`
are called by
:func:`vitlab.engine.setup.setup` and :mod:`vitlab.engine.loop` where classification calls its own steps:
``open_data(draft)``, ``model_kwargs(cfg, train_ds)``, ``build_model(name, kwargs)``, ``criterion(cfg, model)``, ``build_loaders(draft)``,
``tally(state, device, sums)``, ``evaluate(run)``, ``report(run, row)``; ``score`` names the held-out measure that
chooses ``best.pt``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .config import TrainConfig, TrainingError

_HOOKS: dict[str, Callable[[TrainConfig], Any]] = {}


def register_task(name: str, hooks: Callable[[TrainConfig], Any]) -> None:
    """Make ``cfg.task == name`` run with ``hooks(cfg)``'s hooks: a task package registers itself when it is
    imported (``vitlab.tasks.segmentation``), so the engine never imports a task."""
    _HOOKS[name] = hooks


def task_hooks(cfg: TrainConfig) -> Any | None:
    """The hooks of ``cfg.task``, or None for image classification (the engine's own steps)."""
    if cfg.task == "classification":
        return None
    if cfg.task not in _HOOKS:
        raise TrainingError(
            f"task {cfg.task!r} is not loaded; run it through its command (vitlab seg|points|det train)"
        )
    return _HOOKS[cfg.task](cfg)


def score_key(cfg: TrainConfig) -> str:
    """The key of the epoch rows' held-out score that chooses ``best.pt`` (higher is better)."""
    task = task_hooks(cfg)
    return task.score if task is not None else "val_top1"


def load_task_model(path: str, task: str, command: str, build: Any, ema: bool = False) -> tuple[Any, dict[str, Any]]:
    """The model a ``vitlab <command> train`` run of ``task`` saved at ``path``, rebuilt by ``build`` (name,
    **kwargs) with its weights (the EMA's with ``ema``), and the checkpoint; one line for a checkpoint of another
    task or without EMA weights."""
    from ..checkpoint import load_checkpoint
    from ..checkpoint.load import load_state_checked

    ckpt = load_checkpoint(path)
    if ckpt.get("config", {}).get("task") != task:
        raise ValueError(f"{path} was not written by `vitlab {command} train`; use `vitlab eval` with a classifier's")
    if ema and not ckpt.get("ema"):
        raise ValueError(f"{path} has no EMA weights (trained without --ema)")
    model = build(ckpt["model_name"], **ckpt["model_kwargs"])
    load_state_checked(model, ckpt["ema"]["module"] if ema else ckpt["model"], f"checkpoint {path}")
    return model, ckpt
