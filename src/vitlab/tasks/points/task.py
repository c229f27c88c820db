"""Point clouds as a task of the training engine (``vitlab points train``, :mod:`vitlab.cli.points`): the hooks of
:mod:`vitlab.engine.tasks` over :mod:`vitlab.tasks.points`, with PCT's augmentation and label smoothing ``--smoothing``.
Shape classification (``modelnet40:`` data) is evaluated each epoch by ``val_oa`` (overall accuracy, which
chooses ``best.pt``) and ``val_macc`` (mean-class accuracy); part segmentation (``shapenetpart:`` data, a
``pct_partseg_*`` model) by ``val_instance_miou`` (chooses ``best.pt``) and ``val_category_miou``, on the test
split; its ``train_acc`` is the accuracy over the points."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...common.device import autocast, resolve_device
from ...data import BatchLoader
from ...engine.config import EpochTally, Run, TrainConfig, TrainingError
from ...engine.dense import PixelLoss, PixelTally
from ...engine.losses import PlainLoss
from ...engine.tasks import load_task_model, register_task
from .data import augment, open_points
from .metrics import classification_accuracy, part_miou, part_predictions
from .models import POINT_MODELS, build_point_model


class PartLoss(PixelLoss):
    """Cross-entropy over the points of part logits ``(B, N, parts)`` (the pixel loss with the classes last)."""

    def forward(self, x, logits, target, dense=None):
        return super().forward(x, logits.transpose(1, 2), target)


class PointTally(PixelTally):
    """Accuracy over the points of part logits ``(B, N, parts)`` (the pixel tally with the classes last)."""

    def add(self, loss, logits, y) -> None:
        super().add(loss, logits.transpose(1, 2), y)


UNSUPPORTED = ("mixup", "cutmix", "teacher", "token_label", "dist_token", "auto_augment", "img_size", "init_from")
UNSUPPORTED += ("fsdp",)  # FSDP shards a model's blocks; a point model has none


class PointsTask:
    """The engine's hooks for point clouds (:mod:`vitlab.engine.tasks`): classification, or part segmentation."""

    def __init__(self, partseg: bool = False) -> None:
        self.partseg = partseg
        self.score = "val_instance_miou" if partseg else "val_oa"

    def open_data(self, draft: Any) -> None:
        cfg = draft.cfg
        bad = [k for k in UNSUPPORTED if getattr(cfg, k) not in (None, False, 0, 0.0)]
        if bad:
            raise TrainingError(f"vitlab points train does not take --{', --'.join(b.replace('_', '-') for b in bad)}")
        if self.partseg != ("partseg" in cfg.model):
            want = "a pct_partseg_* model" if self.partseg else "a classifier"
            raise TrainingError(f"--model {cfg.model}: {cfg.data} needs {want} ({', '.join(POINT_MODELS)})")
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
        if self.partseg:
            return {"num_parts": 50, "num_categories": int(train_ds.num_classes), "in_chans": 3, **cfg.model_args}
        return {"num_classes": int(train_ds.num_classes), "in_chans": train_ds.in_chans, **cfg.model_args}

    def build_model(self, name: str, kwargs: dict[str, Any]) -> nn.Module:
        try:
            return build_point_model(name, **kwargs)
        except TypeError as e:
            raise TrainingError(f"--model-arg: {e}") from None

    def criterion(self, cfg: TrainConfig, model: nn.Module) -> nn.Module:
        return PartLoss(cfg.smoothing) if self.partseg else PlainLoss(cfg.smoothing)

    def build_loaders(self, draft: Any) -> None:
        cfg, world = draft.cfg, draft.world
        draft.loader = BatchLoader(draft.train_ds, draft.per_rank, shuffle=True, drop_last=True, transform=augment,
                                   seed=cfg.seed, rank=world.rank, world_size=world.size, device=draft.device)  # fmt: skip
        draft.val_loader, draft.data_cfg = None, None

    def tally(self, state: dict[str, Any] | None, device: torch.device, sums: bool = True) -> EpochTally:
        return (PointTally if self.partseg else EpochTally).restore(state, device, sums)

    def evaluate(self, run: Run) -> dict[str, Any]:
        model = run.net.model if run.cfg.fsdp else run.net.raw
        ev = evaluate_points(model, run.data.val_ds, run.device, run.cfg.eval_batch_size, run.dtype)
        return {"val_loss": ev.pop("loss"), **{f"val_{k}": v for k, v in ev.items() if k != "n"}}

    def report(self, run: Run, row: dict[str, Any]) -> str:
        best = "  (best)" * (row.get(self.score) == run.progress.best_top1)
        if self.partseg:
            held = f"instance mIoU {row['val_instance_miou']:.2f} category mIoU {row['val_category_miou']:.2f}"
        else:
            held = f"OA {row['val_oa']:.2f}% mAcc {row['val_macc']:.2f}%"
        return (
            f"epoch {row['epoch']}/{run.cfg.epochs}  loss {row['train_loss']:.4f}  train {row['train_acc']:.1f}%  "
            f"held-out {held}{best}  lr {row['lr']:.2e}  {row['train_img_s']:.0f} shapes/s"
        )


@torch.no_grad()
def evaluate_points(model: nn.Module, ds: Any, device: torch.device, batch: int = 64,
                    dtype: torch.dtype | None = None) -> dict[str, float]:  # fmt: skip
    """Of ``model`` over the point set ``ds``: OA and mAcc (%), or for part segmentation the instance and
    category mIoU (%); the mean cross-entropy."""
    was_training = model.training
    model.eval()
    logits = []
    for i in range(0, len(ds), batch):
        x, _ = ds.get_batch(torch.arange(i, min(i + batch, len(ds))))
        with autocast(device, dtype):
            logits.append(model(x.to(device)).float().cpu())
    model.train(was_training)
    out = torch.cat(logits)
    if ds.parts is not None:
        result = part_miou(part_predictions(out, ds.labels), ds.parts, ds.labels)
        loss = F.cross_entropy(out.flatten(0, 1), ds.parts.flatten())
    else:
        result = classification_accuracy(out.argmax(-1), ds.labels, ds.num_classes)
        loss = F.cross_entropy(out, ds.labels)
    return {**result, "loss": loss.item(), "n": len(ds)}


def evaluate_checkpoint(path: str, data: str, device: str = "auto") -> tuple[dict[str, Any], dict[str, float]]:
    """``vitlab points eval``: the checkpoint a ``vitlab points train`` run saved at ``path``, and its held-out
    figures on the test split of ``data``."""
    model, ckpt = load_task_model(path, "points", "points", build_point_model)
    dev = resolve_device(device)
    return ckpt, evaluate_points(model.to(dev), open_points(data, "test"), dev)


register_task("points", lambda cfg: PointsTask(partseg=cfg.data.startswith("shapenetpart:")))
