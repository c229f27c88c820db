"""The papers' ablation tables as studies: which named configurations form the rows, and what the paper reported.

Each :class:`Study` is one table of a paper (or one question its text answers with numbers). A row names a small
registered model (``*_mini``, for the embedded data on a CPU) and the paper-size model it stands for (a
registered name plus the switch as constructor overrides), and carries the paper's own figures. ``vitlab study
NAME`` trains the rows (:mod:`vitlab.experiments.reproduce`); docs/studies.md lists them with the reading of each table.

The papers' numbers are ImageNet top-1 (%) unless a study says otherwise; ``None`` marks a row whose number the
sources vitlab was built from do not give (the table exists in the paper, its values were not available).
"""

from __future__ import annotations

from ...common.registry import Registry
from ..study import AFT, CPVT, DEEPVIT, EA, REFINER, TNT, Row, Study, peg0, refiner, rows
from .more import MORE_STUDIES
from .seg import SEG_STUDIES

__all__ = ["STUDIES", "STUDY_LIST", "Row", "Study"]

DLA = ("refiner", {"expansion": 1, "reduction": False})  # Refiner Table 2: a 3x3 conv on the maps, nothing else

STUDY_LIST: list[Study] = [
    Study(
        "refiner-expansion",
        "Refiner: attention expansion ratio",
        REFINER,
        "Table 1, Refined-ViT (25M) on ImageNet; the paper also gives the epoch at which each run converged",
        rows(
            (
                "r1",
                "expansion ratio 1",
                "refiner_r1_mini",
                "refiner_16b",
                refiner(expansion=1),
                {"top1": 82.3, "epochs": 300},
            ),
            (
                "r2",
                "expansion ratio 2",
                "refiner_r2_mini",
                "refiner_16b",
                refiner(expansion=2),
                {"top1": 82.8, "epochs": 300},
            ),
            (
                "r3",
                "expansion ratio 3",
                "refiner_mini",
                "refiner_16b",
                refiner(expansion=3),
                {"top1": 82.8, "epochs": 273},
            ),
            (
                "r4",
                "expansion ratio 4",
                "refiner_r4_mini",
                "refiner_16b",
                refiner(expansion=4),
                {"top1": 82.9, "epochs": 270},
            ),
            (
                "r6",
                "expansion ratio 6",
                "refiner_r6_mini",
                "refiner_16b",
                refiner(expansion=6),
                {"top1": 83.0, "epochs": 261},
            ),
        ),
        measures=(("top1", "paper top-1 %", "{:.1f}"), ("epochs", "paper converged (epoch)", "{:.0f}")),
    ),
    Study(
        "refiner-kernel",
        "Refiner: constraints on the DLA kernel",
        REFINER,
        "Table 4, Refined-ViT-16B on ImageNet",
        rows(
            ("none", "no constraint (k x k)", "refiner_mini", "refiner_16b", refiner(), 83.0),
            (
                "spatial",
                "spatial (k x k over the keys' image grid)",
                "refiner_spatial_mini",
                "refiner_16b",
                refiner(kernel_constraint="spatial"),
                82.7,
            ),
            (
                "rowcol",
                "row + column (a cross on the keys' grid)",
                "refiner_rowcol_mini",
                "refiner_16b",
                refiner(kernel_constraint="rowcol"),
                81.7,
            ),
        ),
        notes="The paper names the constraints without defining them; vitlab's reading (docs/semantics.md, Decision "
        "R4) makes the span shrink down the table as the figures do: no constraint is the k x k kernel over the map, "
        "spatial a k x k kernel over the keys' image grid, row + column its cross through the key.",
    ),
    Study(
        "refiner-dla",
        "Refiner: a 3x3 convolution on a ViT's attention maps",
        REFINER,
        "Table 2, four ViTs with and without a 3x3 convolution on their attention maps, on ImageNet",
        rows(
            ("vit12", "ViT-12B (768 wide)", "deit_mini", "deit_base_patch16_224", {}, 79.5),
            ("dla12", "ViT-12B + DLA", "deit_mini", "deit_base_patch16_224", {"mixer": DLA}, 81.2, {"mixer": DLA}),
            ("vit", "ViT-16B", "vit_16b_mini", "vit_16b", {}, 78.9),
            ("dla", "ViT-16B + DLA", "vit_16b_dla_mini", "vit_16b_dla", {}, 80.3),
            *[
                row
                for d, plain, dla in ((24, 79.3, 80.9), (32, 79.2, 81.1))
                for row in (
                    (f"vit{d}", f"ViT-{d}B", f"vit_{d}b_mini", f"vit_{d}b", {}, plain),
                    (f"dla{d}", f"ViT-{d}B + DLA", f"vit_{d}b_mini", f"vit_{d}b_dla", {}, dla, {"mixer": DLA}),
                )
            ],
        ),
        notes="ViT-16/24/32B are 384 wide with 12 heads (DeepViT's baselines); ViT-12B is DeiT-B. The small ViT-12B "
        "rows are deit_mini (4 blocks).",
    ),
    Study(
        "tnt-pos",
        "TNT: patch and pixel position encodings",
        TNT,
        "Table 6, TNT-S on ImageNet",
        rows(
            ("both", "patch + pixel PE", "tnt_mini", "tnt_s_patch16_224", {}, 81.5),
            ("no_patch", "pixel PE only", "tnt_no_patch_pos_mini", "tnt_s_no_patch_pos", {}, 80.7),
            ("no_pixel", "patch PE only", "tnt_no_pixel_pos_mini", "tnt_s_no_pixel_pos", {}, 80.8),
            ("none", "no PE", "tnt_no_pos_mini", "tnt_s_no_pos", {}, 80.5),
        ),
    ),
    Study(
        "tnt-words",
        "TNT: number of visual words per patch",
        TNT,
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
    Study(
        "tnt-inner-heads",
        "TNT: heads of the inner transformer",
        TNT,
        "Table 7, TNT-S on ImageNet (inner width 24)",
        rows(
            *[
                (f"h{h}", f"{h} inner heads", f"tnt_ih{h}_mini", "tnt_s_patch16_224", {"inner_heads": h}, top1)
                for h, top1 in ((1, 81.0), (2, 81.4), (4, 81.5), (6, 81.3), (8, 81.1))
            ]
        ),
    ),
    Study(
        "cpvt-peg-form",
        "CPVT: the PEG as one depth-wise, one separable or four separable convolutions",
        CPVT,
        "the PEG-form ablation, CPVT-Ti with one PEG at position 0 on ImageNet",
        rows(
            ("dw", "1 depth-wise conv", "cpvt_peg0_mini", "cpvt_ti_peg0", {}, 72.4),
            ("sep", "1 separable conv", "cpvt_peg0_sep_mini", "cpvt_ti_peg0", peg0(kind="separable"), None),
            (
                "sep4",
                "4 separable convs",
                "cpvt_peg0_sep4_mini",
                "cpvt_ti_peg0",
                peg0(kind="separable", layers=4),
                72.9,
            ),
        ),
    ),
    Study(
        "cpvt-padding",
        "CPVT: the PEG with and without zero padding",
        CPVT,
        "the padding ablation, CPVT-Ti with one PEG at position 0 on ImageNet",
        rows(
            ("zero", "zero padding", "cpvt_peg0_mini", "cpvt_ti_peg0", {}, 72.4),
            (
                "none",
                "no zero padding (circular)",
                "cpvt_peg0_nopad_mini",
                "cpvt_ti_peg0",
                peg0(padding="circular"),
                70.5,
            ),
        ),
        notes="Without zero padding vitlab pads circularly, so the PEG has no border to anchor on (Decision C2).",
    ),
    Study(
        "cpvt-position-or-capacity",
        "CPVT: is it the position information or the extra parameters?",
        CPVT,
        "the 'position or capacity' ablation, CPVT-Ti on ImageNet",
        rows(
            ("peg", "PEG (3x3, learned)", "cpvt_peg0_mini", "cpvt_ti_peg0", {}, 72.4),
            ("frozen", "frozen random PEG", "cpvt_peg0_frozen_mini", "cpvt_ti_peg0", peg0(frozen=True), 71.3),
            (
                "fc",
                "12 stacked 1x1 (FC) layers",
                "cpvt_peg0_fc12_mini",
                "cpvt_ti_peg0",
                peg0(kind="fc", layers=12),
                68.6,
            ),
            (
                "qk",
                "PEG on Q and K only",
                "cpvt_peg_qk_mini",
                "cpvt_ti_peg0",
                {"peg_at": (), "mixer": ["attention", "attention_peg_qk", *["attention"] * 10]},
                71.3,
            ),
        ),
    ),
    Study(
        "cpvt-pe-type",
        "CPVT: kinds of position encoding (with 2-D relative position encoding as the baseline)",
        CPVT,
        "the position-encoding comparison on DeiT-tiny / CPVT-Ti, ImageNet",
        rows(
            ("none", "no position encoding", "deit_nope_mini", "deit_tiny_patch16_224", {"pos_embed": "none"}, 68.2),
            ("learned", "learned table", "deit_mini", "deit_tiny_patch16_224", {}, 72.2),
            ("sincos", "2-D sin-cos", "deit_sincos_mini", "deit_tiny_patch16_224", {"pos_embed": "sincos"}, 72.3),
            (
                "rpe",
                "2-D relative (RPE)",
                "deit_rpe2d_mini",
                "deit_tiny_patch16_224",
                {"pos_embed": "none", "mixer": [("attention_rpe2d", {"max_distance": 13})] * 11 + ["attention"]},
                70.5,
            ),
            ("peg", "PEG at position 0", "cpvt_peg0_mini", "cpvt_ti_peg0", {}, 72.4),
            (
                "learned_every_block",
                "a learned table of its own before every block",
                "deit_pe_every_block_mini",
                "deit_tiny_pe_every_block",
                {},
                None,
            ),
        ),
        notes="The paper compares encodings added to the first block's input with the same added before every block "
        "(and finds the PEG better there too); its figure for the learned table before every block is not given.",
    ),
    Study(
        "cpvt-peg-placement",
        "CPVT: where the PEG sits and its kernel size",
        CPVT,
        "the position and kernel-size ablations of CPVT-Ti on ImageNet (‡ = PEGs after the first five blocks)",
        rows(
            ("pos-1", "position -1, 3x3", "cpvt_before_mini", "cpvt_ti_peg0", {"peg_at": (-1,)}, 70.6),
            (
                "pos-1_k27",
                "position -1, 27x27 (whole grid)",
                "cpvt_before_k7_mini",
                "cpvt_ti_peg0",
                {"peg_at": (-1,), "peg_kernel": 27},
                72.5,
            ),
            ("pos0_k1", "position 0, 1x1", "cpvt_peg0_k1_mini", "cpvt_ti_peg0", {"peg_kernel": 1}, None),
            ("pos0", "position 0, 3x3", "cpvt_peg0_mini", "cpvt_ti_peg0", {}, 72.4),
            ("pos0_k5", "position 0, 5x5", "cpvt_peg0_k5_mini", "cpvt_ti_peg0", {"peg_kernel": 5}, None),
            ("pos0_k7", "position 0, 7x7", "cpvt_peg0_k7_mini", "cpvt_ti_peg0", {"peg_kernel": 7}, None),
            ("many", "after each of the first blocks (‡)", "cpvt_mini", "cpvt_ti", {}, 73.4),
        ),
        notes="The paper reports a large drop for 1x1 and little change for 5x5 / 7x7 without figures in vitlab's "
        "sources. Small rows: a 7x7 PEG covers the whole 4x4 grid as 27x27 covers 14x14; cpvt_mini has PEGs after 3 "
        "of its 4 blocks.",
    ),
    Study(
        "deepvit-alternatives",
        "DeepViT: re-attention against sharper or sparser attention",
        DEEPVIT,
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
        DEEPVIT,
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
        "maps' columns, averaged: DeepViT §3); vitlab measures it on 64 held-out images of the trained models.",
    ),
    Study(
        "ea-norm",
        "External attention: softmax only vs double normalisation, for EA and for self-attention",
        EA,
        "the normalisation ablation (PASCAL VOC segmentation in the paper) and its note that double "
        "normalisation also lifts T2T-ViT on ImageNet by 0.1-0.3",
        rows(
            ("ea_dn", "EA, double normalisation", "eamlp_mini", "eamlp_14", {}, "better (VOC)"),
            (
                "ea_softmax",
                "EA, softmax only",
                "eamlp_softmax_mini",
                "eamlp_14",
                {"mixer": ("external_mh", {"norm": "softmax"})},
                "about 2 mIoU worse (VOC)",
            ),
            ("sa_softmax", "self-attention, softmax", "t2t_vit_mini", "t2t_vit_14", {}, 81.5),
            (
                "sa_dn",
                "self-attention, double normalisation",
                "t2t_vit_dn_mini",
                "t2t_vit_14",
                {"mixer": "attention_double_norm"},
                "+0.1 to +0.3",
            ),
        ),
        measures=(("top1", "paper", "{}"),),
        notes="T2T-ViT-14's 81.5 is the T2T-ViT paper's. Softmax-only EA keeps the softmax over the tokens (Decision E3).",
    ),
    Study(
        "ea-batchnorm",
        "EAMLP: BatchNorm in place of LayerNorm",
        EA,
        "EAMLP-7 (the authors' write-up: BatchNorm as in MoCo v3 gave +1.1; larger models diverged)",
        rows(
            ("ln", "LayerNorm", "eamlp_mini", "eamlp_7", {}, 71.7),
            ("bn", "BatchNorm", "eamlp_bn_mini", "eamlp_7_bn", {}, "+1.1 over LayerNorm"),
        ),
        measures=(("top1", "paper", "{}"),),
        notes="EAMLP-7's 71.7 is the official README's (384 px).",
    ),
    Study(
        "ea-memory",
        "External attention: number of memory slots S",
        EA,
        "the memory-size ablation (PASCAL VOC mIoU in the paper; S = 64 best, 77.4)",
        rows(
            ("s8", "S = 8", "eamlp_s8_mini", "eamlp_14", {"mixer": ("external_mh", {"memory_size": 8})}, None),
            ("s32", "S = 32", "eamlp_s32_mini", "eamlp_14", {"mixer": ("external_mh", {"memory_size": 32})}, None),
            ("s64", "S = 64", "eamlp_mini", "eamlp_14", {}, 77.4),
            ("s256", "S = 256", "eamlp_s256_mini", "eamlp_14", {"mixer": ("external_mh", {"memory_size": 256})}, None),
        ),
        measures=(("top1", "paper mIoU (VOC)", "{:.1f}"),),
    ),
    Study(
        "aft-reparam",
        "AFT-conv: re-parameterisation of the kernel",
        AFT,
        "Table 10, AFT-conv small (384 heads, 11x11) on ImageNet",
        rows(
            ("reparam", "re-parameterised (default)", "aft_conv_mini", "aft_conv_small_384_11", {}, 80.8),
            ("raw", "raw kernel", "aft_conv_noreparam_mini", "aft_conv_small_384_11_noreparam", {}, None),
        ),
        notes="The paper says the re-parameterisation helps; its Table 10 figure for the raw kernel was not available.",
    ),
    Study(
        "aft-query",
        "AFT-conv: the contribution of the query",
        AFT,
        "Table 12, AFT-conv small (384 heads, 11x11 and 15x15) on ImageNet",
        rows(
            ("q11", "with query, 11x11", "aft_conv_mini", "aft_conv_small_384_11", {}, 80.8),
            ("noq11", "without query, 11x11", "aft_conv_noquery_mini", "aft_conv_small_384_11_noquery", {}, None),
            ("q15", "with query, 15x15", "aft_conv_mini", "aft_conv_small_384_15", {}, 81.0),
            ("noq15", "without query, 15x15", "aft_conv_noquery_mini", "aft_conv_small_384_15_noquery", {}, None),
        ),
        notes="The small rows have one kernel size (5x5), so each appears twice. The figures without the query were "
        "not available.",
    ),
    Study(
        "aft-factorization",
        "AFT-full: factorised vs full position bias",
        AFT,
        "Table 3 (CIFAR-10 sequence modelling, AFT-local-256, test bits/dim) and Table 9 (ImageNet, AFT-full)",
        rows(
            ("factorized", "factorised w = u vᵀ", "aft_full_mini", "aft_full_tiny", {}, {"bpd": 2.74, "top1": None}),
            (
                "full",
                "full T x T w",
                "aft_full_nofactor_mini",
                "aft_full_tiny_nofactor",
                {},
                {"bpd": 2.84, "top1": None},
            ),
        ),
        measures=(("bpd", "paper CIFAR-10 bits/dim", "{:.2f}"), ("top1", "paper top-1 %", "{:.1f}")),
        notes="The sequence-model side runs with `vitlab lm train --bias-dim full`; Table 9's ImageNet figures were not "
        "available.",
    ),
    Study(
        "aft-window",
        "AFT-local: window size",
        AFT,
        "Table 5, AFT-local on Enwik8 (L = 24, d = 256; test bits per character)",
        rows(
            *[
                (
                    f"w{s}",
                    f"window {s}",
                    f"aft_local_w{s}_mini",
                    "aft_full_small",
                    {"mixer": ("aft_local", {"window": s})},
                    bpc,
                )
                for s, bpc in ((0, 1.209), (1, 1.205), (2, 1.176), (4, 1.165), (8, 1.162), (32, 1.154))
            ]
        ),
        measures=(("top1", "paper test bpc (Enwik8)", "{:.3f}"),),
        notes="The paper varies the window of a character-level language model (`vitlab lm train --window S`); the "
        "study varies it over the image tokens, where 32 covers every pair of the small models' 17 tokens.",
    ),
    Study(
        "aft-global",
        "AFT-conv: global connectivity",
        AFT,
        "§6.3.2, AFT-conv small with a 7x7 kernel on ImageNet",
        rows(
            ("global", "w = 0 outside the window", "aft_conv_mini", "aft_conv_small_384_7", {}, 80.8),
            (
                "local",
                "w = -inf outside the window",
                "aft_conv_noglobal_mini",
                "aft_conv_small_384_7_noglobal",
                {},
                79.9,
            ),
        ),
    ),
]

STUDIES: Registry[Study] = Registry(
    "study",
    lambda s: (lambda: s, {}),
    rows={s.name: s for s in [*STUDY_LIST, *MORE_STUDIES, *SEG_STUDIES]},
    listed_by="vitlab study --list",
)
