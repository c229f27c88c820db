"""Conditional Positional Encodings, CPVT (Chu et al. 2021, arXiv 2102.10882): its ablation tables as studies.

The PEG's form (``cpvt-peg-form``), its padding (``cpvt-padding``), position information against extra
parameters (``cpvt-position-or-capacity``), kinds of position encoding (``cpvt-pe-type``, DeiT-tiny's
encodings beside the PEG, before every block, and with the PEG), where the PEG sits and its kernel size (``cpvt-peg-placement``), all CPVT-Ti with the
paper's ImageNet top-1; and Table 2 (``cpvt-resolution``: one checkpoint evaluated at larger inputs), whose
figures :mod:`vitlab.experiments.resolution` evaluates against.
"""

from __future__ import annotations

from typing import Any

from ..study import Study, rows

PAPER = "Chu et al. 2021, Conditional Positional Encodings (arXiv 2102.10882)"


def peg0(**options: Any) -> dict[str, Any]:
    """Overrides of ``cpvt_ti_peg0`` (one PEG after block 0): PEG ``options``."""
    return {"peg_options": options}


TABLES: list[Study] = [
    Study(
        "cpvt-peg-form",
        "CPVT: the PEG as one depth-wise, one separable or four separable convolutions",
        PAPER,
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
        PAPER,
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
        PAPER,
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
        PAPER,
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
            (
                "sincos_every_block",
                "the 2-D sin-cos table before every block",
                "deit_sincos_every_block_mini",
                "deit_tiny_sincos_every_block",
                {},
                None,
            ),
            (
                "peg_le",
                "PEG at position 0 + learned table (PEG + LE)",
                "cpvt_peg0_le_mini",
                "cpvt_ti_peg0_le",
                {},
                72.9,
            ),
            (
                "peg_sincos",
                "PEG at position 0 + 2-D sin-cos (PEG + sin-cos)",
                "cpvt_peg0_sincos_mini",
                "cpvt_ti_peg0_sincos",
                {},
                None,
            ),
        ),
        notes="The paper compares encodings added to the first block's input with the same added before every block "
        "(and finds the PEG better there too), and the PEG combined with an absolute encoding (LE: learnable "
        "encoding); vitlab's sources give PEG + LE as +0.5 over the single PEG (72.4 + 0.5), and no figure for the "
        "encodings before every block or for PEG + sin-cos.",
    ),
    Study(
        "cpvt-peg-placement",
        "CPVT: where the PEG sits and its kernel size",
        PAPER,
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
]

# Table 2 trains nothing: it evaluates one checkpoint at other input sizes, so it is not a Study but the fields of
# a ResolutionStudy, which vitlab.experiments.resolution builds from them. That module reads this catalogue;
# importing its class here would make the two import each other.
RESOLUTION_TABLE: dict[str, Any] = {
    "name": "cpvt-resolution",
    "title": "CPVT: trained at 224, evaluated at larger sizes without fine-tuning",
    "source": "Chu et al. 2021, CPVT (arXiv 2102.10882), Table 2 (ImageNet top-1)",
    "sizes": (224, 384, 448, 512),
    "paper": {
        "deit_tiny_patch16_224": {224: 72.2, 384: 71.2, 448: 68.8, 512: 65.9},
        "cpvt_ti_peg0": {224: 72.4, 384: 73.2, 448: 71.8, 512: 70.3},
        "cpvt_ti": {224: 73.4, 384: 74.2, 448: 72.6, 512: 70.8},
        "deit_small_patch16_224": {224: 79.9, 384: 78.1, 448: 75.9, 512: 72.6},
        "cpvt_s": {224: 79.9, 384: 80.4, 448: 78.6, 512: 76.8},
    },
}
