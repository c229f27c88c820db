"""vitlab models in Hugging Face ``transformers.Trainer``: :class:`TrainerModel` speaks its calling
convention, and what the Trainer saves is a folder vitlab reads.

The Trainer feeds batches as keyword arguments (``model(**batch)``, columns named after ``forward``'s
parameters: ``pixel_values`` and ``labels``), takes the loss from ``outputs["loss"]`` and the predictions
from the other entries, and switches gradient checkpointing with ``gradient_checkpointing_enable(...)``.

Saving: the Trainer writes ``model.state_dict()`` of a model that is not one of its own classes to
``model.safetensors`` (checkpoints and ``save_model()``); :class:`TrainerModel`'s state dict is the wrapped
model's (no ``model.`` prefix), and :func:`save_callback` writes the folder's ``config.json`` (by the model's
``save_pretrained``) into every checkpoint and, at the end of training, into the output folder, so that
``vitlab.from_pretrained(folder)`` and ``vitlab.create_model(name, checkpoint_path=folder)`` read it.

>>> model = TrainerModel(vitlab.create_model("deit_mini", num_classes=10))
>>> trainer = transformers.Trainer(model=model, args=..., train_dataset=..., callbacks=[save_callback()])
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ..common.extras import require
from ..data.mix import soft_target_cross_entropy

#: the prefix the wrapped model's keys would carry in a plain state dict of the wrapper
PREFIX = "model."


class TrainerModel(nn.Module):
    """``forward(pixel_values, labels=None) -> {"loss", "logits"}`` around a vitlab classifier.

    ``labels``: class indices ``(B,)``, or soft targets ``(B, num_classes)`` (Mixup/CutMix); the loss is the
    cross-entropy (with ``label_smoothing`` for indices). Without labels only ``logits`` is returned.
    ``state_dict`` / ``load_state_dict`` are the wrapped model's (what the Trainer saves and resumes from).
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

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: dict[str, Any] | None = None, **_: Any
    ) -> None:
        """Recompute each block in backward. The Trainer's options (``use_reentrant``, and what newer
        transformers pass, e.g. ``every_n_layers``) are accepted; vitlab's recomputation is its own
        (non-reentrant, every block)."""
        self.model.set_grad_checkpointing(True)

    def gradient_checkpointing_disable(self) -> None:
        self.model.set_grad_checkpointing(False)

    # the names newer transformers call (the gradient_* ones are deprecated there)
    activation_checkpointing_enable = gradient_checkpointing_enable
    activation_checkpointing_disable = gradient_checkpointing_disable

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.model, "grad_checkpointing", False))

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """The wrapped model's weights; keys of a plain wrapper state dict (``model.`` prefix) are accepted."""
        if state_dict and all(k.startswith(PREFIX) for k in state_dict):
            state_dict = {k[len(PREFIX) :]: v for k, v in state_dict.items()}
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def save_pretrained(self, folder: str | os.PathLike, **_: Any) -> Any:
        """The wrapped model as a vitlab model folder (``vitlab.from_pretrained`` reads it back)."""
        return self.model.save_pretrained(folder)


def save_folder(model: nn.Module, folder: str | os.PathLike) -> None:
    """Write ``model`` (a :class:`TrainerModel`, possibly wrapped by the Trainer) into ``folder`` as a vitlab
    model folder; what the callback does after each save."""
    while not isinstance(model, TrainerModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module  # DistributedDataParallel and the like
    if not isinstance(model, TrainerModel):
        raise ValueError(f"save_callback() needs the Trainer's model to be a vitlab TrainerModel, got {type(model)}")
    model.save_pretrained(folder)


def save_callback() -> Any:
    """A ``transformers.TrainerCallback`` that makes each checkpoint folder (``checkpoint-<step>``) and, at the
    end of training, the output folder a vitlab model folder (``config.json`` + ``model.safetensors``)."""
    transformers = require("transformers", purpose="the Hugging Face Trainer callback")

    class SavePretrained(transformers.TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **_: Any) -> None:
            if state.is_world_process_zero and model is not None:
                save_folder(model, Path(args.output_dir) / f"checkpoint-{state.global_step}")

        def on_train_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **_: Any) -> None:
            if state.is_world_process_zero and model is not None:
                save_folder(model, args.output_dir)

    return SavePretrained()
