"""Object detection and instance segmentation as a task of the training engine (``vitlab det train``): the hooks
of :mod:`vitlab.engine.tasks` over :mod:`vitlab.tasks.detection`'s data, detectors and COCO evaluation.

A run trains the detector ``--model-arg detector=detr|faster_rcnn|mask_rcnn`` over the backbone ``--model`` (any
registered model; DETR's other switches, e.g. ``pos=sine|learned|peg|none``, are ``--model-arg`` s too) on a
COCO-layout folder (``coco:ROOT``): images resized so their shorter side is one of DETR's scales below
``--img-size`` (longer side capped at 1333/800 of it), flipped with ``--hflip``; the loss is the detector's own
(DETR's matched set loss, or the R-CNN's RPN and head losses). Every epoch the held-out split is predicted at
``--img-size`` and scored by pycocotools: ``val_box_ap`` (which chooses ``best.pt``), ``val_box_ap50``,
``val_box_ap75`` and, for a model with masks, ``val_mask_ap``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...common import options as opt
from ...common.device import resolve_device
from ...engine.config import EpochTally, Run, TrainConfig, TrainingError
from ...engine.dense import open_image_task_data
from ...engine.tasks import load_task_model, register_task
from .data import DetLoader, open_coco
from .infer import evaluate_detector
from .models import build_detector

DEFAULT_SIZE = 800  # DETR's evaluation size (shorter side); training draws from its scales below it


def _checked_spec(text: str) -> str:
    open_coco(text, "val", masks=False)  # the spec, the layout and the annotation file, read once: one line now
    return text


#: argparse type of ``vitlab det --data``: the text, once it names a readable COCO-layout folder
coco_spec = opt.Validated(_checked_spec, "detection data")


def open_split(cfg: TrainConfig, split: str) -> Any:
    """One split ("train" / "val") of the run's COCO data, with instance masks for a detector that learns them;
    a problem with it as one line."""
    try:
        return open_coco(cfg.data, split, masks=cfg.model_args.get("detector") == "mask_rcnn")
    except (ValueError, OSError) as e:
        raise TrainingError(str(e)) from None


def eval_size(cfg: TrainConfig) -> int:
    return cfg.img_size or DEFAULT_SIZE


class DetectionLoss(nn.Module):
    """The detector's own loss of its outputs (the engine's criterion signature): DETR matches its queries to
    the targets, an R-CNN returns its losses from the forward pass."""

    def __init__(self, detector: nn.Module) -> None:
        super().__init__()
        self.detector = [detector]  # not a submodule: the engine spreads and saves the model, not its loss

    def forward(self, x: Any, outputs: dict[str, Any], target: Any, dense: Any = None) -> Tensor:
        total, _ = self.detector[0].loss(x, outputs)
        return total


class DetTally(EpochTally):
    """The epoch's loss sums; a detector has no training accuracy (its score is the held-out AP)."""

    def add(self, loss: Tensor, logits: Any, y: Any) -> None:
        self.loss_sum += loss.detach().float() * len(y)
        self.seen += len(y)

    def status(self) -> str:
        return f"loss {self.loss_sum.item() / max(self.seen, 1):.3f}"

    def accuracy(self, totals: dict[str, float]) -> None:
        return None


class DetectionTask:
    """The engine's hooks for detection (module docstring)."""

    score = "val_box_ap"

    def open_split(self, cfg: TrainConfig, split: str) -> Any:
        return open_split(cfg, split)

    def open_data(self, draft: Any) -> None:
        open_image_task_data(draft, "vitlab det train", open_split)

    def model_kwargs(self, cfg: TrainConfig, train_ds: Any) -> dict[str, Any]:
        """The classes, the ``--model-arg`` s (detector kind and its switches), drop path into the backbone."""
        kw = {"num_classes": int(train_ds.num_classes), **cfg.model_args}
        if cfg.drop_path > 0:
            kw["drop_path_rate"] = cfg.drop_path
        return kw

    def build_model(self, name: str, kwargs: dict[str, Any]) -> nn.Module:
        try:
            return build_detector(name, **kwargs)
        except TypeError as e:  # a --model-arg neither the detector nor its backbone takes
            raise TrainingError(f"--model-arg: {e}") from None

    def criterion(self, cfg: TrainConfig, model: nn.Module) -> nn.Module:
        return DetectionLoss(model)

    def build_loaders(self, draft: Any) -> None:
        cfg, world = draft.cfg, draft.world
        hflip = 0.5 if cfg.hflip is None else cfg.hflip
        draft.loader = DetLoader(draft.train_ds, draft.per_rank, eval_size(cfg), seed=cfg.seed, rank=world.rank,
                                 world_size=world.size, device=draft.device, hflip=hflip,
                                 workers=cfg.workers)  # fmt: skip
        draft.val_loader, draft.data_cfg = None, None  # held-out images are predicted at their own size

    def tally(self, state: dict[str, Any] | None, device: torch.device, sums: bool = True) -> DetTally:
        base = EpochTally.restore(state, device, sums)
        return DetTally(base.loss_sum, base.correct, base.seen, base.seconds)

    def evaluate(self, run: Run) -> dict[str, Any]:
        size, batch = eval_size(run.cfg), min(run.cfg.eval_batch_size, run.per_rank)  # 256 COCO images: too many
        ev = evaluate_detector(run.net.raw, run.data.val_ds, run.device, size, batch, dtype=run.dtype)
        row = {f"val_box_{k.lower()}": v for k, v in ev["bbox"].items()}
        row.update({f"val_mask_{k.lower()}": v for k, v in ev.get("segm", {}).items()})
        row["eval_img_s"] = ev["img_s"]
        if run.ema is not None:
            ema = evaluate_detector(run.ema.module, run.data.val_ds, run.device, size, batch, dtype=run.dtype)
            row["ema_box_ap"] = ema["bbox"]["AP"]
        return row

    def report(self, run: Run, row: dict[str, Any]) -> str:
        ema = f"  ema box AP {row['ema_box_ap']:.1f}" if "ema_box_ap" in row else ""
        mask = f"  mask AP {row['val_mask_ap']:.1f}" if "val_mask_ap" in row else ""
        best = "  (best)" * (row.get("val_box_ap") == run.progress.best_top1)
        return (
            f"epoch {row['epoch']}/{run.cfg.epochs}  loss {row['train_loss']:.4f}  held-out box AP "
            f"{row['val_box_ap']:.1f} (AP50 {row['val_box_ap50']:.1f}, AP75 {row['val_box_ap75']:.1f}){mask}{ema}"
            f"{best}  lr {row['lr']:.2e}  {row['train_img_s']:.1f} img/s  {row['train_time_s']:.1f} s"
        )


def evaluate_checkpoint(
    path: str,
    data: str,
    split: str = "val",
    size: int | None = None,
    device: str = "auto",
    ema: bool = False,
    limit: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """``vitlab det eval CKPT``: the detector a ``vitlab det train`` run saved at ``path`` (its EMA weights with
    ``ema``), and its box (and mask) AP on ``split`` of ``data`` at the shorter side ``size`` (default the
    training run's). Returns (checkpoint, figures, dataset)."""
    model, ckpt = load_task_model(path, "detection", "det", build_detector, ema)
    dev = resolve_device(device)
    ds = open_coco(data, split, masks=False)  # the evaluator reads the annotation file's masks itself
    if ds.num_classes != ckpt["model_kwargs"]["num_classes"]:
        raise ValueError(f"{data} has {ds.num_classes} categories, the model {ckpt['model_kwargs']['num_classes']}")
    size = size or ckpt.get("config", {}).get("img_size") or DEFAULT_SIZE
    return ckpt, evaluate_detector(model.to(dev), ds, dev, size, limit=limit, keep_results=True), ds


register_task("detection", lambda cfg: DetectionTask())
