"""Exponential moving average of a model's weights (as timm's ModelEmaV3, used by TNT/EAMLP/CPVT recipes)."""

from __future__ import annotations

import copy

import torch
from torch import nn


class ModelEma:
    """``ema = d·ema + (1 - d)·weights`` after each optimizer step; buffers (BatchNorm statistics) are copied.

    With ``warmup=True`` the decay is ``min(decay, (1 + n) / (10 + n))`` at update ``n``, so that short runs
    (where ``decay ** steps`` would still be close to 1) average the recent weights instead of the
    random initialisation.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9998, warmup: bool = True) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.warmup, self.updates = decay, warmup, 0

    def current_decay(self) -> float:
        n = self.updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = self.current_decay()
        ema_p = [p for p in self.module.parameters()]
        new_p = [p.detach() for p in model.parameters()]
        floats = [(e, n) for e, n in zip(ema_p, new_p) if e.is_floating_point()]
        if floats:
            torch._foreach_lerp_([e for e, _ in floats], [n for _, n in floats], 1.0 - d)
        for e, n in zip(self.module.buffers(), model.buffers()):
            e.copy_(n)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
