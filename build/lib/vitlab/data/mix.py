"""Soft targets: label smoothing (Szegedy et al. 2016), Mixup (Zhang et al. 2018), CutMix (Yun et al. 2019).

Batch-level mixing as in timm's ``Mixup(mode="batch")``: one lambda per batch, each sample mixed with the
batch reversed; CutMix's lambda is corrected to the pasted box's true area.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def smooth_one_hot(labels: Tensor, num_classes: int, smoothing: float = 0.0) -> Tensor:
    """One-hot targets with label smoothing: ``1 - s + s/K`` on the label, ``s/K`` elsewhere."""
    if labels.ndim != 1 or labels.is_floating_point():
        raise ValueError(f"labels must be an integer vector (B,), got {labels.dtype} {tuple(labels.shape)}")
    if not 0 <= smoothing < 1:
        raise ValueError(f"label smoothing must be in [0, 1), got {smoothing}")
    off = smoothing / num_classes
    out = torch.full((len(labels), num_classes), off, device=labels.device)
    return out.scatter_(1, labels[:, None], 1 - smoothing + off)


def soft_target_cross_entropy(logits: Tensor, target: Tensor, smoothing: float = 0.0) -> Tensor:
    """Mean over the batch of ``-sum_k t_k log softmax(logits)_k``; integer ``target`` is one-hot encoded
    (with ``smoothing``) first."""
    if not target.is_floating_point():
        target = smooth_one_hot(target, logits.shape[-1], smoothing)
    if target.shape != logits.shape:
        raise ValueError(f"soft targets {tuple(target.shape)} must match logits {tuple(logits.shape)}")
    return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()


@dataclass(frozen=True)
class MixParams:
    """What one batch gets: weight ``lam`` of the original sample, and CutMix's box (top, left, h, w)."""

    lam: float = 1.0
    box: tuple[int, int, int, int] | None = None


class MixupCutmix:
    """With probability ``prob`` mix the batch: CutMix with probability ``switch_prob`` (when both alphas
    are > 0), else Mixup; ``lam ~ Beta(alpha, alpha)``. Returns ``(mixed images, soft targets)``."""

    def __init__(
        self,
        mixup_alpha: float = 0.8,
        cutmix_alpha: float = 1.0,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        label_smoothing: float = 0.1,
        num_classes: int = 1000,
    ) -> None:
        if mixup_alpha < 0 or cutmix_alpha < 0 or num_classes < 1:
            raise ValueError(f"need alphas >= 0 and num_classes >= 1, got {mixup_alpha}, {cutmix_alpha}, {num_classes}")
        self.mixup_alpha, self.cutmix_alpha, self.prob = mixup_alpha, cutmix_alpha, prob
        self.switch_prob, self.label_smoothing, self.num_classes = switch_prob, label_smoothing, num_classes

    def sample(self, height: int, width: int, g: torch.Generator | None = None) -> MixParams:
        u = torch.rand(4, generator=g).tolist()
        rng = np.random.default_rng(int(torch.randint(2**62, (1,), generator=g)))
        if u[0] >= self.prob or self.mixup_alpha == self.cutmix_alpha == 0:
            return MixParams()
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha == 0 or u[1] < self.switch_prob)
        lam = float(rng.beta(*(2 * [self.cutmix_alpha if use_cutmix else self.mixup_alpha])))
        if not use_cutmix:
            return MixParams(lam)
        # timm rand_bbox: side sqrt(1 - lam) of the image, uniform centre, clipped to the image
        cut_h, cut_w = int(height * np.sqrt(1 - lam)), int(width * np.sqrt(1 - lam))
        cy, cx = int(u[2] * height), int(u[3] * width)
        top, bottom = np.clip([cy - cut_h // 2, cy + cut_h // 2], 0, height)
        left, right = np.clip([cx - cut_w // 2, cx + cut_w // 2], 0, width)
        box = (int(top), int(left), int(bottom - top), int(right - left))
        return MixParams(1 - box[2] * box[3] / (height * width), box)

    def apply(self, x: Tensor, y: Tensor, p: MixParams) -> tuple[Tensor, Tensor]:
        target = smooth_one_hot(y, self.num_classes, self.label_smoothing).to(x.dtype)
        if p.lam == 1.0:
            return x, target
        if p.box is None:
            x = x * p.lam + x.flip(0) * (1 - p.lam)
        else:
            top, left, h, w = p.box
            x = x.clone()
            x[:, :, top : top + h, left : left + w] = x.flip(0)[:, :, top : top + h, left : left + w]
        return x, target * p.lam + target.flip(0) * (1 - p.lam)

    def __call__(self, x: Tensor, y: Tensor, g: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        return self.apply(x, y, self.sample(x.shape[-2], x.shape[-1], g))

    def __repr__(self) -> str:
        return (
            f"MixupCutmix(mixup_alpha={self.mixup_alpha}, cutmix_alpha={self.cutmix_alpha}, prob={self.prob}, "
            f"switch_prob={self.switch_prob}, label_smoothing={self.label_smoothing}, num_classes={self.num_classes})"
        )
