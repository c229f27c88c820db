"""Point clouds with external attention: PCT-style classifier and part segmenter (naive PCT), the full PCT
classifier (farthest-point sampling and k-NN grouping, :mod:`.neighbours`), ModelNet40 (HDF5) and
ShapeNet-Part readers, overall / mean-class accuracy and instance / category mIoU. ``vitlab points`` trains and
evaluates the classifier through the training engine (:mod:`vitlab.tasks.points.task`)."""

from .data import PointSet, augment, open_points
from .metrics import classification_accuracy, part_miou, part_predictions
from .models import PCT, POINT_MODELS, PartSegmenter, PointClassifier, build_point_model
from .neighbours import farthest_point_sample, knn
from .task import PointsTask  # registers the task with the engine

__all__ = [
    "PCT",
    "POINT_MODELS",
    "PartSegmenter",
    "PointClassifier",
    "PointSet",
    "PointsTask",
    "augment",
    "build_point_model",
    "classification_accuracy",
    "farthest_point_sample",
    "knn",
    "open_points",
    "part_miou",
    "part_predictions",
]
