"""What the dense tasks' training shares (segmentation's pixels, part segmentation's points): the per-element
cross-entropy over labelled elements and the epoch's sums with its accuracy. A label of :data:`IGNORE_INDEX`
(VOC's 255: object boundaries, "void") counts neither in the loss nor in the accuracy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import EpochTally, TrainConfig, TrainingError

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
    def restore(cls, state: dict[str, Any] | None, device: torch.device, sums: bool = True) -> PixelTally:
        base = EpochTally.restore(state, device, sums)
        zero = torch.zeros((), dtype=torch.long)
        labelled = (state or {}).get("labelled", zero) if sums else zero
        return cls(base.loss_sum, base.correct, base.seen, base.seconds, labelled=labelled.to(device))

    def _sums(self) -> dict[str, Tensor]:
        return {**super()._sums(), "labelled": self.labelled}

    def add(self, loss: Tensor, logits: Tensor, y: Tensor) -> None:
        keep = y != IGNORE_INDEX
        self.loss_sum += loss.detach().float() * len(y)
        self.correct += ((logits.argmax(1) == y) & keep).sum()
        self.labelled += keep.sum()
        self.seen += len(y)

    def status(self) -> str:
        acc = 100 * self.correct.item() / max(self.labelled.item(), 1)
        return f"loss {self.loss_sum.item() / self.seen:.3f} pixel acc {acc:.1f}%"

    def accuracy(self, totals: dict[str, float]) -> float:
        return 100 * totals["correct"] / max(totals["labelled"], 1)


#: classification options an image task trained on its own folders has no use for, at their "off" values: refused
#: rather than silently ignored (FSDP shards a model's block stack; a decoder or a detector is not one)
CLASSIFICATION_ONLY: dict[str, Any] = {"mixup": 0.0, "cutmix": 0.0, "teacher": None, "token_label": False,
                                       "dist_token": False, "auto_augment": None, "reprob": 0.0, "aug_repeats": 1,
                                       "train_limit": None, "holdout": None, "fsdp": False}  # fmt: skip


def open_image_task_data(draft: Any, command: str, open_split: Callable[[TrainConfig, str], Any],
                         unsupported: dict[str, Any] = CLASSIFICATION_ONLY) -> None:  # fmt: skip
    """The ``open_data`` hook of an image task trained on its own folders (``vitlab seg|det train``): classification
    options it has no use for refused in one line, the batch split evenly over the processes, the two splits
    opened, and a batch no larger than the training images."""
    cfg, world = draft.cfg, draft.world
    bad = [k for k, v in unsupported.items() if getattr(cfg, k) != v]
    if bad:
        raise TrainingError(f"{command} does not take --{', --'.join(b.replace('_', '-') for b in bad)}")
    if cfg.batch_size % world.size:
        raise TrainingError(f"the batch {cfg.batch_size} must be divisible by the {world.size} processes")
    draft.train_ds, draft.val_ds = open_split(cfg, "train"), open_split(cfg, "val")
    if cfg.batch_size // world.size > len(draft.train_ds) // world.size:
        raise TrainingError(
            f"batch size {cfg.batch_size} exceeds the {len(draft.train_ds)} training images; use a smaller one"
        )
