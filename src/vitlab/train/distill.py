"""DeiT hard-label distillation (Touvron et al. 2021, Eq. in Sec. 4 "Hard-label distillation").

``L = ½·CE(ψ(Z_cls), y) + ½·CE(ψ(Z_dist), y_t)``, with ``y_t = argmax Z_t`` the teacher's decision. The
student is a model with a distillation token and head (``dist_token=True``); in training with
``distilled_training = True`` it returns ``(cls_logits, dist_logits)``, at test time their average.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint import load_checkpoint, load_model
from ..data import resize, soft_target_cross_entropy


def load_teacher(path: str | Path, device: torch.device | str = "cpu", ema: bool = False) -> nn.Module:
    """A frozen teacher in eval mode from any vitlab checkpoint (its model is rebuilt from the record)."""
    ckpt = load_checkpoint(path)
    teacher = load_model(ckpt["model_name"], ckpt, ema=ema and bool(ckpt.get("ema")))
    return teacher.to(device).eval().requires_grad_(False)


def check_student(model: nn.Module) -> None:
    if getattr(model, "head_dist", None) is None:
        raise ValueError(
            "distillation needs a student with a distillation token and head; add --dist-token "
            "(a ViT-family model) or drop --teacher"
        )


class HardDistillationLoss(nn.Module):
    """``½·base(cls_logits, target) + ½·CE(dist_logits, argmax teacher(x))``.

    ``base`` is soft-target cross-entropy (labels may be Mixup/CutMix soft targets with label smoothing,
    as in DeiT); the teacher sees the same augmented images, resized to its own input size if that differs.
    """

    def __init__(self, teacher: nn.Module, smoothing: float = 0.0, alpha: float = 0.5) -> None:
        super().__init__()
        self.teacher, self.smoothing, self.alpha = teacher, smoothing, alpha
        self.teacher_input = tuple(teacher.meta["input_size"]) if hasattr(teacher, "meta") else None

    def check_student(self, student: nn.Module, in_chans: int) -> None:
        check_student(student)
        t, s = getattr(self.teacher, "num_classes", None), getattr(student, "num_classes", None)
        if t is not None and s is not None and t != s:
            raise ValueError(f"the teacher predicts {t} classes, the student {s}; use a teacher trained on this data")
        if self.teacher_input is not None and self.teacher_input[0] != in_chans:
            raise ValueError(f"the teacher takes {self.teacher_input[0]}-channel images, the data has {in_chans}")

    @torch.no_grad()
    def teacher_labels(self, x: Tensor) -> Tensor:
        if self.teacher_input is not None and tuple(x.shape[-2:]) != self.teacher_input[1:]:
            x = resize(x, self.teacher_input[1:])
        return self.teacher(x).argmax(-1)

    def forward(self, x: Tensor, outputs: tuple[Tensor, Tensor], target: Tensor) -> Tensor:
        if not isinstance(outputs, tuple):
            raise ValueError("the student must return (cls_logits, dist_logits): set model.distilled_training = True")
        cls_logits, dist_logits = outputs
        base = soft_target_cross_entropy(cls_logits, target, self.smoothing)
        distill = F.cross_entropy(dist_logits, self.teacher_labels(x))
        return (1 - self.alpha) * base + self.alpha * distill
