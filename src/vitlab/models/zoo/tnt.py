"""TNT: TNT-Ti / S / B (the official non-legacy code), partial TNT-S (Table 5), TNT-S with SE and without
position encodings, ``tnt_mini``, and the small study rows of its position encodings, words per patch and inner
heads."""

from __future__ import annotations

from typing import Any

from ..registry import ModelConfig, register
from ._shared import HALF, MINI_EVAL

TNT = "Han et al. 2021, Transformer in Transformer"

# official code without the frozen unused outer_tokens: docs/semantics.md, Decision T2
TNT_SRC = "huawei-noah/Efficient-AI-Backbones tnt_pytorch/tnt.py"
TNT_EVAL = dict(crop_pct=0.9, interpolation="bicubic", mean=HALF, std=HALF)  # tnt_pytorch default_cfgs
TNT_SIZES = {"ti": (192, 12, 3, 2, 6.08, 1.40), "s": (384, 24, 6, 4, 23.77, 5.22), "b": (640, 40, 10, 4, 65.43, 14.05)}
# top-1: TNT paper Tables 4, 5, 12; checkpoints: the official release (also on BaiduDisk per its readme)
TNT_TOP1 = {"ti": 73.9, "s": 81.5, "b": 82.9}
TNT_WEIGHTS = "https://github.com/huawei-noah/Efficient-AI-Backbones/releases/download/tnt/tnt_{}.pth.tar"
# the small TNT: patch 4 -> 2x2 words of 16 channels
TNT_MINI = dict(
    img_size=32, patch_size=4, outer_dim=64, inner_dim=16, depth=4, outer_heads=2, inner_heads=2, inner_stride=2
)


def tnt(
    name: str,
    source: str,
    params: float | None = None,
    macs: float | None = None,
    notes: str = "",
    size: str = "s",
    evaluation: dict[str, Any] = TNT_EVAL,
    top1: float | None = None,
    weights_url: str = "",
    **kw: Any,
) -> ModelConfig:
    """A TNT row of the official ``size`` (ti / s / b): ``kw`` replace constructor arguments, ``evaluation`` the
    official evaluation protocol."""
    outer, inner, outer_heads, inner_heads = TNT_SIZES[size][:4]
    base = dict(
        patch_size=16,
        outer_dim=outer,
        inner_dim=inner,
        depth=12,
        outer_heads=outer_heads,
        inner_heads=inner_heads,
        inner_stride=4,
        qkv_bias=False,
    )
    facts = dict(notes=notes, top1=top1, weights_url=weights_url, **evaluation)
    return ModelConfig(name, "tnt", {**base, **kw}, TNT, source, params, macs, **facts)


def tnt_mini(name: str, source: str, **kw: Any) -> ModelConfig:
    """A small study row: ``tnt_mini``'s TNT with the switches ``kw`` of one ablation line."""
    return tnt(name, "vitlab small study row: " + source, **{**TNT_MINI, **kw})


_rows: list[ModelConfig] = []

for size, (*_, params, macs) in TNT_SIZES.items():
    _rows.append(
        tnt(
            f"tnt_{size}_patch16_224",
            TNT_SRC + (f" tnt_{size}_patch16_224" if size != "ti" else ""),
            params,
            macs,
            size=size,
            top1=TNT_TOP1[size],
            weights_url=TNT_WEIGHTS.format({"s": "s_81.5", "b": "b_82.9"}[size]) if size != "ti" else "",
            notes="paper Table 1 only (no official registration)"
            if size == "ti"
            else "paper 23.8M / 65.6M include the frozen unused outer_tokens",
        )
    )
# partial TNT (paper Table 5: inner transformer only in blocks [1,4,8,12], [1,6,12], [1,6], [1]; 1-based there)
for i, (blocks, params, macs, top1) in enumerate(
    (
        ((0, 3, 7, 11), 22.52, 4.8, 81.4),
        ((0, 5, 11), 22.36, 4.7, 81.3),
        ((0, 5), 22.21, 4.7, 81.1),
        ((0,), 22.05, 4.6, 80.8),
    ),
    1,
):
    _rows.append(
        tnt(
            f"tnt_s_{i}",
            f"TNT paper Table 5 (TNT-S-{i})",
            params,
            macs,
            top1=top1,
            tnt_blocks=blocks,
            notes="params computed from the config; MACs are the paper's (0.1G rounding)",
        )
    )
_rows.append(
    tnt(
        "tnt_s_se_patch16_224",
        "TNT paper Table 12 (TNT-S + SE; official Block se>0 = hidden C/4)",
        24.67,
        5.22,
        se=4,
        top1=81.6,
        notes="paper 24.7M; top-1 81.6 in the paper's first version (TNT-S 81.3 there), 81.7 in the later one",
    )
)

# --- full-size ablation rows (Table 6) ----------------------------------------------------------------------------
_rows += [
    tnt("tnt_s_no_patch_pos", "TNT paper Table 6: TNT-S without the patch position encoding", 23.69, patch_pos=False),
    tnt("tnt_s_no_pixel_pos", "TNT paper Table 6: TNT-S without the pixel position encoding", 23.77, pixel_pos=False),
    tnt(
        "tnt_s_no_pos",
        "TNT paper Table 6: TNT-S without either position encoding",
        23.69,
        patch_pos=False,
        pixel_pos=False,
    ),
]

# --- small variant for CPU training (patch 4, 32 px) ---------------------------------------------------------
_rows.append(
    tnt("tnt_mini", "vitlab: small TNT (patch 4 -> 2x2 words of 16 channels)", evaluation=MINI_EVAL, **TNT_MINI)
)

# --- small study rows (docs/studies.md): position encodings (Table 6), words per patch (Table 8: m·c about
# constant), inner heads (Table 7) ----------------------------------------------------------------------------------
_rows += [
    tnt_mini("tnt_no_patch_pos_mini", "TNT Table 6, no patch position encoding", patch_pos=False),
    tnt_mini("tnt_no_pixel_pos_mini", "TNT Table 6, no pixel position encoding", pixel_pos=False),
    tnt_mini("tnt_no_pos_mini", "TNT Table 6, no position encoding", patch_pos=False, pixel_pos=False),
    tnt_mini(
        "tnt_stride1_mini", "TNT Table 8, word stride 1 (49 words of 4 channels at 28 px)", inner_stride=1, inner_dim=4
    ),
    tnt_mini(
        "tnt_stride4_mini", "TNT Table 8, word stride 4 (4 words of 64 channels at 28 px)", inner_stride=4, inner_dim=64
    ),
    *[
        tnt_mini(f"tnt_ih{h}_mini", f"TNT Table 7, {h} inner heads of 24 channels", inner_dim=24, inner_heads=h)
        for h in (1, 2, 4, 6, 8)
    ],
]

register(*_rows)
