"""Refiner: the official Refined-ViT-S / M / L (at 224 px, and fine-tuned at 384 / 448), the paper's ViTs with a
3x3 convolution on the attention maps (Table 2) and ViT-16B with the refiner in every block, the small
``refiner_vit_mini`` / ``refiner_mini``, and the small study rows of its expansion-ratio and DLA-kernel tables."""

from __future__ import annotations

from typing import Any

from ..registry import ModelConfig, register
from ._shared import DEEPVIT_EVAL, HALF, MINI, VIT_NB_PARAMS, mini, vit, vit_nb, vit_nb_mini

REFINER = "Zhou et al. 2021, Refiner: Refining Self-attention for Vision Transformers"

# Refined-ViT (official code): even blocks = attention + s·(map two blocks back), odd blocks = the shared
# block refining the previous map with DLA (expansion 3, 3x3, BN/ReLU6, identity, adapt_bn); no q/k there.
REFINER_NORMAL = ("refiner", dict(refine=False, residual_attention=True))
REFINER_SHARED = ("refiner", dict(share=True, official_extras=True))
REFINER_OFFICIAL = dict(mlp_ratio=3.0, stem_channels=(32, 64, 128), residual_scale=0.5, ls_init=(None, 1e-5))
# Refiner paper Table 2: a 3x3 convolution directly on the heads' attention maps (no expansion, no reduction)
DLA_ONLY = ("refiner", dict(expansion=1, reduction=False))


def alternate(depth: int, even: Any, odd: Any) -> list[Any]:
    return [even if i % 2 == 0 else odd for i in range(depth)]


_rows: list[ModelConfig] = []

# --- Table 2: ViT-NB (DeepViT's backbones) and ViT-B with DLA alone on the attention maps ---------------------
for depth, params in VIT_NB_PARAMS.items():
    _rows.append(
        vit(
            f"vit_{depth}b_dla",
            REFINER,
            "Refiner paper Table 2: ViT + 3x3 conv on attention maps",
            params,
            mixer=DLA_ONLY,
            **vit_nb(depth),
            evaluation=DEEPVIT_EVAL,
        )
    )
_rows.append(
    vit(
        "vit_base_dla",
        REFINER,
        "Refiner paper Table 2: ViT-B + 3x3 conv on attention maps",
        86.57,
        embed_dim=768,
        depth=12,
        num_heads=12,
        mixer=DLA_ONLY,
    )
)

# --- Refined-ViT (official configs; token-labelling aux head off by default) ---------------------------
# evaluation: the official default_cfgs (crop 0.9 / 1.0 / 1.13, mean = std = 0.5); top-1: the README at 224
# (the only released checkpoint is Refiner-ViT-L at 448 px)
for size, dim, depth, heads, params, macs, crop, top1 in (
    ("s", 384, 16, 12, 25.02, 6.74, 0.9, 83.6),
    ("m", 420, 32, 12, 55.03, 13.42, 1.0, 84.6),
    ("l", 512, 32, 16, 80.64, 19.09, 1.13, 84.9),
):
    _rows.append(
        vit(
            f"refiner_vit_{size}",
            REFINER,
            f"zhoudaquan/Refiner_ViT refined_transformer.py Refiner_ViT_{size.upper()}",
            params,
            macs,
            embed_dim=dim,
            depth=depth,
            num_heads=heads,
            mixer=alternate(depth, REFINER_NORMAL, REFINER_SHARED),
            **REFINER_OFFICIAL,
            evaluation=dict(crop_pct=crop, interpolation="bicubic", mean=HALF, std=HALF),
            top1=top1,
        )
    )

# Refined-ViT at 384 / 448 px (README; fine-tuned from the 224 models): a larger position table, crop 1.0
for size, dim, depth, heads, res, params, top1 in (
    ("s", 384, 16, 12, 384, 25.17, 84.6),
    ("m", 420, 32, 12, 384, 55.19, 85.6),
    ("l", 512, 32, 16, 384, 80.83, 85.8),
    ("l", 512, 32, 16, 448, 80.94, 86.0),
):
    _rows.append(
        vit(
            f"refiner_vit_{size}_{res}",
            REFINER,
            f"zhoudaquan/Refiner_ViT README, Refiner-ViT-{size.upper()} at {res}",
            params,
            img_size=res,
            embed_dim=dim,
            depth=depth,
            num_heads=heads,
            mixer=alternate(depth, REFINER_NORMAL, REFINER_SHARED),
            **REFINER_OFFICIAL,
            evaluation=dict(crop_pct=1.0, interpolation="bicubic", mean=HALF, std=HALF),
            top1=top1,
            notes="fine-tuned from the 224 model (vitlab train --init-from resamples the position table)",
        )
    )

# --- full-size ablation row the paper names (Tables 1, 3, 4) ---------------------------------------------------
_rows.append(
    vit(
        "refiner_16b",
        REFINER,
        "Refiner paper Tables 1, 3, 4: ViT-16B with the refiner (expansion 3, 3x3 DLA, reduction) in every block",
        24.44,
        mixer=("refiner", dict(expansion=3, kernel_size=3)),
        **vit_nb(16),
    )
)

# --- small variants for CPU training (patch 4, 32 px) ---------------------------------------------------------
_rows += [
    vit(
        "refiner_vit_mini",
        REFINER,
        "vitlab: small Refined-ViT (official block pattern, no CNN stem)",
        **{**MINI, "num_heads": 4},
        mixer=alternate(4, REFINER_NORMAL, REFINER_SHARED),
        residual_scale=0.5,
        ls_init=(None, 1e-5),
    ),
    vit(
        "refiner_mini",
        REFINER,
        "vitlab: small ViT with the paper's refiner (r=3, 3x3 DLA, reduction) in every block",
        **{**MINI, "num_heads": 4},
        mixer=("refiner", dict(expansion=3, kernel_size=3)),
    ),
]

# --- small study rows (docs/studies.md): expansion ratio (Table 1), DLA kernel (Table 4), DLA alone (Table 2) ---
REFINER_MINI = dict(num_heads=4)
_rows += [
    *[
        mini(
            f"refiner_r{r}_mini",
            REFINER,
            f"Table 1, expansion ratio {r}",
            mixer=("refiner", dict(expansion=r)),
            **REFINER_MINI,
        )
        for r in (1, 2, 4, 6)
    ],
    *[
        mini(
            f"refiner_{c}_mini",
            REFINER,
            f"Table 4, DLA kernel constraint {c!r}",
            mixer=("refiner", dict(kernel_constraint=c)),
            **REFINER_MINI,
        )
        for c in ("spatial", "rowcol")
    ],
    vit(
        "vit_16b_dla_mini",
        REFINER,
        "vitlab small study row: Refiner Table 2, ViT-16B + DLA",
        mixer=DLA_ONLY,
        **vit_nb_mini(16),
    ),
]

register(*_rows)
