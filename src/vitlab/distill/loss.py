"""Distillation from a teacher (Touvron et al. 2021, DeiT, Sec. 4), soft or hard, with a distillation token.

With ``Z_s`` the student's class-token logits, ``Z_d`` its distillation-token logits, ``Z_t`` the teacher's,
``psi`` the softmax and ``lambda = alpha``:

- hard (DeiT's "hard-label distillation"): ``L = (1 - lambda) CE(psi(Z_s), y) + lambda CE(psi(Z_d), argmax Z_t)``
  (DeiT uses lambda = 1/2);
- soft (DeiT Eq. 2): ``L = (1 - lambda) CE(psi(Z_s), y) + lambda tau^2 KL(psi(Z_t / tau) || psi(Z_d / tau))``.
  The KL's reduction (``reduction``): ``"deit"`` (the default) does what DeiT's released code does, the pointwise
  terms ``p_t (log p_t - log p_d)`` summed over the batch and the classes and divided by their number ``B x C``;
  ``"batchmean"`` divides the sum by ``B`` only (the KL per sample as the paper writes it, averaged), ``C`` times
  the default (1000x on ImageNet at the same ``alpha``).

The student has a distillation token and head (``dist_token=True``); in training with
``distilled_training = True`` it returns ``(cls_logits, dist_logits)``, at test time their average.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..data import soft_target_cross_entropy
from .teacher import Teacher


def check_student(model: nn.Module) -> None:
    if getattr(model, "head_dist", None) is None:
        raise ValueError(
            "distillation needs a student with a distillation token and head; add --dist-token "
            "(a ViT-family model) or drop --teacher"
        )


SOFT_REDUCTIONS = ("deit", "batchmean")


class DistillationLoss(nn.Module):
    """DeiT's soft or hard distillation loss (module docstring). ``base`` is soft-target cross-entropy (labels
    may be Mixup/CutMix soft targets with label smoothing, as in DeiT); the teacher sees the same augmented
    images, resized to its own input size if that differs."""

    def __init__(
        self,
        teacher: Teacher,
        kind: str = "hard",
        alpha: float = 0.5,
        tau: float = 1.0,
        smoothing: float = 0.0,
        reduction: str = "deit",
    ) -> None:
        super().__init__()
        if kind not in ("hard", "soft"):
            raise ValueError(f"distillation must be 'hard' or 'soft', got {kind!r}")
        if reduction not in SOFT_REDUCTIONS:
            raise ValueError(f"the soft distillation reduction must be one of {SOFT_REDUCTIONS}, got {reduction!r}")
        self.teacher, self.kind, self.alpha, self.tau, self.smoothing = teacher, kind, alpha, tau, smoothing
        self.reduction = reduction

    def check_student(self, student: nn.Module, in_chans: int) -> None:
        check_student(student)
        t, s = self.teacher.num_classes, getattr(student, "num_classes", None)
        if t is not None and s is not None and t != s:
            raise ValueError(f"the teacher predicts {t} classes, the student {s}; use a teacher trained on this data")
        if self.teacher.in_chans is not None and self.teacher.in_chans != in_chans:
            raise ValueError(f"the teacher takes {self.teacher.in_chans}-channel images, the data has {in_chans}")

    def distill_term(self, dist_logits: Tensor, teacher_logits: Tensor) -> Tensor:
        if teacher_logits.shape != dist_logits.shape:
            raise ValueError(
                f"the teacher gives {tuple(teacher_logits.shape)} scores, the student {tuple(dist_logits.shape)}"
            )
        if self.kind == "hard":
            return F.cross_entropy(dist_logits, teacher_logits.argmax(-1))
        t = self.tau
        log_student = F.log_softmax(dist_logits.float() / t, -1)
        log_teacher = F.log_softmax(teacher_logits.float() / t, -1)
        total = F.kl_div(log_student, log_teacher, reduction="sum", log_target=True)
        count = dist_logits.numel() if self.reduction == "deit" else dist_logits.shape[0]
        return total * (t * t) / count

    def forward(self, x: Tensor, outputs: tuple[Tensor, Tensor], target: Tensor, dense=None) -> Tensor:
        if not isinstance(outputs, tuple):
            raise ValueError("the student must return (cls_logits, dist_logits): set model.distilled_training = True")
        cls_logits, dist_logits = outputs
        base = soft_target_cross_entropy(cls_logits, target, self.smoothing)
        return (1 - self.alpha) * base + self.alpha * self.distill_term(dist_logits, self.teacher(x))


def HardDistillationLoss(teacher: nn.Module, smoothing: float = 0.0, alpha: float = 0.5) -> DistillationLoss:
    """DeiT's hard distillation from a vitlab model (kept for callers of the earlier class)."""
    size = tuple(teacher.meta["input_size"][1:]) if hasattr(teacher, "meta") else None
    wrapped = Teacher(teacher.eval().requires_grad_(False), size, getattr(teacher, "num_classes", None))
    wrapped.in_chans = getattr(teacher, "in_chans", None)
    return DistillationLoss(wrapped, "hard", alpha, 1.0, smoothing)
