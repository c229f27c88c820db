"""DeepViT (Zhou et al. 2021, arXiv 2103.11886, and its official README): its tables as studies.

The README's first table (``deepvit-depth``: ViT and DeepViT at 16, 24 and 32 blocks, ImageNet top-1 and the
number of blocks with similar attention maps) and the paper's comparison of re-attention with sharper or
sparser attention (``deepvit-alternatives``, 32-block ViT).
"""

from __future__ import annotations

from ..study import Study, rows

PAPER = "Zhou et al. 2021, DeepViT (arXiv 2103.11886) and its official README"

TABLES: list[Study] = [
    Study(
        "deepvit-alternatives",
        "DeepViT: re-attention against sharper or sparser attention",
        PAPER,
        "the comparison with attention temperature and attention dropping, 32-block ViT on ImageNet",
        rows(
            ("vit", "ViT (softmax attention)", "vit_16b_mini", "vit_32b", {}, 79.27),
            ("reattention", "re-attention (DeepViT)", "deepvit_16b_mini", "deepvit_32b", {}, 80.90),
            ("temp", "learnable temperature", "vit_16b_temp_mini", "vit_32b", {"mixer": "attention_temperature"}, None),
            (
                "temp_sched",
                "temperature 1 -> 0.5",
                "vit_16b_tempsched_mini",
                "vit_32b",
                {"mixer": ("attention_temperature", {"temperature": "scheduled", "temperature_steps": 375_000})},
                None,
            ),
            ("drop", "dropping attention", "vit_16b_dropmap_mini", "vit_32b", {"mixer": "attention_dropmap"}, None),
            ("wide", "wider embedding (2x)", "vit_16b_mini", "vit_32b", {"embed_dim": 768}, None, {"embed_dim": 64}),
        ),
        notes="The paper's figures for the alternatives were not available; how they are read is Decision D3. The "
        "wider embedding doubles the width at the same head count (768 = 12 heads of 64). The small rows use 16 "
        "blocks.",
    ),
    Study(
        "deepvit-depth",
        "DeepViT: depth scaling of ViT and DeepViT, with the cross-layer similarity of attention maps",
        PAPER,
        "the official README's first table (ImageNet top-1 and '#similar blocks' of ViT and DeepViT at 16/24/32 blocks)",
        rows(
            *[
                (
                    f"{kind}{d}",
                    f"{'ViT' if kind == 'vit' else 'DeepViT'}-{d}B",
                    f"{kind}_{d}b_mini",
                    f"{kind}_{d}b",
                    {},
                    {"top1": top1, "similar": sim},
                )
                for d, vit_top1, deep_top1, vit_sim in (
                    (16, 78.88, 79.10, 5),
                    (24, 79.35, 79.99, 11),
                    (32, 79.27, 80.90, 15),
                )
                for kind, top1, sim in (("vit", vit_top1, vit_sim), ("deepvit", deep_top1, 0))
            ]
        ),
        measures=(("top1", "paper top-1 %", "{:.2f}"), ("similar", "paper #similar", "{:.0f}")),
        extra="similarity",
        notes="'#similar' counts blocks whose maps are more than 90 % similar to the previous block's (cosine of the "
        "maps' columns, averaged: DeepViT §3); vitlab measures it on the first held-out images of the trained models.",
    ),
]
