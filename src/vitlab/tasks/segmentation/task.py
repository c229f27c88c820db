"""Semantic segmentation as a task of the training engine (``vitlab seg train``): the hooks of
:mod:`vitlab.engine.tasks`, over :mod:`vitlab.tasks.segmentation`'s data, models and metrics.

A run trains a :class:`~vitlab.tasks.segmentation.Segmenter` (``--model`` names its backbone;
``--model-arg decoder=pyramid|eanet``, ``head=ea|sa|sa_dn|plain``, ``memory_size=S``, ``ea_norm=double|softmax``,
``channels=C``, ``aux_weight=W`` shape the decoder) on ``--img-size`` crops of VOC, ADE20K or Cityscapes
image-mask pairs with the per-pixel cross-entropy (label 255 ignored; ``--smoothing`` as label smoothing; with an
auxiliary head, ``CE(logits) + W * CE(aux)``, :class:`SegLoss`), and evaluates every epoch on the held-out split
with sliding windows at each image's own size: ``val_miou`` (which chooses ``best.pt``), ``val_aacc``,
``val_macc``, ``val_loss``. The training row's ``train_acc`` is the pixel accuracy over the labelled pixels (of
the main logits).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...common.device import resolve_device
from ...engine.config import Run, TrainConfig, TrainingError
from ...engine.data import data_shape
from ...engine.dense import PixelLoss, PixelTally, open_image_task_data
from ...engine.tasks import load_task_model, register_task
from .data import SegLoader, open_masks
from .infer import MS_SCALES, evaluate_segmentation
from .models import build_segmenter


class SegLoss(PixelLoss):
    """:class:`~vitlab.engine.dense.PixelLoss` of the logits, plus ``aux_weight`` times that of the auxiliary
    head's logits when the model returns ``(logits, aux)`` (training with ``aux_weight`` > 0)."""

    def __init__(self, smoothing: float = 0.0, aux_weight: float = 0.0) -> None:
        super().__init__(smoothing)
        self.aux_weight = aux_weight

    def forward(self, x: Tensor, logits: Tensor | tuple[Tensor, Tensor], target: Tensor, dense=None) -> Tensor:
        if not isinstance(logits, tuple):
            return super().forward(x, logits, target)
        main, aux = logits
        return super().forward(x, main, target) + self.aux_weight * super().forward(x, aux, target)


def open_split(cfg: TrainConfig, split: str):
    """One split ("train" / "val") of the run's mask data; a problem with it as one line."""
    try:
        return open_masks(cfg.data, split)
    except (ValueError, OSError) as e:
        raise TrainingError(str(e)) from None


class SegmentationTask:
    """The engine's hooks for semantic segmentation (module docstring)."""

    score = "val_miou"

    def open_split(self, cfg: TrainConfig, split: str):
        """One split of the run's mask data (a study opens them before its rows train)."""
        return open_split(cfg, split)

    def open_data(self, draft: Any) -> None:
        open_image_task_data(draft, "vitlab seg train", open_split)

    def model_kwargs(self, cfg: TrainConfig, train_ds: Any) -> dict[str, Any]:
        """The crop (``--img-size``, else the backbone's input size), the classes, ``--model-arg``s, drop path."""
        kw = {**data_shape(cfg, train_ds), **cfg.model_args}
        if cfg.drop_path > 0:
            kw["drop_path_rate"] = cfg.drop_path
        return kw

    def build_model(self, name: str, kwargs: dict[str, Any]) -> nn.Module:
        try:
            return build_segmenter(name, **kwargs)
        except TypeError as e:  # a --model-arg neither the decoder nor the backbone takes
            raise TrainingError(f"--model-arg: {e}") from None

    def criterion(self, cfg: TrainConfig, model: nn.Module) -> nn.Module:
        return SegLoss(cfg.smoothing, getattr(model, "aux_weight", 0.0))

    def build_loaders(self, draft: Any) -> None:
        cfg, world = draft.cfg, draft.world
        hflip = 0.5 if cfg.hflip is None else cfg.hflip
        draft.loader = SegLoader(draft.train_ds, draft.per_rank, draft.kwargs["img_size"], seed=cfg.seed,
                                 rank=world.rank, world_size=world.size, device=draft.device, hflip=hflip)  # fmt: skip
        draft.val_loader, draft.data_cfg = None, None  # held-out images are read one by one at their own size

    def tally(self, state: dict[str, Any] | None, device: torch.device, sums: bool = True) -> PixelTally:
        return PixelTally.restore(state, device, sums)

    def evaluate(self, run: Run) -> dict[str, Any]:
        model = run.net.model if run.cfg.fsdp else run.net.raw
        crop = run.net.kwargs["img_size"]
        ev = evaluate_segmentation(model, run.data.val_ds, crop, run.device, "slide", dtype=run.dtype)
        row = {"val_loss": ev["loss"], "val_miou": ev["miou"], "val_aacc": ev["aacc"], "val_macc": ev["macc"]}
        row["eval_img_s"] = ev["img_s"]
        if run.ema is not None:
            ema = evaluate_segmentation(run.ema.module, run.data.val_ds, crop, run.device, "slide", dtype=run.dtype)
            row["ema_miou"] = ema["miou"]
        return row

    def report(self, run: Run, row: dict[str, Any]) -> str:
        ema = f"  ema mIoU {row['ema_miou']:.2f}" if "ema_miou" in row else ""
        best = "  (best)" * (row.get("val_miou") == run.progress.best_top1)
        return (
            f"epoch {row['epoch']}/{run.cfg.epochs}  loss {row['train_loss']:.4f}  pixel acc {row['train_acc']:.1f}%  "
            f"held-out mIoU {row['val_miou']:.2f} (aAcc {row['val_aacc']:.1f}, mAcc {row['val_macc']:.1f}){ema}{best}  "
            f"lr {row['lr']:.2e}  {row['train_img_s']:.0f} img/s  {row['train_time_s']:.1f} s"
        )


def evaluate_checkpoint(
    path: str,
    data: str,
    split: str = "val",
    mode: str = "slide",
    stride: int | None = None,
    device: str = "auto",
    ema: bool = False,
    limit: int | None = None,
    scales: tuple[float, ...] = MS_SCALES,
    flip: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``vitlab seg eval``: the checkpoint a ``vitlab seg train`` run saved at ``path`` (its EMA weights with
    ``ema``), and its mIoU, aAcc, mAcc and per-class IoU on ``split`` of ``data`` (``mode``: whole images,
    sliding windows of the training crop ``stride`` apart, or those over the image resized by each of ``scales``
    and, with ``flip``, mirrored: ``msflip``)."""
    model, ckpt = load_task_model(path, "segmentation", "seg", build_segmenter, ema)
    dev = resolve_device(device)
    model.to(dev)
    crop = int(ckpt["model_kwargs"]["img_size"])
    if stride is not None and not 1 <= stride <= crop:
        raise ValueError(f"--stride must lie in [1, {crop}] (the training crop), got {stride}")
    ds = open_masks(data, split)
    if ds.num_classes != model.num_classes:
        raise ValueError(f"{data} has {ds.num_classes} classes, the model {model.num_classes}")
    return ckpt, evaluate_segmentation(model, ds, crop, dev, mode, stride, limit=limit, scales=scales, flip=flip)


register_task("segmentation", lambda cfg: SegmentationTask())
