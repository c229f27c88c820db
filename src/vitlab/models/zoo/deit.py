"""DeiT: the tiny / small / base ViTs at 224 px, each also with its distillation token, and ``deit_mini``."""

from __future__ import annotations

from ..registry import ModelConfig, register
from ._shared import DEIT_SIZES, MINI, vit

DEIT = "Touvron et al. 2021, Training data-efficient image transformers (DeiT)"
DEIT_URL = "https://dl.fbaipublicfiles.com/deit/"

_rows: list[ModelConfig] = []

# distilled: + distillation token, its position row and a second head
# top-1: DeiT paper Table 5 (the README lists DeiT-S at 79.9); checkpoints: the official release
for size, params, params_dist, macs, top1, top1_dist, url, url_dist in (
    ("tiny", 5.72, 5.91, 1.25, 72.2, 74.5, "deit_tiny_patch16_224-a1311bcf.pth", "b40b3cf7"),
    ("small", 22.05, 22.44, 4.60, 79.8, 81.2, "deit_small_patch16_224-cd65a155.pth", "649709d9"),
    ("base", 86.57, 87.34, 17.56, 81.8, 83.4, "deit_base_patch16_224-b5f2ef4d.pth", "df68dfff"),
):
    dim, heads = DEIT_SIZES[size]
    src = f"facebookresearch/deit models.py deit_{size}_patch16_224"
    _rows += [
        vit(
            f"deit_{size}_patch16_224",
            DEIT,
            src,
            params,
            macs,
            top1=top1,
            weights_url=DEIT_URL + url,
            embed_dim=dim,
            depth=12,
            num_heads=heads,
        ),
        vit(
            f"deit_{size}_distilled_patch16_224",
            DEIT,
            src.replace("_patch", "_distilled_patch"),
            params_dist,
            top1=top1_dist,
            weights_url=f"{DEIT_URL}deit_{size}_distilled_patch16_224-{url_dist}.pth",
            embed_dim=dim,
            depth=12,
            num_heads=heads,
            dist_token=True,
        ),
    ]

# --- small variant for CPU training (patch 4, 32 px) ---------------------------------------------------------
_rows.append(vit("deit_mini", DEIT, "vitlab: small DeiT", **MINI))

register(*_rows)
