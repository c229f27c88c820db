"""External Attention, EAMLP and EANet (Guo et al. 2021, arXiv 2105.02358, and the authors' write-up): its
tables as studies.

Classification: softmax against double normalisation for EA and for self-attention (``ea-norm``), BatchNorm in
EAMLP (``ea-batchnorm``), the memory size S (``ea-memory``) and stacked single-head EA layers against
multi-head attention (``ea-heads``). Segmentation (EANet on a VOC, ADE20K or Cityscapes mask folder, scored by
mIoU): the head with and without EA (``ea-seg-head``), double normalisation against softmax (``ea-seg-norm``),
the memory size S (``ea-seg-memory``), EA against self-attention, each with softmax or double normalisation
(``ea-seg-attention``), and EANet itself on dilated ResNet-50 / 101 (``ea-seg-eanet``).

The segmentation rows are EANet's network, the head on the last stage of a ResNet at output stride 8
(``--model-arg decoder=eanet``): at full scale a dilated ResNet-50 (widths 2048 -> 512 -> 256), at small scale
``resnet_mini`` (its 3x3 stride-1 stem keeps a 4x4 last map at 32 px) with a 32 -> 16 wide head on 32-px crops
(``vitlab seg synth``), which trains on a CPU in seconds.
"""

from __future__ import annotations

from typing import Any

from ..study import PaperValue, Row, Study, rows

PAPER = "Guo et al. 2021, External Attention (arXiv 2105.02358) and the authors' write-up"

# EANet at both scales: full, a dilated ResNet-50 (output stride 8) with the head on C5 at the paper's widths;
# small, resnet_mini with a 32-wide head on 32-px crops of a mask folder (vitlab seg synth)
SEG_RECIPE = dict(task="segmentation", img_size=32, epochs=6, batch_size=4, lr=1e-2, warmup_epochs=0.25,
                  weight_decay=0.01, smoothing=0.0, drop_path=0.0)  # fmt: skip
SEG_SMALL = "resnet_mini"
EANET = {"decoder": "eanet"}  # the head on the last stage of a backbone built at output stride 8
SEG_NOTE = (
    "PASCAL VOC val mIoU in the paper (EANet: dilated ResNet + the EA head); here any --data voc:, ade20k: or "
    "cityscapes: folder. Full scale: EANet on a dilated ResNet-50 (randomly initialised: vitlab ships no "
    "ImageNet weights for it; the paper's starts from them)."
)


def seg_rows(*specs: tuple[str, str, dict[str, Any], PaperValue], full: str = "resnet50") -> tuple[Row, ...]:
    """Rows ``(key, label, head switch, paper mIoU)``: EANet over the dilated ResNet ``full`` (full scale) and
    over resnet_mini with a 32-wide head (small)."""
    out = []
    for key, label, switch, paper in specs:
        small = {**EANET, "channels": 32, **switch}
        out.append(Row(key, label, SEG_SMALL, full, {**EANET, **switch}, {"miou": paper}, small))
    return tuple(out)


SEG_MEASURES = (("miou", "paper mIoU (VOC)", "{}"),)
EANET_MEASURES = (
    ("miou", "paper mIoU (VOC)", "{}"),
    ("ade20k", "paper mIoU (ADE20K)", "{}"),
    ("cityscapes", "paper mIoU (Cityscapes)", "{}"),
)
NOT_GIVEN = None  # a figure the paper has but vitlab's sources do not give (shown as "-")
MEMORY = (8, 32, 64, 256)

TABLES: list[Study] = [
    Study(
        "ea-norm",
        "External attention: softmax only vs double normalisation, for EA and for self-attention",
        PAPER,
        "the normalisation ablation (PASCAL VOC segmentation in the paper) and its note that double "
        "normalisation also lifts T2T-ViT on ImageNet by 0.1-0.3",
        rows(
            ("ea_dn", "EA, double normalisation", "eamlp_mini", "eamlp_14", {}, "better (VOC)"),
            (
                "ea_softmax",
                "EA, softmax only",
                "eamlp_softmax_mini",
                "eamlp_14",
                {"mixer": ("external_mh", {"norm": "softmax"})},
                "about 2 mIoU worse (VOC)",
            ),
            ("sa_softmax", "self-attention, softmax", "t2t_vit_mini", "t2t_vit_14", {}, 81.5),
            (
                "sa_dn",
                "self-attention, double normalisation",
                "t2t_vit_dn_mini",
                "t2t_vit_14",
                {"mixer": "attention_double_norm"},
                "+0.1 to +0.3",
            ),
        ),
        measures=(("top1", "paper", "{}"),),
        notes="T2T-ViT-14's 81.5 is the T2T-ViT paper's. Softmax-only EA keeps the softmax over the tokens (Decision E3).",
    ),
    Study(
        "ea-batchnorm",
        "EAMLP: BatchNorm in place of LayerNorm",
        PAPER,
        "EAMLP-7 (the authors' write-up: BatchNorm as in MoCo v3 gave +1.1; larger models diverged)",
        rows(
            ("ln", "LayerNorm", "eamlp_mini", "eamlp_7", {}, 71.7),
            ("bn", "BatchNorm", "eamlp_bn_mini", "eamlp_7_bn", {}, "+1.1 over LayerNorm"),
        ),
        measures=(("top1", "paper", "{}"),),
        notes="EAMLP-7's 71.7 is the official README's (384 px).",
    ),
    Study(
        "ea-memory",
        "External attention: number of memory slots S",
        PAPER,
        "the memory-size ablation (PASCAL VOC mIoU in the paper; S = 64 best, 77.4)",
        rows(
            ("s8", "S = 8", "eamlp_s8_mini", "eamlp_14", {"mixer": ("external_mh", {"memory_size": 8})}, None),
            ("s32", "S = 32", "eamlp_s32_mini", "eamlp_14", {"mixer": ("external_mh", {"memory_size": 32})}, None),
            ("s64", "S = 64", "eamlp_mini", "eamlp_14", {}, 77.4),
            ("s256", "S = 256", "eamlp_s256_mini", "eamlp_14", {"mixer": ("external_mh", {"memory_size": 256})}, None),
        ),
        measures=(("top1", "paper mIoU (VOC)", "{:.1f}"),),
    ),
    Study(
        "ea-heads",
        "External attention: stacked single-head layers against multi-head attention",
        PAPER,
        "the authors' write-up: stacking single-head EA layers gave 63.2 on ImageNet against 71.7 for a transformer "
        "of the same size, whose self-attention with one head fell to 67.4",
        rows(
            ("sa_mh", "self-attention, multi-head", "t2t_vit_mini", "t2t_vit_7", {}, 71.7),
            (
                "sa_1h",
                "self-attention, one head",
                "t2t_vit_mini",
                "t2t_vit_7",
                {"num_heads": 1},
                67.4,
                {"num_heads": 1},
            ),
            (
                "ea_1h",
                "stacked single-head EA",
                "t2t_vit_mini",
                "t2t_vit_7",
                {"mixer": "external"},
                63.2,
                {"mixer": "external"},
            ),
            ("ea_mh", "multi-head EA (EAMLP)", "eamlp_mini", "eamlp_7", {}, None),
        ),
        notes="The write-up names no model; vitlab's rows are T2T-ViT-7 (71.7 in the T2T-ViT paper, the size the "
        "write-up compares with) with its blocks' mixer switched. The multi-head EA row's figure at this size is "
        "not given (EAMLP-7's 71.7 is at 384 px).",
    ),
    Study(
        "ea-seg-head",
        "Segmentation: EANet head (external attention) vs the same head without it",
        PAPER,
        "the segmentation experiments (EANet on PASCAL VOC); the head without EA is vitlab's control",
        seg_rows(
            ("ea", "EA head, S = 64, double norm", {"head": "ea"}, None),
            ("plain", "plain head", {"head": "plain"}, None),
        ),
        SEG_MEASURES,
        notes=SEG_NOTE + " The paper reports no head-without-EA row; both figures were not available.",
        recipe=SEG_RECIPE,
    ),
    Study(
        "ea-seg-norm",
        "Segmentation: double normalisation vs softmax only in the EA head",
        PAPER,
        "the normalisation ablation on PASCAL VOC",
        seg_rows(
            ("dn", "double normalisation", {"head": "ea", "ea_norm": "double"}, "better by about 2"),
            ("softmax", "softmax only", {"head": "ea", "ea_norm": "softmax"}, "about 2 mIoU worse"),
        ),
        SEG_MEASURES,
        notes=SEG_NOTE + " The paper's exact two figures were not available, only their gap.",
        recipe=SEG_RECIPE,
    ),
    Study(
        "ea-seg-memory",
        "Segmentation: number of memory slots S of the EA head",
        PAPER,
        "the memory-size ablation on PASCAL VOC (S = 64 best)",
        seg_rows(*[(f"s{m}", f"S = {m}", {"head": "ea", "memory_size": m}, 77.4 if m == 64 else None) for m in MEMORY]),
        (("miou", "paper mIoU (VOC)", "{:.1f}"),),
        notes=SEG_NOTE + " Only the best row's figure (S = 64: 77.4) was available.",
        recipe=SEG_RECIPE,
    ),
    Study(
        "ea-seg-attention",
        "Segmentation: external attention vs self-attention, each with softmax or double normalisation",
        PAPER,
        "the normalisation ablation on PASCAL VOC (EA and self-attention, softmax vs double normalisation; the "
        "authors' write-up: double normalisation also helps self-attention); the plain head is vitlab's control",
        seg_rows(
            ("ea_dn", "EA, double normalisation", {"head": "ea", "ea_norm": "double"}, "better by about 2"),
            ("ea_softmax", "EA, softmax only", {"head": "ea", "ea_norm": "softmax"}, "about 2 mIoU worse"),
            ("sa", "self-attention, softmax", {"head": "sa"}, NOT_GIVEN),
            ("sa_dn", "self-attention, double normalisation", {"head": "sa_dn"}, "better than softmax"),
            ("plain", "no attention (plain head)", {"head": "plain"}, NOT_GIVEN),
        ),
        SEG_MEASURES,
        notes=SEG_NOTE + " The self-attention head is a non-local block in the EA block's frame (one head, q/k/v "
        "C -> C); its double normalisation is a softmax over the queries, then L1 over the keys. The paper's table "
        "was not available as figures: only the EA gap (about 2 mIoU) and that double normalisation also lifts "
        "self-attention.",
        recipe=SEG_RECIPE,
    ),
    Study(
        "ea-seg-eanet",
        "EANet: the EA head on dilated ResNet-50 / 101 (PASCAL VOC, ADE20K, Cityscapes)",
        PAPER,
        "the segmentation results of EANet (dilated ResNet, output stride 8, EA head with S = 64, double "
        "normalisation) on PASCAL VOC, ADE20K and Cityscapes",
        (
            *seg_rows(("r50", "EANet, ResNet-50", {"head": "ea"}, NOT_GIVEN)),
            *seg_rows(("r101", "EANet, ResNet-101", {"head": "ea"}, NOT_GIVEN), full="resnet101"),
        ),
        EANET_MEASURES,
        notes=SEG_NOTE + " Each row trains on the one --data given; the three columns are the paper's datasets. "
        "None of the paper's figures for these tables were available to vitlab. EANet's official code trains on "
        "VOC without an auxiliary head; mmsegmentation's ADE20K / Cityscapes recipes add one on C4 "
        "(--model-arg aux_weight=0.4).",
        recipe=SEG_RECIPE,
    ),
]
