"""Transformer in Transformer (Han et al. 2021, arXiv 2103.00112): its ablation tables as studies.

Table 6 (``tnt-pos``: patch and pixel position encodings), Table 7 (``tnt-inner-heads``: heads of the inner
transformer) and Table 8 (``tnt-words``: visual words per patch), all TNT-S with the paper's ImageNet top-1.
"""

from __future__ import annotations

from ..study import Study, rows

PAPER = "Han et al. 2021, Transformer in Transformer (arXiv 2103.00112)"

TABLES: list[Study] = [
    Study(
        "tnt-pos",
        "TNT: patch and pixel position encodings",
        PAPER,
        "Table 6, TNT-S on ImageNet",
        rows(
            ("both", "patch + pixel PE", "tnt_mini", "tnt_s_patch16_224", {}, 81.5),
            ("no_patch", "pixel PE only", "tnt_no_patch_pos_mini", "tnt_s_no_patch_pos", {}, 80.7),
            ("no_pixel", "patch PE only", "tnt_no_pixel_pos_mini", "tnt_s_no_pixel_pos", {}, 80.8),
            ("none", "no PE", "tnt_no_pos_mini", "tnt_s_no_pos", {}, 80.5),
        ),
    ),
    Study(
        "tnt-inner-heads",
        "TNT: heads of the inner transformer",
        PAPER,
        "Table 7, TNT-S on ImageNet (inner width 24)",
        rows(
            *[
                (f"h{h}", f"{h} inner heads", f"tnt_ih{h}_mini", "tnt_s_patch16_224", {"inner_heads": h}, top1)
                for h, top1 in ((1, 81.0), (2, 81.4), (4, 81.5), (6, 81.3), (8, 81.1))
            ]
        ),
    ),
    Study(
        "tnt-words",
        "TNT: number of visual words per patch",
        PAPER,
        "Table 8, TNT-S on ImageNet (m words of c channels, m·c about constant)",
        rows(
            (
                "m64",
                "m = 64, c = 6",
                "tnt_stride1_mini",
                "tnt_s_patch16_224",
                {"inner_stride": 2, "inner_dim": 6, "inner_heads": 3},
                81.0,
            ),
            ("m16", "m = 16, c = 24", "tnt_mini", "tnt_s_patch16_224", {}, 81.5),
            (
                "m4",
                "m = 4, c = 96",
                "tnt_stride4_mini",
                "tnt_s_patch16_224",
                {"inner_stride": 8, "inner_dim": 96},
                81.1,
            ),
        ),
        notes="At 28 px the small rows cut a 7-px patch into 49, 16 and 4 words. The paper's inner head count for c = 6 "
        "is not stated; the full row uses 3 heads (4 do not divide 6).",
    ),
]
