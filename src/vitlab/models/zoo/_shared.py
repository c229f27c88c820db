"""What several paper files of the zoo write their rows with: the VisionTransformer row (:func:`vit`) and the
small study row (:func:`mini`), DeiT's widths and evaluation, the ``*_mini`` size, and the ViT-NB backbones
that DeepViT and Refiner share."""

from __future__ import annotations

from typing import Any

from ..registry import ModelConfig

# width, heads of the DeiT backbones
DEIT_SIZES = {"tiny": (192, 3), "small": (384, 6), "base": (768, 12)}
# evaluation protocols of the official code (its default_cfgs / evaluation transform); DeiT's: resize to 256,
# centre-crop 224, ImageNet mean/std
HALF = (0.5, 0.5, 0.5)
DEIT_EVAL = dict(crop_pct=0.875, interpolation="bicubic")
MINI_EVAL = dict(crop_pct=1.0, interpolation="bilinear")  # small images are used whole, as vitlab trains
MINI = dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2, mlp_ratio=4.0, evaluation=MINI_EVAL)

# The ViT-NB backbones of DeepViT, on which Refiner (same authors) compares too: N blocks of width 384, 12 heads,
# MLP ratio 3; the plain ViT-NB's parameters (M) and the official evaluation (dvit_repo default_cfgs)
VIT_NB_PARAMS = {16: 24.42, 24: 36.26, 32: 48.09}
DEEPVIT_EVAL = dict(crop_pct=0.9, interpolation="bicubic", mean=HALF, std=HALF)


def vit_nb(depth: int) -> dict[str, Any]:
    """The constructor arguments of the ViT-NB backbone with ``depth`` blocks."""
    return dict(embed_dim=384, depth=depth, num_heads=12, mlp_ratio=3.0)


def vit_nb_mini(depth: int) -> dict[str, Any]:
    """The ViT-NB of the small study rows (``*_mini`` size, width 32, 4 heads, MLP ratio 3) with ``depth``
    blocks."""
    return dict(MINI, embed_dim=32, depth=depth, num_heads=4, mlp_ratio=3.0)


def vit(
    name: str,
    paper: str,
    source: str,
    params: float | None = None,
    macs: float | None = None,
    notes: str = "",
    evaluation: dict[str, Any] | None = None,
    top1: float | None = None,
    weights_url: str = "",
    **kw: Any,
) -> ModelConfig:
    """A VisionTransformer row: ``kw`` are constructor arguments, ``evaluation`` the official evaluation
    protocol (ModelConfig's crop_pct / interpolation / mean / std; default DeiT's)."""
    base = dict(patch_size=16, mlp_ratio=4.0, qkv_bias=True, norm_eps=1e-6)
    facts = dict(notes=notes, top1=top1, weights_url=weights_url, **(evaluation or DEIT_EVAL))
    return ModelConfig(name, "vit", {**base, **kw}, paper, source, params, macs, **facts)


def mini(name: str, paper: str, source: str, **kw: Any) -> ModelConfig:
    """A small study row: the ``*_mini`` VisionTransformer with the switches ``kw`` of one ablation line."""
    return vit(name, paper, "vitlab small study row: " + source, **{**MINI, **kw})
