"""Object detection and instance segmentation: COCO-layout data with DETR's augmentation (:mod:`.data`, its format
checked in :mod:`.coco_format`), DETR with the position encoding a switch (sine, learned, CPVT's PEG, none:
:mod:`.detr`, :mod:`.position`, :mod:`.matcher`), torchvision's Faster / Mask R-CNN over any vitlab backbone
(:mod:`.rcnn`, :mod:`.fpn`), box and mask AP by pycocotools (:mod:`.metrics`, :mod:`.infer`). ``vitlab det train |
eval | synth`` runs them through the training engine (:mod:`.task`). Everything flows as :class:`.batch.DetBatch`.
"""

from .batch import DetBatch
from .data import CocoDetection, DetLoader, open_coco
from .infer import evaluate_detector
from .metrics import evaluate_results, load_predictions, to_coco_results
from .models import DETECTORS, build_detector
from .task import DetectionTask  # registers the task with the engine

__all__ = [
    "DETECTORS",
    "CocoDetection",
    "DetBatch",
    "DetLoader",
    "DetectionTask",
    "build_detector",
    "evaluate_detector",
    "evaluate_results",
    "load_predictions",
    "open_coco",
    "to_coco_results",
]
