"""Every named vision model as a row of a table, registered in :mod:`vitlab.models.registry` (where each
number comes from: docs/models.md).

Parameter/MAC targets are for 1000 classes at the default input size. The
``*_mini`` rows are small variants of each family (patch 4, 32 px input) for
CPU training; build them with ``img_size=28, in_chans=1`` for MNIST.

Each row also carries how its official code evaluates (crop fraction, interpolation, normalisation: the
``default_cfgs`` of that code), the ImageNet top-1 its paper or README reports, and where the official
checkpoint is published; these become the model's ``pretrained_cfg``.
"""

from __future__ import annotations

from typing import Any

from .registry import ModelConfig, register

DEIT = "Touvron et al. 2021, Training data-efficient image transformers (DeiT)"
REFINER = "Zhou et al. 2021, Refiner: Refining Self-attention for Vision Transformers"
TNT = "Han et al. 2021, Transformer in Transformer"
CPVT = "Chu et al. 2021, Conditional Positional Encodings for Vision Transformers (CPVT)"
DEEPVIT = "Zhou et al. 2021, DeepViT: Towards Deeper Vision Transformer"
EA = "Guo et al. 2021, Beyond Self-attention: External Attention using Two Linear Layers"
AFT = "Zhai et al. 2021, An Attention Free Transformer"

# width, heads of the DeiT backbones
DEIT_SIZES = {"tiny": (192, 3), "small": (384, 6), "base": (768, 12)}
# evaluation protocols of the official code (its default_cfgs / evaluation transform); DeiT's: resize to 256,
# centre-crop 224, ImageNet mean/std
HALF = (0.5, 0.5, 0.5)
DEIT_EVAL = dict(crop_pct=0.875, interpolation="bicubic")
DEEPVIT_EVAL = dict(crop_pct=0.9, interpolation="bicubic", mean=HALF, std=HALF)  # dvit_repo default_cfgs
TNT_EVAL = dict(crop_pct=0.9, interpolation="bicubic", mean=HALF, std=HALF)  # tnt_pytorch default_cfgs
T2T_EVAL = dict(crop_pct=0.9, interpolation="bicubic")  # EANet EAMLP/models/t2t_vit.py default_cfgs
MINI_EVAL = dict(crop_pct=1.0, interpolation="bilinear")  # small images are used whole, as vitlab trains
MINI = dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2, mlp_ratio=4.0, evaluation=MINI_EVAL)
DEIT_URL = "https://dl.fbaipublicfiles.com/deit/"
DVIT_README = "zhoudaquan/dvit_repo README (Google Drive file {})"


def alternate(depth: int, even: Any, odd: Any) -> list[Any]:
    return [even if i % 2 == 0 else odd for i in range(depth)]


def last(depth: int, n: int, base: Any, special: Any) -> list[Any]:
    """``base`` in the first ``depth - n`` blocks, ``special`` in the last ``n`` (DeepViT-S/L)."""
    return [base] * (depth - n) + [special] * n


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


# Refined-ViT (official code): even blocks = attention + s·(map two blocks back), odd blocks = the shared
# block refining the previous map with DLA (expansion 3, 3x3, BN/ReLU6, identity, adapt_bn); no q/k there.
REFINER_NORMAL = ("refiner", dict(refine=False, residual_attention=True))
REFINER_SHARED = ("refiner", dict(share=True, official_extras=True))
REFINER_OFFICIAL = dict(mlp_ratio=3.0, stem_channels=(32, 64, 128), residual_scale=0.5, ls_init=(None, 1e-5))
DEEPVIT_OFFICIAL = dict(mlp_ratio=3.0, stem_channels=(64, 64), residual_scale=0.5)
# Refiner paper Table 2: a 3x3 convolution directly on the heads' attention maps (no expansion, no reduction)
DLA_ONLY = ("refiner", dict(expansion=1, reduction=False))

_rows: list[ModelConfig] = []

# --- DeiT / ViT baselines -------------------------------------------------------------------------------
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

# --- DeepViT: ViT baselines of the paper, re-attention in every block, and the official S/L ----------
# top-1 and checkpoints: the dvit_repo README's first table (ViT-N / DeepViT-N, re-attention "FC")
for depth, params, params_re, top1, top1_re, drive in (
    (16, 24.42, 24.43, 78.88, 79.10, ""),
    (24, 36.26, 36.26, 79.35, 79.99, "1lPmKdNMPJq-mq-4FivqIY4JNAPoQHYxV"),
    (32, 48.09, 48.10, 79.27, 80.90, "1kUBrAbAQfMT5FQJprITRxDtOE6ECZM0M"),
):
    deep = dict(embed_dim=384, depth=depth, num_heads=12, mlp_ratio=3.0, evaluation=DEEPVIT_EVAL)
    src = f"zhoudaquan/dvit_repo deep_vision_transformer.py deepvit_patch16_224_re_attn_{depth}b"
    _rows += [
        vit(f"vit_{depth}b", DEEPVIT, src + " (apply_transform off)", params, top1=top1, **deep),
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
        vit(
            f"vit_{depth}b_dla",
            REFINER,
            "Refiner paper Table 2: ViT + 3x3 conv on attention maps",
            params,
            mixer=DLA_ONLY,
            **deep,
        ),
    ]
_rows += [
    vit(
        "vit_base_dla",
        REFINER,
        "Refiner paper Table 2: ViT-B + 3x3 conv on attention maps",
        86.57,
        embed_dim=768,
        depth=12,
        num_heads=12,
        mixer=DLA_ONLY,
    ),
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
_rows.append(
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
    )
)

# --- AFT on the DeiT backbone (AFT Table 7) -------------------------------------------------------------
# top-1: AFT paper Table 7 and the kernel-7 ablation of §6.3.2; no official code or checkpoints
for size, params, top1 in (("tiny", 6.32, 72.4), ("small", 22.66, 79.8)):
    dim, heads = DEIT_SIZES[size]
    _rows.append(
        vit(
            f"aft_full_{size}",
            AFT,
            "AFT Table 7 (d' = 128)",
            params,
            top1=top1,
            embed_dim=dim,
            depth=12,
            num_heads=heads,
            mixer=("aft_full", dict(bias_dim=128)),
        )
    )
for size, heads_aft, k, params, top1 in (
    ("tiny", 32, 11, 5.36, 73.9),
    ("tiny", 192, 11, 5.96, 74.8),
    ("small", 16, 11, 20.30, 80.2),
    ("small", 384, 11, 22.54, 80.8),
    ("small", 384, 15, 23.02, 81.0),
):
    dim, heads = DEIT_SIZES[size]
    _rows.append(
        vit(
            f"aft_conv_{size}_{heads_aft}_{k}",
            AFT,
            "AFT Table 7 (no class token, no position table, GAP)",
            params,
            top1=top1,
            embed_dim=dim,
            depth=12,
            num_heads=heads,
            class_token=False,
            global_pool="avg",
            pos_embed="none",
            mixer=("aft_conv", dict(num_heads=heads_aft, kernel_size=k)),
        )
    )
# AFT Table 8: AFT-conv on DeiT-B at 384 px (32 heads, kernel 25), fine-tuned from DeiT-B@384 ("ft", 83.4) or
# trained from a random start ("rand", 81.6); the paper gives 79.7M parameters
_rows.append(
    vit(
        "aft_conv_base_32_25_384",
        AFT,
        "AFT Table 8 (DeiT-B backbone at 384, no class token, no position table, GAP)",
        79.86,
        top1=83.4,
        img_size=384,
        embed_dim=768,
        depth=12,
        num_heads=12,
        class_token=False,
        global_pool="avg",
        pos_embed="none",
        mixer=("aft_conv", dict(num_heads=32, kernel_size=25)),
        notes="paper 79.7M; top-1 83.4 fine-tuned from DeiT-B@384 (vitlab train --init-from), 81.6 from a random start",
    )
)
# AFT §6.3.2 global-connectivity ablation: kernel 7, w = -inf outside the window (79.9 vs 80.8 with the global sum)
for suffix, outside, top1 in (("", "zero", 80.8), ("_noglobal", "-inf", 79.9)):
    _rows.append(
        vit(
            f"aft_conv_small_384_7{suffix}",
            AFT,
            f"AFT §6.3.2 ablation (kernel 7, outside={outside})",
            top1=top1,
            embed_dim=384,
            depth=12,
            num_heads=6,
            class_token=False,
            global_pool="avg",
            pos_embed="none",
            mixer=("aft_conv", dict(num_heads=384, kernel_size=7, outside=outside)),
        )
    )

# --- small variants for CPU training (patch 4, 32 px) ---------------------------------------------------
_rows += [
    vit("deit_mini", DEIT, "vitlab: small DeiT", **MINI),
    vit("deepvit_mini", DEEPVIT, "vitlab: small DeepViT (re-attention in every block)", **MINI, mixer="reattention"),
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
    vit("aft_full_mini", AFT, "vitlab: small AFT-full", **MINI, mixer=("aft_full", dict(bias_dim=32))),
    vit("aft_simple_mini", AFT, "vitlab: small AFT-simple", **MINI, mixer="aft_simple"),
    vit(
        "aft_conv_mini",
        AFT,
        "vitlab: small AFT-conv",
        **MINI,
        class_token=False,
        global_pool="avg",
        pos_embed="none",
        mixer=("aft_conv", dict(num_heads=16, kernel_size=5)),
    ),
]

# --- EAMLP: T2T-ViT with external attention everywhere (EA token layers S=128, multi-head EA blocks) ---
# The position table is a fixed sinusoid recomputed for the input's token count, so every row runs at any size.
# top-1: EAMLP-7 at 384 px from the official README (its checkpoint is in the repository); EAMLP-14/19 from the
# Vision Permutator README's comparison (no official checkpoint)
EAMLP_7_WEIGHTS = "MenghaoGuo/EANet EAMLP/EAMLP_7_384/model_best.pth.tar"
for depth, dim, heads, mlp, params, top1 in (
    (7, 256, 4, 2.0, 6.10, 71.7),
    (14, 384, 6, 3.0, 29.80, 78.9),
    (19, 448, 7, 3.0, 54.47, 79.4),
):
    _rows.append(
        ModelConfig(
            f"eamlp_{depth}",
            "t2t",
            dict(img_size=384 if depth == 7 else 224, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=mlp),
            EA,
            f"MenghaoGuo/EANet EAMLP/models/t2t_vit.py T2t_vit_{depth} (external attention)",
            params,
            notes=(
                "official input 384 (EAMLP_7_384/args.yaml, 71.7% top-1); img_size=224 gives the same parameters"
                if depth == 7
                else "top-1 quoted by the Vision Permutator README, not by the EANet repository"
            ),
            top1=top1,
            weights_url=EAMLP_7_WEIGHTS if depth == 7 else "",
            **T2T_EVAL,
        )
    )
_rows.append(
    ModelConfig(
        "eamlp_mini",
        "t2t",
        dict(
            img_size=32,
            embed_dim=64,
            depth=4,
            num_heads=2,
            mlp_ratio=4.0,
            token_dim=32,
            soft_split=((3, 2, 1), (3, 2, 1), (3, 1, 1)),
        ),
        EA,
        "vitlab: small EAMLP (soft splits k/s/p 3/2/1, 3/2/1, 3/1/1: an 8x8 grid at 32 px, 7x7 at 28)",
        notes="the official 7/4/2 first split would leave a 2x2 grid at 32 px; stride 1 comes last so that the "
        "token layers see 256 and 64 tokens instead of 1024 and 256 (a third fewer MACs)",
        **MINI_EVAL,
    )
)

# --- TNT (official non-legacy Huawei code, no frozen unused outer_tokens: docs/semantics.md, Decision T2) ------
TNT_SRC = "huawei-noah/Efficient-AI-Backbones tnt_pytorch/tnt.py"
TNT_SIZES = {"ti": (192, 12, 3, 2, 6.08, 1.40), "s": (384, 24, 6, 4, 23.77, 5.22), "b": (640, 40, 10, 4, 65.43, 14.05)}
# top-1: TNT paper Tables 4, 5, 12; checkpoints: the official release (also on BaiduDisk per its readme)
TNT_TOP1 = {"ti": 73.9, "s": 81.5, "b": 82.9}
TNT_WEIGHTS = "https://github.com/huawei-noah/Efficient-AI-Backbones/releases/download/tnt/tnt_{}.pth.tar"


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
_rows += [
    tnt(
        "tnt_s_se_patch16_224",
        "TNT paper Table 12 (TNT-S + SE; official Block se>0 = hidden C/4)",
        24.67,
        5.22,
        se=4,
        top1=81.6,
        notes="paper 24.7M; top-1 81.6 in the paper's first version (TNT-S 81.3 there), 81.7 in the later one",
    ),
    tnt(
        "tnt_mini",
        "vitlab: small TNT (patch 4 -> 2x2 words of 16 channels)",
        evaluation=MINI_EVAL,
        img_size=32,
        patch_size=4,
        outer_dim=64,
        inner_dim=16,
        depth=4,
        outer_heads=2,
        inner_heads=2,
        inner_stride=2,
    ),
]

register(*_rows)
