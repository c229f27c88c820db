"""AdamW with DeiT's weight-decay exclusions, and a per-step warmup + cosine learning-rate schedule.

On a GPU the optimizer is PyTorch's fused AdamW (one kernel updates every parameter, instead of a
handful of kernels per tensor list); the update rule is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..common.device import grad_scaler
from ..models.base import layer_ids


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decayed weights, and the rest without decay, split again by learning-rate factor.

    As timm's ``param_groups_weight_decay``: 1-D parameters (biases, norm scales) and the names in
    ``model.no_weight_decay()`` (class/distillation tokens, position tables, AFT position biases) are not
    decayed, since decay pulls them toward zero with no regularising benefit. A model with ``lr_scale_of(name)``
    trains some parameters at a fraction of the learning rate (DETR's backbone at 1/10 of the transformer's):
    the schedule multiplies each group's rate by its ``lr_scale``.
    """
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    scale_of = getattr(model, "lr_scale_of", lambda name: 1.0)
    # the two plain groups always exist (a checkpoint's optimizer state has both, even when one is empty)
    groups = {(1.0, d): {"params": [], "weight_decay": weight_decay if d else 0.0} for d in (True, False)}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay, scale = not (p.ndim <= 1 or name in skip), float(scale_of(name))
        group = groups.setdefault((scale, decay), {"params": [], "weight_decay": weight_decay if decay else 0.0})
        if scale != 1.0:
            group["lr_scale"] = scale
        group["params"].append(p)
    ordered = sorted(groups, key=lambda k: (k[0] != 1.0, -k[0], not k[1]))  # the plain two first, as before
    return [groups[k] for k in ordered]


def param_groups_layer_decay(
    model: nn.Module, weight_decay: float, layer_decay: float = 0.75, lr_scale_key: str = "lr_scale"
) -> list[dict]:
    """AdamW groups for layer-wise learning-rate decay (BEiT / timm's ``param_groups_layer_decay``).

    Layers come from ``model.group_matcher()`` (stem 0, block i -> i + 1, final norm, head last): a parameter
    of layer l gets the learning-rate factor ``layer_decay ** (L - l)`` under ``lr_scale_key`` (the head 1,
    the stem the smallest), and weight decay as :func:`param_groups`. The schedule multiplies each group's
    rate by its factor.
    """
    if not 0.0 < layer_decay <= 1.0:
        raise ValueError(f"layer_decay must be in (0, 1], got {layer_decay}")
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    layer = layer_ids([n for n, _ in named], model.group_matcher(coarse=False))
    top = max(layer.values(), default=0)
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in named:
        decay = not (p.ndim <= 1 or name in skip)
        group = groups.setdefault(
            (layer[name], decay),
            {
                "params": [],
                "weight_decay": weight_decay if decay else 0.0,
                lr_scale_key: layer_decay ** (top - layer[name]),
            },
        )
        group["params"].append(p)
    return [groups[k] for k in sorted(groups)]


def fused_available(device: torch.device | str) -> bool:
    """Whether AdamW has a fused kernel for parameters on ``device`` (CUDA; the CPU runs the foreach path)."""
    return torch.device(device).type == "cuda"


def create_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.05,
    betas: tuple[float, float] = (0.9, 0.999),
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`; ``fused`` (default: when the parameters are on a GPU) selects
    PyTorch's fused kernel."""
    if lr <= 0 or weight_decay < 0:
        raise ValueError(f"need lr > 0 and weight_decay >= 0, got lr={lr}, weight_decay={weight_decay}")
    if fused is None:
        first = next(model.parameters(), None)
        fused = first is not None and fused_available(first.device)
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, fused=fused or None)


class WarmupCosine:
    """Per-step learning rate: linear warmup from ``warmup_lr`` to ``lr`` over ``warmup_steps``, then
    cosine decay to ``min_lr`` at ``total_steps`` (DeiT's schedule, stepped per batch instead of per epoch); with
    ``drop_step``, constant after the warmup and a tenth of ``lr`` from that step on (DETR's StepLR).

    Its state is the step count, so a resumed run continues the same curve.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr: float,
        total_steps: int,
        warmup_steps: int = 0,
        min_lr: float = 0.0,
        warmup_lr: float = 0.0,
        drop_step: int | None = None,
    ) -> None:
        if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
            raise ValueError(
                f"need 0 <= warmup_steps <= total_steps and total_steps >= 1, got {warmup_steps}, {total_steps}"
            )
        self.optimizer, self.lr, self.min_lr, self.warmup_lr = optimizer, lr, min_lr, warmup_lr
        self.total_steps, self.warmup_steps, self.drop_step = total_steps, warmup_steps, drop_step
        self.step_count = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_lr + (self.lr - self.warmup_lr) * step / self.warmup_steps
        if self.drop_step is not None:  # DETR's step schedule: constant, then a tenth from the drop on
            return self.lr * (0.1 if step >= self.drop_step else 1.0)
        span = max(1, self.total_steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * t))

    def _apply(self) -> None:
        lr = self.lr_at(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    @property
    def current_lr(self) -> float:
        return self.lr_at(self.step_count)

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "total_steps": self.total_steps, "warmup_steps": self.warmup_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self._apply()


@dataclass(frozen=True)
class Optimization:
    """What updates a model's weights and carries state between steps: optimizer, schedule, gradient scaler
    (the same three in ``vitlab train`` and ``vitlab lm train``; a run checkpoint holds all three)."""

    optimizer: torch.optim.Optimizer
    sched: WarmupCosine
    scaler: torch.amp.GradScaler


def build_optimization(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    total_steps: int,
    warmup_steps: int,
    min_lr: float,
    device: torch.device,
    dtype: torch.dtype | None,
    drop_step: int | None = None,
) -> Optimization:
    """AdamW at the peak ``lr`` (no decay on norms, biases, tokens), its warmup + cosine schedule over
    ``total_steps`` (or the step schedule dropping at ``drop_step``), and the gradient scaler autocast to ``dtype`` on ``device`` needs (a no-op one otherwise)."""
    optimizer = create_optimizer(model, lr, weight_decay)
    sched = WarmupCosine(optimizer, lr, total_steps, warmup_steps, min_lr, drop_step=drop_step)
    return Optimization(optimizer, sched, grad_scaler(device, dtype))
