"""An Attention Free Transformer (Zhai et al. 2021, arXiv 2105.14103 v1): its ablation tables as studies.

Tables 3 and 9 (``aft-factorization``: factorised against full position bias), Table 5 (``aft-window``: the
AFT-local window), Table 10 (``aft-reparam``: re-parameterising the AFT-conv kernel), Table 11 (``aft-kernel``:
its size), Table 12 (``aft-query``: the contribution of the query), §6.3.2 (``aft-global``: global
connectivity) and the appendix (``aft-sparsity``: a sparser position bias); and §6.3.2's evaluation at 384 px
(``aft-resolution``), whose figures :mod:`vitlab.experiments.resolution` evaluates against.
"""

from __future__ import annotations

from typing import Any

from ..study import Study, rows

PAPER = "Zhai et al. 2021, An Attention Free Transformer (arXiv 2105.14103 v1)"


def aft_conv(k: int, **opts: Any) -> dict[str, Any]:
    """Overrides of an ``aft_conv_small_384_*`` model (384 heads): a ``k x k`` kernel with ``opts``."""
    return {"mixer": ("aft_conv", {"num_heads": 384, "kernel_size": k, **opts})}


def aft_conv_mini(k: int) -> dict[str, Any]:
    """Overrides of ``aft_conv_mini`` (16 heads): a ``k x k`` kernel."""
    return {"mixer": ("aft_conv", {"num_heads": 16, "kernel_size": k})}


TABLES: list[Study] = [
    Study(
        "aft-factorization",
        "AFT-full: factorised vs full position bias",
        PAPER,
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
        PAPER,
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
        "aft-reparam",
        "AFT-conv: re-parameterisation of the kernel",
        PAPER,
        "Table 10, AFT-conv small (384 heads, 11x11) on ImageNet",
        rows(
            ("reparam", "re-parameterised (default)", "aft_conv_mini", "aft_conv_small_384_11", {}, 80.8),
            ("raw", "raw kernel", "aft_conv_noreparam_mini", "aft_conv_small_384_11_noreparam", {}, None),
        ),
        notes="The paper says the re-parameterisation helps; its Table 10 figure for the raw kernel was not available.",
    ),
    Study(
        "aft-kernel",
        "AFT-conv: kernel size",
        PAPER,
        "Table 11, AFT-conv small (384 heads) on ImageNet; the table's own values are not given, the figures are "
        "those the paper states elsewhere for the same model",
        rows(
            *[
                (f"k{k}", f"{k}x{k}", "aft_conv_mini", "aft_conv_small_384_11", aft_conv(k), paper, aft_conv_mini(s))
                for k, s, paper in (
                    (3, 1, "about DeiT-S (79.9)"),
                    (7, 3, 80.8),
                    (11, 5, 80.8),
                    (15, 7, 81.0),
                )
            ]
        ),
        measures=(("top1", "paper top-1 %", "{}"),),
        notes="7x7: 80.8 (§6.3.2, the default beside the local-only variant); 11x11 and 15x15: Table 7; 3x3: the "
        "text says it matches DeiT-S. Small rows: kernels 1, 3, 5, 7 on the 4x4 grid (7 covers it, as 15 nearly "
        "covers 14x14).",
    ),
    Study(
        "aft-query",
        "AFT-conv: the contribution of the query",
        PAPER,
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
        "aft-global",
        "AFT-conv: global connectivity",
        PAPER,
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
    Study(
        "aft-sparsity",
        "AFT-conv: a sparser position bias, down to one context point per head",
        PAPER,
        "the appendix, AFT-conv small (384 heads, 11x11) on ImageNet: the bias regularised towards sparsity, and "
        "the extreme where each head has one non-zero context point (the convolution becomes indexing)",
        rows(
            ("dense", "learned k x k bias (default)", "aft_conv_mini", "aft_conv_small_384_11", {}, 80.8),
            (
                "sparse",
                "L1 penalty on exp(w) - 1",
                "aft_conv_sparse_mini",
                "aft_conv_small_384_11_sparse",
                {},
                "not given",
            ),
            (
                "one_point",
                "one context point per head",
                "aft_conv_one_point_mini",
                "aft_conv_small_384_11_one_point",
                {},
                "not given ('good accuracy')",
            ),
        ),
        measures=(("top1", "paper top-1 %", "{}"),),
        notes="The appendix's penalty and its weight are not given: vitlab's is 0.01 x the mean |exp(w) - 1| per "
        "layer, and each head's single point sits at a fixed offset, head i at offset i mod k² (Decision A5).",
    ),
]

# §6.3.2's evaluation at 384 px trains nothing: it is not a Study but the fields of a ResolutionStudy, which
# vitlab.experiments.resolution builds from them. That module reads this catalogue; importing its class here
# would make the two import each other.
RESOLUTION_TABLE: dict[str, Any] = {
    "name": "aft-resolution",
    "title": "AFT-conv: trained at 224, evaluated at 384 without fine-tuning",
    "source": "Zhai et al. 2021, AFT (arXiv 2105.14103), §6.3.2 (ImageNet top-1)",
    "sizes": (224, 384),
    "paper": {"aft_conv_small_384_15": {224: 81.0, 384: 81.6}},
}
