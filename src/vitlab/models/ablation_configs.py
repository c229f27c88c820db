"""The papers' ablation rows and the models they compare against, as named configurations (docs/studies.md).

Two kinds of rows:

* **full size**, where the paper names the model: T2T-ViT-7/14 (EAMLP's baseline), Twins' PCPVT-S/B/L
  (CPVT-v2), Refined-ViT-16B, TNT-S without position encodings, EAMLP-7 with BatchNorm, AFT without a factorised
  bias / without re-parameterisation / without the query term. Parameter targets as in docs/models.md.
* **small** (``*_mini``, patch 4 at 32 px, the sizes of :mod:`vitlab.models.configs`' minis): one row per line of
  each ablation table, so that ``vitlab study`` runs every table on a CPU in minutes. They differ from their
  family's mini only in the switch the paper turns.
"""

from __future__ import annotations

from typing import Any

from .configs import AFT, CPVT, DEEPVIT, EA, MINI, REFINER, tnt, vit
from .registry import ModelConfig, register

T2T = "Yuan et al. 2021, Tokens-to-Token ViT: Training Vision Transformers from Scratch on ImageNet"
TWINS = "Chu et al. 2021, Twins: Revisiting the Design of Spatial Attention in Vision Transformers"

_rows: list[ModelConfig] = []

# --- T2T-ViT-7/14 (official: Performer token layers, self-attention blocks without qkv bias) -------------------
for depth, dim, heads, mlp, params, macs in ((7, 256, 4, 2.0, 4.26, 1.15), (14, 384, 6, 3.0, 21.47, 4.78)):
    _rows.append(
        ModelConfig(
            f"t2t_vit_{depth}",
            "t2t",
            dict(
                embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=mlp, token_mixer="performer", mixer="attention"
            ),
            T2T,
            f"yitu-opensource/T2T-ViT models/t2t_vit.py T2t_vit_{depth} (tokens_type='performer')",
            params,
            macs,
            notes=f"paper {'4.3M / 1.1G' if depth == 7 else '21.5M / 4.8G'}; EAMLP-{depth}'s baseline",
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

# --- full-size ablation rows the papers name --------------------------------------------------------------------
REFINER_16B = dict(embed_dim=384, depth=16, num_heads=12, mlp_ratio=3.0)
_rows += [
    vit(
        "refiner_16b",
        REFINER,
        "Refiner paper Tables 1, 3, 4: ViT-16B with the refiner (expansion 3, 3x3 DLA, reduction) in every block",
        24.44,
        mixer=("refiner", dict(expansion=3, kernel_size=3)),
        **REFINER_16B,
    ),
    tnt("tnt_s_no_patch_pos", "TNT paper Table 6: TNT-S without the patch position encoding", 23.69, patch_pos=False),
    tnt("tnt_s_no_pixel_pos", "TNT paper Table 6: TNT-S without the pixel position encoding", 23.77, pixel_pos=False),
    tnt(
        "tnt_s_no_pos",
        "TNT paper Table 6: TNT-S without either position encoding",
        23.69,
        patch_pos=False,
        pixel_pos=False,
    ),
    ModelConfig(
        "eamlp_7_bn",
        "t2t",
        dict(img_size=384, embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0, norm="batch"),
        EA,
        "EA paper (EAMLP-7 with BatchNorm in place of LayerNorm, as MoCo v3)",
        6.10,
        notes="Decision E4: BatchNorm replaces both LayerNorms of every backbone block",
    ),
]
for size, params in (("tiny", 6.18), ("small", 22.52)):
    dim, heads = {"tiny": (192, 3), "small": (384, 6)}[size]
    _rows.append(
        vit(
            f"aft_full_{size}_nofactor",
            AFT,
            "AFT paper Table 9: AFT-full with a full T x T position bias (not factorised)",
            params,
            embed_dim=dim,
            depth=12,
            num_heads=heads,
            mixer=("aft_full", dict(bias_dim=None)),
        )
    )
AFT_CONV_SMALL = dict(embed_dim=384, depth=12, num_heads=6, class_token=False, global_pool="avg", pos_embed="none")
for k, switch, params, what in (
    (11, "noreparam", 22.53, "Table 10: no re-parameterisation of the kernel"),
    (11, "noquery", 20.77, "Table 12: no query term"),
    (15, "noquery", 21.25, "Table 12: no query term"),
):
    opts = dict(reparam=False) if switch == "noreparam" else dict(query=False)
    _rows.append(
        vit(
            f"aft_conv_small_384_{k}_{switch}",
            AFT,
            f"AFT paper {what} (AFT-conv small, 384 heads, kernel {k})",
            params,
            mixer=("aft_conv", dict(num_heads=384, kernel_size=k, **opts)),
            **AFT_CONV_SMALL,
        )
    )


# --- small rows: one per line of each ablation table (docs/studies.md) ---------------------------------------
def mini(name: str, paper: str, source: str, **kw: Any) -> ModelConfig:
    return vit(name, paper, "vitlab small study row: " + source, **{**MINI, **kw})


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
]

# DeepViT's depth scaling and its alternatives to re-attention: width 32, 4 heads, MLP ratio 3
DEEP_MINI = dict(MINI, embed_dim=32, num_heads=4, mlp_ratio=3.0)
for depth in (16, 24, 32):
    _rows += [
        vit(f"vit_{depth}b_mini", DEEPVIT, f"vitlab small study row: ViT-{depth}B", **{**DEEP_MINI, "depth": depth}),
        vit(
            f"deepvit_{depth}b_mini",
            DEEPVIT,
            f"vitlab small study row: DeepViT-{depth}B (re-attention in every block)",
            mixer="reattention",
            **{**DEEP_MINI, "depth": depth},
        ),
    ]
DEEP16 = {**DEEP_MINI, "depth": 16}
_rows += [
    vit(
        "vit_16b_dla_mini",
        REFINER,
        "vitlab small study row: Refiner Table 2, ViT-16B + DLA",
        mixer=("refiner", dict(expansion=1, reduction=False)),
        **DEEP16,
    ),
    vit(
        "vit_16b_temp_mini",
        DEEPVIT,
        "vitlab small study row: learnable attention temperature",
        mixer="attention_temperature",
        **DEEP16,
    ),
    vit(
        "vit_16b_tempsched_mini",
        DEEPVIT,
        "vitlab small study row: attention temperature 1 -> 0.5 over 1000 steps",
        mixer=("attention_temperature", dict(temperature="scheduled", temperature_steps=1000)),
        **DEEP16,
    ),
    vit(
        "vit_16b_dropmap_mini",
        DEEPVIT,
        "vitlab small study row: dropping attention (p 0.1)",
        mixer="attention_dropmap",
        **DEEP16,
    ),
]

# TNT: position encodings (Table 6), words per patch (Table 8: m·c about constant), inner heads (Table 7)
TNT_MINI = dict(
    img_size=32, patch_size=4, outer_dim=64, inner_dim=16, depth=4, outer_heads=2, inner_heads=2, inner_stride=2
)


def tnt_mini(name: str, source: str, **kw: Any) -> ModelConfig:
    return tnt(name, "vitlab small study row: " + source, **{**TNT_MINI, **kw})


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

# CPVT: one PEG after block 0 (position 0) in its forms, paddings and placements; the position encodings it is
# compared with
CPVT_MINI = dict(pos_embed="none")
_rows += [
    mini("cpvt_peg0_mini", CPVT, "CPVT, one PEG at position 0", peg_at=(0,), **CPVT_MINI),
    mini(
        "cpvt_peg0_sep_mini",
        CPVT,
        "CPVT, PEG = one separable conv",
        peg_at=(0,),
        peg_options=dict(kind="separable"),
        **CPVT_MINI,
    ),
    mini(
        "cpvt_peg0_sep4_mini",
        CPVT,
        "CPVT, PEG = four separable convs",
        peg_at=(0,),
        peg_options=dict(kind="separable", layers=4),
        **CPVT_MINI,
    ),
    mini(
        "cpvt_peg0_nopad_mini",
        CPVT,
        "CPVT, PEG without zero padding (circular)",
        peg_at=(0,),
        peg_options=dict(padding="circular"),
        **CPVT_MINI,
    ),
    mini(
        "cpvt_peg0_frozen_mini",
        CPVT,
        "CPVT, frozen random PEG",
        peg_at=(0,),
        peg_options=dict(frozen=True),
        **CPVT_MINI,
    ),
    mini(
        "cpvt_peg0_fc12_mini",
        CPVT,
        "CPVT, twelve stacked 1x1 (FC) layers",
        peg_at=(0,),
        peg_options=dict(kind="fc", layers=12),
        **CPVT_MINI,
    ),
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
]

# AFT: no re-parameterisation (Table 10), no query (Table 12), no factorisation (Tables 3, 9), AFT-local windows
AFT_CONV_MINI = dict(class_token=False, global_pool="avg", pos_embed="none")
_rows += [
    mini(
        "aft_conv_noreparam_mini",
        AFT,
        "AFT Table 10, no re-parameterisation",
        mixer=("aft_conv", dict(num_heads=16, kernel_size=5, reparam=False)),
        **AFT_CONV_MINI,
    ),
    mini(
        "aft_conv_noquery_mini",
        AFT,
        "AFT Table 12, no query term",
        mixer=("aft_conv", dict(num_heads=16, kernel_size=5, query=False)),
        **AFT_CONV_MINI,
    ),
    mini(
        "aft_conv_noglobal_mini",
        AFT,
        "AFT §6.3.2, w = -inf outside the window",
        mixer=("aft_conv", dict(num_heads=16, kernel_size=5, outside="-inf")),
        **AFT_CONV_MINI,
    ),
    mini(
        "aft_full_nofactor_mini", AFT, "AFT Tables 3 and 9, a full T x T bias", mixer=("aft_full", dict(bias_dim=None))
    ),
    *[
        mini(
            f"aft_local_w{s}_mini",
            AFT,
            f"AFT Table 5, AFT-local window {s}",
            mixer=("aft_local", dict(window=s, bias_dim=32)),
        )
        for s in (0, 1, 2, 4, 8, 32)
    ],
]

# External attention: softmax-only vs double normalisation (EA and self-attention), BatchNorm, memory slots
EAMLP_MINI = dict(
    img_size=32,
    embed_dim=64,
    depth=4,
    num_heads=2,
    mlp_ratio=4.0,
    token_dim=32,
    soft_split=((3, 2, 1), (3, 2, 1), (3, 1, 1)),
)


def t2t_mini(name: str, paper: str, source: str, **kw: Any) -> ModelConfig:
    return ModelConfig(name, "t2t", {**EAMLP_MINI, **kw}, paper, "vitlab small study row: " + source)


_rows += [
    t2t_mini(
        "eamlp_softmax_mini",
        EA,
        "EA with the softmax over the tokens only (no l1 step)",
        mixer=("external_mh", dict(norm="softmax")),
    ),
    t2t_mini("eamlp_bn_mini", EA, "EAMLP with BatchNorm in the blocks", norm="batch"),
    *[
        t2t_mini(f"eamlp_s{s}_mini", EA, f"EA with {s} memory slots", mixer=("external_mh", dict(memory_size=s)))
        for s in (8, 32, 256)
    ],
    t2t_mini(
        "t2t_vit_mini",
        T2T,
        "T2T-ViT (Performer token layers, self-attention)",
        token_mixer="performer",
        mixer="attention",
    ),
    t2t_mini(
        "t2t_vit_dn_mini",
        EA,
        "T2T-ViT with double-normalised self-attention",
        token_mixer="performer",
        mixer="attention_double_norm",
    ),
]
_rows.append(
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
    )
)

register(*_rows)
