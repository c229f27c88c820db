"""vitlab models in Hugging Face ``transformers.Trainer``: :class:`TrainerModel` speaks its calling
convention.

The Trainer feeds batches as keyword arguments (``model(**batch)``, columns named after ``forward``'s
parameters: ``pixel_values`` and ``labels``), takes the loss from ``outputs["loss"]`` and the predictions
from the other entries, and switches gradient checkpointing with ``gradient_checkpointing_enable()``.

>>> model = TrainerModel(vitlab.create_model("deit_mini", num_classes=10))
>>> trainer = transformers.Trainer(model=model, args=..., train_dataset=...)  # rows: pixel_values, labels
"""

from __future__ import annotations

import os
from typing import Any

from torch import Tensor, nn

from ..data.mix import soft_target_cross_entropy


class TrainerModel(nn.Module):
    """``forward(pixel_values, labels=None) -> {"loss", "logits"}`` around a vitlab classifier.

    ``labels``: class indices ``(B,)``, or soft targets ``(B, num_classes)`` (Mixup/CutMix); the loss is the
    cross-entropy (with ``label_smoothing`` for indices). Without labels only ``logits`` is returned.
    """

    main_input_name = "pixel_values"
    supports_gradient_checkpointing = True

    def __init__(self, model: nn.Module, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.model, self.label_smoothing = model, label_smoothing

    def forward(self, pixel_values: Tensor, labels: Tensor | None = None) -> dict[str, Tensor]:
        logits = self.model(pixel_values)
        if labels is None:
            return {"logits": logits}
        return {"loss": soft_target_cross_entropy(logits.float(), labels, self.label_smoothing), "logits": logits}

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        self.model.set_grad_checkpointing(True)

    def gradient_checkpointing_disable(self) -> None:
        self.model.set_grad_checkpointing(False)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.model, "grad_checkpointing", False))

    def save_pretrained(self, folder: str | os.PathLike, **_: Any) -> Any:
        """The wrapped model as a vitlab model folder (``vitlab.from_pretrained`` reads it back)."""
        return self.model.save_pretrained(folder)
