"""The training loss of a run: soft-target cross-entropy, distillation from a teacher, or token labelling.

Every criterion is called as ``criterion(x, outputs, y, dense)``: the (augmented) images, the model's
training outputs, the class targets (indices, or soft targets after Mixup/CutMix/MixToken) and the dense
token-label targets ``(classes, weights)`` (None without token labelling).

Token labelling (Jiang et al. 2021, LV-ViT, Eq. 4; the recipe of Refined-ViT):
``L = H(Z_cls, y) + beta * (1/N) sum_n H(Z_n, y_n)``, ``H`` the soft-target cross-entropy, ``Z_n`` the aux head's
logits of patch token ``n`` and ``y_n`` its dense target (the top-k scores a teacher wrote for the patch,
renormalised to sum to one), ``beta = token_label_weight`` (0.5).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import dense_targets, soft_target_cross_entropy
from .config import TrainConfig, TrainingError

Criterion = Callable[[Tensor, object, Tensor, "tuple[Tensor, Tensor] | None"], Tensor]


def make_criterion(cfg: TrainConfig, model: nn.Module, in_chans: int, device: torch.device) -> Criterion:
    """The loss of ``cfg``; sets the student's training outputs (two heads, or class + per-token logits)."""
    if cfg.teacher and cfg.token_label:
        raise TrainingError("--teacher and --token-label are two recipes; use one of them")
    if cfg.teacher:
        from ..distill.loss import DistillationLoss
        from ..distill.teacher import load_teacher

        teacher = load_teacher(cfg.teacher, device, cfg.teacher_img_size, cfg.teacher_timeout)
        loss = DistillationLoss(teacher, cfg.distillation, cfg.distill_alpha, cfg.distill_tau, cfg.smoothing,
                                cfg.distill_reduction)  # fmt: skip
        loss.check_student(model, in_chans)
        model.distilled_training = True
        return loss
    if cfg.token_label:
        if getattr(model, "aux_head", None) is None:
            raise TrainingError(
                f"--token-label needs a model with a token-labelling head (e.g. refiner_vit_s); {cfg.model} has none"
            )
        model.token_label_training = True
        return TokenLabelLoss(cfg.token_label_weight, cfg.smoothing)
    return PlainLoss(cfg.smoothing)


class PlainLoss(nn.Module):
    """Soft-target cross-entropy with label smoothing (integer targets are smoothed one-hot vectors)."""

    def __init__(self, smoothing: float) -> None:
        super().__init__()
        self.smoothing = smoothing

    def forward(self, x: Tensor, outputs: Tensor, target: Tensor, dense=None) -> Tensor:
        return soft_target_cross_entropy(outputs, target, self.smoothing)


def token_targets(dense: tuple[Tensor, Tensor], num_classes: int) -> Tensor:
    """Dense targets ``(B, N, num_classes)``: the (class, weight) pairs scattered, each token's sum made one."""
    scores = dense_targets(dense[0], dense[1].float(), num_classes)
    return scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)


class TokenLabelLoss(nn.Module):
    """LV-ViT's token-labelling loss (module docstring); the model returns ``(class_logits, token_logits)``."""

    def __init__(self, weight: float = 0.5, smoothing: float = 0.0) -> None:
        super().__init__()
        self.weight, self.smoothing = weight, smoothing

    def forward(self, x: Tensor, outputs: tuple[Tensor, Tensor], target: Tensor, dense) -> Tensor:
        if not isinstance(outputs, tuple) or dense is None:
            raise ValueError("token labelling needs the model's (class, token) logits and dense targets")
        cls_logits, token_logits = outputs
        base = soft_target_cross_entropy(cls_logits, target, self.smoothing)
        targets = token_targets(dense, token_logits.shape[-1])
        aux = torch.sum(-targets * F.log_softmax(token_logits.float(), dim=-1), dim=-1).mean()
        return base + self.weight * aux
