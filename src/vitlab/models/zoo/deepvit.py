"""DeepViT: the paper's ViT-NB baselines and DeepViT-NB (re-attention in every block) at 16 / 24 / 32 blocks, the
official DeepViT-S / L, ``deepvit_mini``, and the small study rows of its depth scaling and of the alternatives
to re-attention it compares (a learnable or scheduled attention temperature, dropping attention)."""

from __future__ import annotations

from typing import Any

from ..registry import ModelConfig, register
from ._shared import DEEPVIT_EVAL, MINI, VIT_NB_PARAMS, vit, vit_nb, vit_nb_mini

DEEPVIT = "Zhou et al. 2021, DeepViT: Towards Deeper Vision Transformer"
DVIT_README = "zhoudaquan/dvit_repo README (Google Drive file {})"
DEEPVIT_OFFICIAL = dict(mlp_ratio=3.0, stem_channels=(64, 64), residual_scale=0.5)


def last(depth: int, n: int, base: Any, special: Any) -> list[Any]:
    """``base`` in the first ``depth - n`` blocks, ``special`` in the last ``n`` (DeepViT-S/L)."""
    return [base] * (depth - n) + [special] * n


_rows: list[ModelConfig] = []

# --- ViT baselines of the paper, re-attention in every block, and the official S/L ------------------------
# top-1 and checkpoints: the dvit_repo README's first table (ViT-N / DeepViT-N, re-attention "FC")
for depth, params_re, top1, top1_re, drive in (
    (16, 24.43, 78.88, 79.10, ""),
    (24, 36.26, 79.35, 79.99, "1lPmKdNMPJq-mq-4FivqIY4JNAPoQHYxV"),
    (32, 48.10, 79.27, 80.90, "1kUBrAbAQfMT5FQJprITRxDtOE6ECZM0M"),
):
    deep = dict(vit_nb(depth), evaluation=DEEPVIT_EVAL)
    src = f"zhoudaquan/dvit_repo deep_vision_transformer.py deepvit_patch16_224_re_attn_{depth}b"
    _rows += [
        vit(f"vit_{depth}b", DEEPVIT, src + " (apply_transform off)", VIT_NB_PARAMS[depth], top1=top1, **deep),
        vit(
            f"deepvit_{depth}b",
            DEEPVIT,
            src,
            params_re,
            top1=top1_re,
            weights_url=DVIT_README.format(drive) if drive else "",
            mixer="reattention",
            **deep,
        ),
    ]
_rows += [
    vit(
        "deepvit_s",
        DEEPVIT,
        "zhoudaquan/dvit_repo deepvit_S",
        27.31,
        6.33,
        embed_dim=396,
        depth=16,
        num_heads=12,
        mixer=last(16, 5, "attention", ("reattention", dict(transform_scale=True))),
        **DEEPVIT_OFFICIAL,
        notes="papers quote 27M; the README's second table lists it as DeepViT-16 (CNN patch stem, FC + BN)",
        evaluation=DEEPVIT_EVAL,
        top1=82.3,
        weights_url=DVIT_README.format("1evhBjla4Nth7LawW2PAXnGEcpv3YBWEC"),
    ),
    vit(
        "deepvit_l",
        DEEPVIT,
        "zhoudaquan/dvit_repo deepvit_L",
        58.88,
        13.08,
        embed_dim=420,
        depth=32,
        num_heads=12,
        mixer=last(32, 12, "attention", "reattention"),
        **DEEPVIT_OFFICIAL,
        notes="the paper quotes 55M; the official config computes to 58.9M; README: DeepViT-32 (CNN stem, FC + BN)",
        evaluation=DEEPVIT_EVAL,
        top1=83.1,
        weights_url=DVIT_README.format("1MTRm0NK_sPGRSyuD_hHJ1Zgw2diEaKLR"),
    ),
]

# --- small variant for CPU training (patch 4, 32 px) ---------------------------------------------------------
_rows.append(
    vit("deepvit_mini", DEEPVIT, "vitlab: small DeepViT (re-attention in every block)", **MINI, mixer="reattention")
)

# --- small study rows (docs/studies.md): the depth scaling and the alternatives to re-attention --------------
for depth in (16, 24, 32):
    _rows += [
        vit(f"vit_{depth}b_mini", DEEPVIT, f"vitlab small study row: ViT-{depth}B", **vit_nb_mini(depth)),
        vit(
            f"deepvit_{depth}b_mini",
            DEEPVIT,
            f"vitlab small study row: DeepViT-{depth}B (re-attention in every block)",
            mixer="reattention",
            **vit_nb_mini(depth),
        ),
    ]
_rows += [
    vit(
        "vit_16b_temp_mini",
        DEEPVIT,
        "vitlab small study row: learnable attention temperature",
        mixer="attention_temperature",
        **vit_nb_mini(16),
    ),
    vit(
        "vit_16b_tempsched_mini",
        DEEPVIT,
        "vitlab small study row: attention temperature 1 -> 0.5 over 1000 steps",
        mixer=("attention_temperature", dict(temperature="scheduled", temperature_steps=1000)),
        **vit_nb_mini(16),
    ),
    vit(
        "vit_16b_dropmap_mini",
        DEEPVIT,
        "vitlab small study row: dropping attention (p 0.1)",
        mixer="attention_dropmap",
        **vit_nb_mini(16),
    ),
]

register(*_rows)
