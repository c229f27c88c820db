"""Two-stage detectors over any vitlab backbone: torchvision's Faster R-CNN and Mask R-CNN (Ren et al. 2015;
He et al. 2017) on the feature pyramid of :mod:`.fpn`, keeping the detector contract of :mod:`.batch`.

The RPN, RoIAlign, NMS and heads are torchvision's own; vitlab supplies the backbone and the data around them::

    image_i   = images[i, :, :h_i, :w_i]           each image at its resized size (target "size"): the batch's
                                                   padding cut off, so proposals are clipped to the image itself
    x         = PassThrough(image_0 .. image_B)    zero-padded to a multiple of 32 (of the backbone's strides),
                                                   neither normalised nor resized (the data did both)
    p         = DetectionBackbone(x)               .fpn: "0".."3" at strides 4..32 and "pool" at 64, C channels
    proposals = RPN(p)                             AnchorGenerator: one anchor size per level, 3 aspect ratios;
                                                   objectness and box deltas per anchor, NMS per image
    boxes     = RoIHeads(RoIAlign_7x7(p, proposals))    MultiScaleRoIAlign over "0".."3" -> TwoMLPHead (C*49 ->
                                                   R -> R) -> FastRCNNPredictor: C+1 scores, per-class deltas
    masks     = MaskHead(RoIAlign_14x14(p, boxes)) mask_rcnn only: 3x3 convs -> 2x2 deconv -> 28x28 logits

Training (``model.train()``): ``forward`` returns torchvision's losses (RPN objectness and box regression, head
classification and box regression, Mask R-CNN's mask BCE), computed against the batch's targets with labels
shifted to torchvision's ``1..C`` (0 is its background); ``loss`` sums them. Evaluation (``model.eval()``):
``forward`` returns torchvision's detections in the resized image's pixels, masks still as 28x28 probabilities
per box; ``predict`` shifts the labels back to ``0..C-1``, scales the boxes to the original file's pixels
(``orig_size / size``) and pastes each mask into the original image at its scaled box (torchvision's
``paste_masks_in_image``, what its own transform does when it has resized the input itself).

Why not torchvision's ``GeneralizedRCNNTransform``: it subtracts ``image_mean``, divides by ``image_std`` and
rescales every image so its shorter side is ``min_size`` (capped by ``max_size``), in training and evaluation
alike; vitlab's data pipeline already normalised (ImageNet mean/std) and resized (with its own scale
augmentation), so the transform here keeps only its batching: a mean of 0 / std of 1 and a ``min_size`` set to
each image's own side would still resample every image once more.

Sizes: a backbone name ending in ``_mini`` gets :data:`MINI` (32 channels, anchors 8..128 px, few proposals:
the tests' ~64x80 px synthetic images with 10-40 px objects); others :data:`FULL` (torchvision's defaults).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...common.extras import MissingExtra
from .batch import DetBatch
from .fpn import DetectionBackbone

KINDS = ("faster_rcnn", "mask_rcnn")
#: torchvision's own switches of the RPN and the RoI heads that ``build_rcnn`` passes on (other keywords go to
#: the backbone's constructor)
TORCHVISION_OPTIONS = (
    "rpn_pre_nms_top_n_train", "rpn_pre_nms_top_n_test", "rpn_post_nms_top_n_train", "rpn_post_nms_top_n_test",
    "rpn_nms_thresh", "rpn_fg_iou_thresh", "rpn_bg_iou_thresh", "rpn_batch_size_per_image", "rpn_positive_fraction",
    "rpn_score_thresh", "box_score_thresh", "box_nms_thresh", "box_detections_per_img", "box_fg_iou_thresh",
    "box_bg_iou_thresh", "box_batch_size_per_image", "box_positive_fraction",
)  # fmt: skip
#: torchvision's sizes (its ``fasterrcnn_resnet50_fpn`` / ``maskrcnn_resnet50_fpn``)
FULL: dict[str, Any] = dict(
    out_channels=256, anchor_sizes=(32, 64, 128, 256, 512), aspect_ratios=(0.5, 1.0, 2.0), representation_size=1024,
    mask_layers=(256, 256, 256, 256), mask_dim=256,
)  # fmt: skip
#: the minis' sizes: small anchors for ~64x80 px images, a narrow neck and heads, few proposals and samples
MINI: dict[str, Any] = dict(
    out_channels=32, anchor_sizes=(8, 16, 32, 64, 128), aspect_ratios=(0.5, 1.0, 2.0), representation_size=128,
    mask_layers=(32, 32), mask_dim=32, rpn_pre_nms_top_n_train=300, rpn_pre_nms_top_n_test=150,
    rpn_post_nms_top_n_train=100, rpn_post_nms_top_n_test=50, rpn_batch_size_per_image=64,
    box_batch_size_per_image=64,
)  # fmt: skip
HINT = (
    "the R-CNN detectors need torchvision with its compiled ops (torchvision.ops.nms failed: {}); run "
    "scripts/detection_check.sh, or install a torch/torchvision pair that match (pip install 'vitlab[detection]')"
)


@functools.cache
def torchvision_problem() -> str | None:
    """Why torchvision's compiled ops do not run here (one line), or None. Importing torchvision is not enough:
    beside a torch it was not built for, the import fails or ``nms`` is missing only when first called."""
    try:
        import torchvision.ops

        torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
    except Exception as e:  # ImportError, or RuntimeError "operator torchvision::nms does not exist"
        return " ".join(f"{type(e).__name__}: {e}".split())
    return None


def require_torchvision() -> None:
    """Raise :class:`~vitlab.common.extras.MissingExtra` (one line) unless torchvision's ops run."""
    problem = torchvision_problem()
    if problem is not None:
        raise MissingExtra(HINT.format(problem))


class PassThrough(nn.Module):
    """In place of torchvision's ``GeneralizedRCNNTransform`` (module docstring): the images as they come, zero-
    padded at the bottom and right to one ``(B, 3, H, W)`` tensor, H and W multiples of ``size_divisible``;
    ``postprocess`` leaves the detections in the pixels of the images it was given."""

    def __init__(self, size_divisible: int) -> None:
        super().__init__()
        self.size_divisible = size_divisible

    def forward(self, images: list[Tensor], targets: list[dict[str, Tensor]] | None = None) -> tuple[Any, Any]:
        from torchvision.models.detection.image_list import ImageList

        sizes = [(int(im.shape[-2]), int(im.shape[-1])) for im in images]
        d = self.size_divisible
        h, w = (math.ceil(max(s[k] for s in sizes) / d) * d for k in (0, 1))
        batch = images[0].new_zeros(len(images), images[0].shape[0], h, w)
        for out, im in zip(batch, images):
            out[:, : im.shape[-2], : im.shape[-1]].copy_(im)
        return ImageList(batch, sizes), targets

    def postprocess(self, result: list[dict[str, Tensor]], image_shapes: Any, original_sizes: Any) -> Any:
        return result  # the scaling to the file's pixels is predict()'s: it knows orig_size


class RCNN(nn.Module):
    """A torchvision Faster / Mask R-CNN (``net``) on a :class:`~.fpn.DetectionBackbone`, keeping vitlab's
    detector contract (module docstring). Build it with :func:`build_rcnn`."""

    def __init__(self, net: nn.Module, kind: str, num_classes: int, backbone: str) -> None:
        super().__init__()
        self.net, self.kind, self.num_classes, self.backbone_name = net, kind, num_classes, backbone

    @property
    def has_masks(self) -> bool:
        return self.kind == "mask_rcnn"

    def _targets(self, batch: DetBatch) -> list[dict[str, Tensor]]:
        """The batch's targets as torchvision reads them: labels 1..C, and boxes of zero width or height left
        out (with their masks): torchvision refuses a batch that has one."""
        out = []
        for t in batch.targets:
            boxes = t["boxes"].float().reshape(-1, 4)
            keep = (boxes[:, 2:] > boxes[:, :2]).all(1)
            target = {"boxes": boxes[keep], "labels": t["labels"].long().reshape(-1)[keep] + 1}
            if self.has_masks:
                if "masks" not in t:
                    raise ValueError("mask_rcnn trains on instance masks; these data have none (use faster_rcnn)")
                target["masks"] = t["masks"][keep]
            out.append(target)
        return out

    def forward(self, batch: DetBatch) -> dict[str, Any]:
        """Training: ``{"losses": {name: scalar}}``; evaluation: ``{"detections": [per image: boxes (resized
        pixels), scores, labels (1..C), masks (n, 1, 28, 28) for mask_rcnn]}``."""
        sizes = [batch.image_size(i) for i in range(len(batch))]
        images = [batch.images[i, :, :h, :w] for i, (h, w) in enumerate(sizes)]
        if self.training:
            return {"losses": self.net(images, self._targets(batch))}
        return {"detections": self.net(images)}

    def loss(self, batch: DetBatch, outputs: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """The sum of torchvision's losses, and each one detached."""
        if "losses" not in outputs:
            raise ValueError("an R-CNN computes its losses in a training-mode forward (model.train())")
        losses = outputs["losses"]
        total = sum(losses.values(), torch.zeros((), device=batch.images.device))
        return total, {k: v.detach() for k, v in losses.items()}

    def predict(self, batch: DetBatch, outputs: dict[str, Any]) -> list[dict[str, Tensor]]:
        """Per image: ``boxes`` xyxy in the original file's pixels, ``scores``, ``labels`` 0..C-1 and, for
        mask_rcnn, ``masks`` float probabilities ``(n, H, W)`` at the original size."""
        if "detections" not in outputs:
            raise ValueError("predict needs the output of an evaluation-mode forward (model.eval())")
        from torchvision.models.detection.roi_heads import paste_masks_in_image

        preds = []
        for i, det in enumerate(outputs["detections"]):
            h, w = batch.image_size(i)
            oh, ow = (int(v) for v in batch.targets[i].get("orig_size", (h, w)))
            scale = det["boxes"].new_tensor([ow / w, oh / h, ow / w, oh / h])
            boxes = det["boxes"] * scale
            pred = {"boxes": boxes, "scores": det["scores"], "labels": det["labels"] - 1}
            if "masks" in det:
                pred["masks"] = paste_masks_in_image(det["masks"], boxes, (oh, ow))[:, 0]
            preds.append(pred)
        return preds

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.net.backbone.set_grad_checkpointing(enable)

    def init_target(self) -> nn.Module:
        """What ``--init-from`` initialises: the backbone's classifier (ImageNet weights, as detectors start)."""
        return self.net.backbone.body.features.model

    def no_weight_decay(self) -> set[str]:
        getter = self.net.backbone.body.features
        inner = getattr(getter.model, "no_weight_decay", lambda: set())()
        return {f"net.backbone.body.features.model.{n}" for n in inner}


def _anchors(sizes: Sequence[int], ratios: Sequence[float]) -> Any:
    from torchvision.models.detection.anchor_utils import AnchorGenerator

    if len(sizes) != 5:
        raise ValueError(f"anchor_sizes: one per pyramid level (0, 1, 2, 3, pool), 5 in all; got {list(sizes)}")
    return AnchorGenerator(tuple((int(s),) for s in sizes), (tuple(float(r) for r in ratios),) * len(sizes))


def build_rcnn(backbone: str, kind: str, num_classes: int, **kw: Any) -> RCNN:
    """A ``kind`` ("faster_rcnn" | "mask_rcnn") detector of ``num_classes`` classes over the registered model
    ``backbone``. Keywords: the sizes of :data:`FULL` / :data:`MINI` (``out_channels``, ``anchor_sizes`` one per
    level, ``aspect_ratios``, ``representation_size``, ``mask_layers``, ``mask_dim``), torchvision's
    :data:`TORCHVISION_OPTIONS`, and anything else for the backbone's constructor (``drop_path_rate``, ...)."""
    if kind not in KINDS:
        raise ValueError(f"R-CNN kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if num_classes < 1:
        raise ValueError(f"a detector needs at least one class, got num_classes={num_classes}")
    require_torchvision()
    from torchvision.models.detection import FasterRCNN, MaskRCNN
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
    from torchvision.ops import MultiScaleRoIAlign

    sizes = MINI if backbone.endswith("_mini") else FULL
    opts = {**sizes, **{k: kw.pop(k) for k in list(kw) if k in sizes or k in TORCHVISION_OPTIONS}}
    tv = {k: opts.pop(k) for k in list(opts) if k in TORCHVISION_OPTIONS}
    channels, rep = int(opts["out_channels"]), int(opts["representation_size"])
    body = DetectionBackbone(backbone, channels, **kw)
    levels = ["0", "1", "2", "3"]
    heads: dict[str, Any] = dict(
        rpn_anchor_generator=_anchors(opts["anchor_sizes"], opts["aspect_ratios"]),
        box_roi_pool=MultiScaleRoIAlign(levels, output_size=7, sampling_ratio=2),
        box_head=TwoMLPHead(channels * 7 * 7, rep),
        box_predictor=FastRCNNPredictor(rep, num_classes + 1),  # + torchvision's background class 0
    )
    if kind == "mask_rcnn":
        layers = [int(c) for c in opts["mask_layers"]]
        predictor = MaskRCNNPredictor(layers[-1], int(opts["mask_dim"]), num_classes + 1)
        # torchvision initialises the 1x1 logits conv with Kaiming over its fan-out (the classes): with a few
        # classes its logits start at +-10 and the mask loss far from its optimum; small weights as Mask R-CNN's
        # reference implementation
        nn.init.normal_(predictor.mask_fcn_logits.weight, std=0.001)
        nn.init.zeros_(predictor.mask_fcn_logits.bias)
        heads.update(
            mask_roi_pool=MultiScaleRoIAlign(levels, output_size=14, sampling_ratio=2),
            mask_head=MaskRCNNHeads(channels, layers, 1),
            mask_predictor=predictor,
        )
    cls = MaskRCNN if kind == "mask_rcnn" else FasterRCNN
    # num_classes=None: the predictors above are given; min/max size and mean/std serve only the transform
    # that PassThrough replaces next
    net = cls(body, None, min_size=1, max_size=1, image_mean=[0.0] * 3, image_std=[1.0] * 3, **heads, **tv)
    net.transform = PassThrough(body.size_divisible)
    return RCNN(net, kind, num_classes, backbone)


__all__ = ["FULL", "KINDS", "MINI", "RCNN", "TORCHVISION_OPTIONS", "PassThrough", "build_rcnn", "require_torchvision"]
