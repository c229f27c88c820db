"""Semantic segmentation: models over any backbone's feature pyramid, or EANet's network (the head on a dilated
ResNet's last stage), with an external-attention, self-attention or plain head; VOC / ADE20K / Cityscapes mask
data with joint image-mask transforms; whole-image, sliding-window and multi-scale + flip inference; mIoU and
per-class IoU.
``vitlab seg train | eval | synth`` runs them through the training engine (:mod:`vitlab.tasks.segmentation.task`)."""

from .data import IGNORE_INDEX, LAYOUTS, MaskDataset, SegLoader, open_masks
from .infer import INFER_MODES, MS_SCALES, evaluate_segmentation, predict
from .metrics import ConfusionMatrix, iou_from_confusion
from .models import DECODERS, EA_NORMS, HEADS, Segmenter, build_segmenter
from .task import SegmentationTask  # registers the task with the engine

__all__ = [
    "DECODERS",
    "EA_NORMS",
    "HEADS",
    "IGNORE_INDEX",
    "INFER_MODES",
    "LAYOUTS",
    "MS_SCALES",
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
