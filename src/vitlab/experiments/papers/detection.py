"""The papers' detection tables as studies (COCO box and mask AP): CPVT's position encodings in DETR, external
attention in Mask R-CNN, TNT as a Faster R-CNN backbone.

A row trains ``vitlab det train`` (:mod:`vitlab.tasks.detection`): small rows over ``*_mini`` backbones on a
generated COCO-layout folder (``vitlab det synth``), full rows over the paper-size backbones on COCO 2017. The
R-CNN rows need torchvision with its compiled ops (``scripts/detection_check.sh`` makes such an environment).
"""

from __future__ import annotations

from typing import Any

from ..study import PaperValue, Row, Study

# small scale: a generated COCO folder of 64 x 80 images; DETR's optimiser (AdamW 1e-4, weight decay 1e-4,
# gradient norm 0.1) with a constant rate, as DETR trains until its drop
DET_RECIPE = dict(task="detection", img_size=64, epochs=8, batch_size=4, lr=1e-4, weight_decay=1e-4, clip_grad=0.1,
                  warmup_epochs=0.0, smoothing=0.0, drop_path=0.0, lr_drop=None)  # fmt: skip
BOX = (("box_ap", "paper box AP", "{}"),)
BOX_MASK = (("box_ap", "paper box AP", "{}"), ("mask_ap", "paper mask AP", "{}"))


def det_rows(detector: str, *specs: tuple[str, str, str, str, dict[str, Any], dict[str, PaperValue]]
             ) -> tuple[Row, ...]:  # fmt: skip
    """Rows of one ``detector`` from ``(key, label, small backbone, full backbone, switches, paper figures)``."""
    return tuple(
        Row(key, label, small, full, {"detector": detector, **switch}, paper, {"detector": detector, **switch})
        for key, label, small, full, switch, paper in specs
    )


CPVT = "Chu et al. 2021, Conditional Positional Encodings for Vision Transformers (arXiv 2102.10882)"
EA = "Guo et al. 2021, External Attention (arXiv 2105.02358) and the authors' write-up"
TNT = "Han et al. 2021, Transformer in Transformer (arXiv 2103.00112)"

# (key, label, small backbone, full backbone, switches, paper figures) of each table
CPVT_ROWS = [
    ("sine", "DETR, 2-D sine encoding", "resnet_mini", "resnet50", {"pos": "sine"}, {"box_ap": 33.7}),
    ("none", "DETR, no position encoding", "resnet_mini", "resnet50", {"pos": "none"}, {"box_ap": 32.8}),
    ("peg", "DETR, PEG after the first encoder layer", "resnet_mini", "resnet50", {"pos": "peg"}, {"box_ap": 33.9}),
]
NOT_GIVEN = {"box_ap": None, "mask_ap": None}
EA_ROWS = [
    ("sa", "self-attention backbone (T2T-ViT-14)", "t2t_vit_mini", "t2t_vit_14", {}, NOT_GIVEN),
    ("ea", "external-attention backbone (EAMLP-14)", "eamlp_mini", "eamlp_14", {}, NOT_GIVEN),
]
TNT_ROWS = [
    ("deit", "DeiT-S backbone", "deit_mini", "deit_small_patch16_224", {}, {"box_ap": None}),
    ("tnt", "TNT-S backbone", "tnt_mini", "tnt_s_patch16_224", {}, {"box_ap": None}),
]

TABLES: list[Study] = [
    Study(
        "cpvt-detr",
        "CPVT: DETR's position encoding (sine, none, PEG)",
        CPVT,
        "DETR (ResNet-50) on COCO 2017 val, 50 epochs, AdamW, batch 32, weight decay 1e-4, learning rates 2e-5 "
        "(backbone) / 1e-4 (transformer), a tenth from epoch 40",
        det_rows("detr", *CPVT_ROWS),
        measures=BOX,
        notes="The paper's Deformable-DETR rows (the same ordering) need deformable attention, which vitlab does not "
        "have. Full scale: --epochs 50 --batch-size 32 --lr 1e-4 --lr-drop 40 and --model-arg backbone_lr_scale=0.2 "
        "(docs/detection.md).",
        recipe=DET_RECIPE,
    ),
    Study(
        "ea-detection",
        "External attention in Mask R-CNN: the backbone's token mixer, self-attention or external attention",
        EA,
        "COCO 2017 detection and instance segmentation with Mask R-CNN (the write-up's added experiment; its "
        "figures are not in the sources vitlab was built from)",
        det_rows("mask_rcnn", *EA_ROWS),
        measures=BOX_MASK,
        notes="The rows put the same Mask R-CNN (torchvision's, over a simple feature pyramid of the backbone) on "
        "two backbones of one family that differ in their token mixer.",
        recipe=DET_RECIPE,
    ),
    Study(
        "tnt-detection",
        "TNT as a detection backbone beside DeiT (Faster R-CNN)",
        TNT,
        "COCO 2017 object detection with TNT-S and DeiT-S backbones (figures not in the sources vitlab was built from)",
        det_rows("faster_rcnn", *TNT_ROWS),
        measures=BOX,
        notes="Both backbones are plain (one stride): their blocks become a four-level pyramid by deconvolution and "
        "pooling, ViTDet's simple feature pyramid.",
        recipe=DET_RECIPE,
    ),
]
