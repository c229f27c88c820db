"""Semantic segmentation: models over any backbone's feature pyramid (EANet head or plain), VOC / ADE20K mask
data with joint image-mask transforms, whole-image and sliding-window inference, mIoU and per-class IoU.
``vitlab seg train | eval | synth`` runs them through the training engine (:mod:`vitlab.tasks.segmentation.task`)."""

from .data import IGNORE_INDEX, LAYOUTS, MaskDataset, SegLoader, open_masks
from .infer import INFER_MODES, evaluate_segmentation, predict
from .metrics import ConfusionMatrix, iou_from_confusion
from .models import EA_NORMS, HEADS, Segmenter, build_segmenter
from .task import SegmentationTask  # registers the task with the engine

__all__ = [
    "EA_NORMS",
    "HEADS",
    "IGNORE_INDEX",
    "INFER_MODES",
    "LAYOUTS",
    "ConfusionMatrix",
    "MaskDataset",
    "SegLoader",
    "SegmentationTask",
    "Segmenter",
    "build_segmenter",
    "evaluate_segmentation",
    "iou_from_confusion",
    "open_masks",
    "predict",
]
