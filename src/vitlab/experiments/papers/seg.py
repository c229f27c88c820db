"""External attention's segmentation ablations as studies (the EANet head on a VOC-layout mask folder): the head
with and without EA, double normalisation against softmax, and the memory size S, scored by mIoU."""

from __future__ import annotations

from typing import Any

from ..study import EA, PaperValue, Row, Study

# small scale: a PCPVT-mini backbone and a 32-wide decoder on 32-px crops of a VOC-layout folder (vitlab seg synth);
# full scale: PCPVT-S and the paper's 512-wide decoder (the paper's backbone is a dilated ResNet, not in vitlab)
SEG_RECIPE = dict(task="segmentation", img_size=32, epochs=6, batch_size=4, lr=1e-2, warmup_epochs=0.25,
                  weight_decay=0.01, smoothing=0.0, drop_path=0.0)  # fmt: skip
SEG_NOTE = "PASCAL VOC val mIoU in the paper (EANet: dilated ResNet + the EA head); here any VOC-layout --data."


def seg_rows(*specs: tuple[str, str, dict[str, Any], PaperValue]) -> tuple[Row, ...]:
    """Rows ``(key, label, decoder switch, paper mIoU)`` over pcpvt_mini (small) / pcpvt_small (full)."""
    out = []
    for key, label, switch, paper in specs:
        full, small = {"channels": 512, **switch}, {"channels": 32, **switch}
        out.append(Row(key, label, "pcpvt_mini", "pcpvt_small", full, {"miou": paper}, small))
    return tuple(out)


SEG_MEASURES = (("miou", "paper mIoU (VOC)", "{}"),)
MEMORY = (8, 32, 64, 256)
SEG_STUDIES: list[Study] = [
    Study(
        "ea-seg-head",
        "Segmentation: EANet head (external attention) vs the same head without it",
        EA,
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
        EA,
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
        EA,
        "the memory-size ablation on PASCAL VOC (S = 64 best)",
        seg_rows(*[(f"s{m}", f"S = {m}", {"head": "ea", "memory_size": m}, 77.4 if m == 64 else None) for m in MEMORY]),
        (("miou", "paper mIoU (VOC)", "{:.1f}"),),
        notes=SEG_NOTE + " Only the best row's figure (S = 64: 77.4) was available.",
        recipe=SEG_RECIPE,
    ),
]
