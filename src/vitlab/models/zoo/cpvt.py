"""CPVT and its successor Twins-PCPVT (CPVT-v2): CPVT-Ti / S / B with a class token or GAP, the single-PEG,
encoding-before-every-block (learned or sin-cos) and PEG + absolute encoding (LE, sin-cos) ablations at paper
size, PCPVT-S / B / L, the small ``cpvt_mini`` / ``cpvt_gap_mini`` / ``pcpvt_mini``, and the small study rows of
the PEG's form, padding, placement and kernel and of the position encodings CPVT compares it with (the
``deit_*`` rows)."""

from __future__ import annotations

from ..registry import ModelConfig, register
from ._shared import DEIT_SIZES, MINI, mini, vit

CPVT = "Chu et al. 2021, Conditional Positional Encodings for Vision Transformers (CPVT)"
TWINS = "Chu et al. 2021, Twins: Revisiting the Design of Spatial Attention in Vision Transformers"

_rows: list[ModelConfig] = []

# --- CPVT: DeiT without a position table, PEGs after blocks 0-4 (‡) ------------------------------------
# top-1: CPVT paper Table 5 (CPVT-B-GAP is not reported); no official checkpoint of these models
for size, short, params, params_gap, top1, top1_gap in (
    ("tiny", "ti", 5.69, 5.69, 73.4, 74.9),
    ("small", "s", 21.99, 21.99, 80.5, 81.5),
    ("base", "b", 86.46, 86.46, 82.3, None),
):
    dim, heads = DEIT_SIZES[size]
    cpvt = dict(embed_dim=dim, depth=12, num_heads=heads, pos_embed="none", peg_at=(0, 1, 2, 3, 4))
    src = "paper Algorithm 1 + Meituan-AutoML/Twins gvt.py PosCNN"
    _rows += [
        vit(f"cpvt_{short}", CPVT, src, params, top1=top1, **cpvt),
        vit(
            f"cpvt_{short}_gap",
            CPVT,
            src + " (GAP, no class token)",
            params_gap,
            top1=top1_gap,
            class_token=False,
            global_pool="avg",
            **cpvt,
        ),
    ]

# --- full-size ablation rows: one PEG (Table 2), a learned position table before every block ----------------
dim, heads = DEIT_SIZES["tiny"]
_rows += [
    vit(
        "cpvt_ti_peg0",
        CPVT,
        "CPVT Table 2: a single PEG after block 0",
        5.68,
        top1=72.4,
        embed_dim=192,
        depth=12,
        num_heads=3,
        pos_embed="none",
        peg_at=(0,),
    ),
    vit(
        "deit_tiny_pe_every_block",
        CPVT,
        "CPVT's comparison of encodings: DeiT-tiny with a learned position table of its own added before every block",
        6.13,
        embed_dim=dim,
        depth=12,
        num_heads=heads,
        pos_embed_every_block=True,
    ),
    vit(
        "deit_tiny_sincos_every_block",
        CPVT,
        "CPVT's comparison of encodings: DeiT-tiny with the fixed 2-D sin-cos table added before every block",
        5.68,
        embed_dim=dim,
        depth=12,
        num_heads=heads,
        pos_embed="sincos",
        pos_embed_every_block=True,
    ),
]
# CPVT's comparison of encoding strategies: the PEG after block 0 with an absolute encoding on the first block's
# input as well ("PEG + LE": DeiT's learned table; "PEG + sin-cos": the fixed 2-D table)
for tag, what, params, top1, encoding in (
    ("le", "a learned position table (LE)", 5.72, 72.9, "learned"),
    ("sincos", "the 2-D sin-cos table", 5.68, None, "sincos"),
):
    _rows.append(
        vit(
            f"cpvt_ti_peg0_{tag}",
            CPVT,
            f"CPVT's comparison of encodings: a single PEG after block 0 plus {what}",
            params,
            top1=top1,
            embed_dim=dim,
            depth=12,
            num_heads=heads,
            pos_embed=encoding,
            peg_at=(0,),
        )
    )

# --- Twins PCPVT = CPVT-v2 (gvt.py CPVTV2, registered there as pcpvt_{small,base,large}_v0) -------------------
for size, depths, params, macs in (
    ("small", (3, 4, 6, 3), 24.11, 3.81),
    ("base", (3, 4, 18, 3), 43.83, 6.65),
    ("large", (3, 8, 27, 3), 60.99, 9.81),
):
    _rows.append(
        ModelConfig(
            f"pcpvt_{size}",
            "pyramid",
            dict(depths=depths),
            TWINS,
            f"Meituan-AutoML/Twins gvt.py pcpvt_{size}_v0 (CPVTV2)",
            params,
            macs,
            notes="Twins paper: 24.1M / 43.8M / 60.9M, 3.8G / 6.7G / 9.8G",
        )
    )

# --- small variants for CPU training (patch 4, 32 px) ---------------------------------------------------------
_rows += [
    vit("cpvt_mini", CPVT, "vitlab: small CPVT (PEG after blocks 0-2)", **MINI, pos_embed="none", peg_at=(0, 1, 2)),
    vit(
        "cpvt_gap_mini",
        CPVT,
        "vitlab: small CPVT-GAP",
        **MINI,
        pos_embed="none",
        peg_at=(0, 1, 2),
        class_token=False,
        global_pool="avg",
    ),
    ModelConfig(
        "pcpvt_mini",
        "pyramid",
        dict(
            img_size=32,
            patch_size=4,
            embed_dims=(32, 64),
            num_heads=(1, 2),
            mlp_ratios=(4, 4),
            depths=(2, 2),
            sr_ratios=(2, 1),
        ),
        TWINS,
        "vitlab: small PCPVT (two stages)",
    ),
]

# --- small study rows (docs/studies.md): one PEG after block 0 (position 0) in its forms, paddings and
# placements; the position encodings it is compared with -------------------------------------------------------
CPVT_MINI = dict(pos_embed="none")
_rows += [
    mini("cpvt_peg0_mini", CPVT, "CPVT, one PEG at position 0", peg_at=(0,), **CPVT_MINI),
    *[
        mini(f"cpvt_peg0_{tag}_mini", CPVT, f"CPVT, {what}", peg_at=(0,), peg_options=options, **CPVT_MINI)
        for tag, what, options in (
            ("sep", "PEG = one separable conv", dict(kind="separable")),
            ("sep4", "PEG = four separable convs", dict(kind="separable", layers=4)),
            ("nopad", "PEG without zero padding (circular)", dict(padding="circular")),
            ("frozen", "frozen random PEG", dict(frozen=True)),
            ("fc12", "twelve stacked 1x1 (FC) layers", dict(kind="fc", layers=12)),
        )
    ],
    mini(
        "cpvt_peg_qk_mini",
        CPVT,
        "CPVT, PEG on the queries and keys of block 1 only",
        mixer=["attention", "attention_peg_qk", "attention", "attention"],
        **CPVT_MINI,
    ),
    mini("cpvt_before_mini", CPVT, "CPVT, one PEG at position -1", peg_at=(-1,), **CPVT_MINI),
    mini(
        "cpvt_before_k7_mini",
        CPVT,
        "CPVT, one 7x7 PEG at position -1 (the paper's 27x27: the whole grid)",
        peg_at=(-1,),
        peg_kernel=7,
        **CPVT_MINI,
    ),
    *[
        mini(
            f"cpvt_peg0_k{k}_mini", CPVT, f"CPVT, one {k}x{k} PEG at position 0", peg_at=(0,), peg_kernel=k, **CPVT_MINI
        )
        for k in (1, 5, 7)
    ],
    mini("deit_nope_mini", CPVT, "CPVT Table 1, DeiT without position encoding", pos_embed="none"),
    mini("deit_sincos_mini", CPVT, "CPVT Table 1, DeiT with a 2-D sin-cos table", pos_embed="sincos"),
    mini(
        "deit_rpe2d_mini",
        CPVT,
        "CPVT Table 1, DeiT with 2-D relative position encoding (the last block's relative terms could not reach "
        "the class token, whose row they shift by a constant: plain attention there computes the same logits)",
        pos_embed="none",
        mixer=[("attention_rpe2d", dict(max_distance=7))] * 3 + ["attention"],
    ),
    mini(
        "deit_pe_every_block_mini",
        CPVT,
        "CPVT, a learned position table before every block",
        pos_embed_every_block=True,
    ),
    mini(
        "deit_sincos_every_block_mini",
        CPVT,
        "CPVT, the fixed 2-D sin-cos table before every block",
        pos_embed="sincos",
        pos_embed_every_block=True,
    ),
    mini("cpvt_peg0_le_mini", CPVT, "CPVT, one PEG at position 0 plus a learned table (PEG + LE)", peg_at=(0,)),
    mini(
        "cpvt_peg0_sincos_mini",
        CPVT,
        "CPVT, one PEG at position 0 plus the 2-D sin-cos table (PEG + sin-cos)",
        peg_at=(0,),
        pos_embed="sincos",
    ),
]

register(*_rows)
