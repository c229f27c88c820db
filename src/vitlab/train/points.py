"""Point-cloud shape classification as a task of the training engine (``vitlab points train``, :mod:`.points_cli`):
the hooks of :mod:`vitlab.train.tasks` over :mod:`vitlab.points`. PCT's augmentation, label smoothing
``--smoothing``, and each epoch's held-out ``val_oa`` (overall accuracy, which chooses ``best.pt``) and
``val_macc`` (mean-class accuracy)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data import BatchLoader
from ..device import autocast
from ..points import POINT_MODELS, augment, build_point_model, classification_accuracy, open_points
from .config import EpochTally, Run, TrainConfig, TrainingError
from .losses import PlainLoss

CLASSIFIERS = tuple(n for n in POINT_MODELS if "partseg" not in n)
UNSUPPORTED = ("mixup", "cutmix", "teacher", "token_label", "dist_token", "auto_augment", "img_size", "init_from")
UNSUPPORTED += ("fsdp",)  # FSDP shards a model's blocks; a point model has none


class PointsTask:
    """The engine's hooks for point-cloud classification (:mod:`vitlab.train.tasks`)."""

    score = "val_oa"

    def open_data(self, draft: Any) -> None:
        cfg = draft.cfg
        bad = [k for k in UNSUPPORTED if getattr(cfg, k) not in (None, False, 0, 0.0)]
        if bad:
            raise TrainingError(f"vitlab points train does not take --{', --'.join(b.replace('_', '-') for b in bad)}")
        try:
            draft.train_ds, draft.val_ds = open_points(cfg.data, "train"), open_points(cfg.data, "test")
        except (ValueError, OSError) as e:
            raise TrainingError(str(e)) from None
        if cfg.batch_size > len(draft.train_ds) or cfg.batch_size % draft.world.size:
            raise TrainingError(
                f"batch size {cfg.batch_size}: must be at most the {len(draft.train_ds)} training shapes and "
                f"divisible by the {draft.world.size} processes"
            )

    def model_kwargs(self, cfg: TrainConfig, train_ds: Any) -> dict[str, Any]:
        return {"num_classes": int(train_ds.num_classes), "in_chans": train_ds.in_chans, **cfg.model_args}

    def build_model(self, name: str, kwargs: dict[str, Any]) -> nn.Module:
        try:
            return build_point_model(name, **kwargs)
        except TypeError as e:
            raise TrainingError(f"--model-arg: {e}") from None

    def criterion(self, cfg: TrainConfig, model: nn.Module) -> nn.Module:
        return PlainLoss(cfg.smoothing)

    def build_loaders(self, draft: Any) -> None:
        cfg, world = draft.cfg, draft.world
        draft.loader = BatchLoader(draft.train_ds, draft.per_rank, shuffle=True, drop_last=True, transform=augment,
                                   seed=cfg.seed, rank=world.rank, world_size=world.size, device=draft.device)  # fmt: skip
        draft.val_loader, draft.data_cfg = None, None

    def tally(self, state: dict[str, Any] | None, device: torch.device) -> EpochTally:
        return EpochTally.restore(state, device)

    def evaluate(self, run: Run) -> dict[str, Any]:
        model = run.net.model if run.cfg.fsdp else run.net.raw
        ev = evaluate_points(model, run.data.val_ds, run.device, run.cfg.eval_batch_size, run.dtype)
        return {"val_loss": ev["loss"], "val_oa": ev["oa"], "val_macc": ev["macc"]}

    def report(self, run: Run, row: dict[str, Any]) -> str:
        best = "  (best)" * (row.get("val_oa") == run.progress.best_top1)
        return (
            f"epoch {row['epoch']}/{run.cfg.epochs}  loss {row['train_loss']:.4f}  train {row['train_acc']:.1f}%  "
            f"held-out OA {row['val_oa']:.2f}% mAcc {row['val_macc']:.2f}%{best}  lr {row['lr']:.2e}  "
            f"{row['train_img_s']:.0f} shapes/s"
        )


@torch.no_grad()
def evaluate_points(model: nn.Module, ds: Any, device: torch.device, batch: int = 64,
                    dtype: torch.dtype | None = None) -> dict[str, float]:  # fmt: skip
    """OA, mAcc (%) and mean cross-entropy of ``model`` over the point set ``ds``."""
    was_training = model.training
    model.eval()
    logits = []
    for i in range(0, len(ds), batch):
        with autocast(device, dtype):
            logits.append(model(ds.points[i : i + batch].to(device)).float().cpu())
    model.train(was_training)
    out = torch.cat(logits)
    result = classification_accuracy(out.argmax(-1), ds.labels, ds.num_classes)
    return {**result, "loss": F.cross_entropy(out, ds.labels).item(), "n": len(ds)}
