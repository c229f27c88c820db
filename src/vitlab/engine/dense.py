"""What the dense tasks' training shares (segmentation's pixels, part segmentation's points): the per-element
cross-entropy over labelled elements and the epoch's sums with its accuracy. A label of :data:`IGNORE_INDEX`
(VOC's 255: object boundaries, "void") counts neither in the loss nor in the accuracy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..common.distributed import all_reduce_sum
from .config import EpochTally, Run

IGNORE_INDEX = 255


class PixelLoss(nn.Module):
    """Per-pixel cross-entropy over the labelled pixels (255 ignored), with label smoothing."""

    def __init__(self, smoothing: float = 0.0) -> None:
        super().__init__()
        self.smoothing = smoothing

    def forward(self, x: Tensor, logits: Tensor, target: Tensor, dense=None) -> Tensor:
        return F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, label_smoothing=self.smoothing)


@dataclass
class PixelTally(EpochTally):
    """The epoch's sums with the pixel accuracy: ``correct`` counts labelled pixels predicted right,
    ``labelled`` the labelled pixels (``seen`` stays the images, for images/s)."""

    labelled: Tensor | None = None

    @classmethod
    def restore(cls, state: dict[str, Any] | None, device: torch.device) -> PixelTally:
        base = EpochTally.restore(state, device)
        zero = torch.zeros((), device=device, dtype=torch.long)
        labelled = state["labelled"].to(device) if state is not None else zero
        return cls(base.loss_sum, base.correct, base.seen, labelled)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "labelled": self.labelled.detach().cpu()}

    def add(self, loss: Tensor, logits: Tensor, y: Tensor) -> None:
        keep = y != IGNORE_INDEX
        self.loss_sum += loss.detach().float() * len(y)
        self.correct += ((logits.argmax(1) == y) & keep).sum()
        self.labelled += keep.sum()
        self.seen += len(y)

    def status(self) -> str:
        acc = 100 * self.correct.item() / max(self.labelled.item(), 1)
        return f"loss {self.loss_sum.item() / self.seen:.3f} pixel acc {acc:.1f}%"

    def row(self, run: Run, epoch: int, train_time: float) -> dict[str, Any]:
        row = super().row(run, epoch, train_time)
        sums = all_reduce_sum(torch.stack([self.correct, self.labelled]).double(), run.world)
        row["train_acc"] = (100 * sums[0] / sums[1].clamp_min(1)).item()
        return row
