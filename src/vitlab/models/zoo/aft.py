"""AFT on the DeiT backbone: AFT-full and AFT-conv at tiny / small (Table 7) and base at 384 px (Table 8), the
paper-size ablations (global connectivity, factorised bias, re-parameterisation, query term, and the appendix's
sparsity penalty and one context point per head), the small ``aft_full_mini`` / ``aft_simple_mini`` /
``aft_conv_mini``, and one small study row per line of those tables and of AFT-local's window sizes."""

from __future__ import annotations

from typing import Any

from ..registry import ModelConfig, register
from ._shared import DEIT_SIZES, MINI, mini, vit

AFT = "Zhai et al. 2021, An Attention Free Transformer"

#: the sparsity penalty's weight of the rows below (the paper gives none; docs/studies.md)
SPARSITY_WEIGHT = 1e-2
# AFT-conv's backbone: no class token, no position table, global average pooling
AFT_CONV_SMALL = dict(embed_dim=384, depth=12, num_heads=6, class_token=False, global_pool="avg", pos_embed="none")
AFT_CONV_MINI = dict(class_token=False, global_pool="avg", pos_embed="none")


def aft_conv_row(name: str, k: int, params: float, what: str, **opts: Any) -> ModelConfig:
    """AFT-conv small with 384 heads and a k x k kernel, with mixer options ``opts`` (``what``: where the paper
    reports it)."""
    return vit(
        name,
        AFT,
        f"AFT paper {what} (AFT-conv small, 384 heads, kernel {k})",
        params,
        mixer=("aft_conv", dict(num_heads=384, kernel_size=k, **opts)),
        **AFT_CONV_SMALL,
    )


_rows: list[ModelConfig] = []

# --- AFT on the DeiT backbone (AFT Table 7) -------------------------------------------------------------
# top-1: AFT paper Table 7; no official code or checkpoints
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

# --- full-size ablation rows the paper names -------------------------------------------------------------------
# §6.3.2 global-connectivity ablation: kernel 7, w = -inf outside the window (top-1 79.9 vs 80.8 with the
# global sum)
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
for size, params in (("tiny", 6.18), ("small", 22.52)):
    dim, heads = DEIT_SIZES[size]
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
for k, switch, params, what in (
    (11, "noreparam", 22.53, "Table 10: no re-parameterisation of the kernel"),
    (11, "noquery", 20.77, "Table 12: no query term"),
    (15, "noquery", 21.25, "Table 12: no query term"),
):
    opts = dict(reparam=False) if switch == "noreparam" else dict(query=False)
    _rows.append(aft_conv_row(f"aft_conv_small_384_{k}_{switch}", k, params, what, **opts))
_rows += [
    aft_conv_row(
        "aft_conv_small_384_11_sparse",
        11,
        22.54,
        "appendix: an L1 penalty on the position bias",
        sparsity=SPARSITY_WEIGHT,
    ),
    aft_conv_row("aft_conv_small_384_11_one_point", 11, 21.98, "appendix: one context point per head", one_point=True),
]

# --- small variants for CPU training (patch 4, 32 px) ---------------------------------------------------------
_rows += [
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

# --- small study rows (docs/studies.md): no re-parameterisation (Table 10), no query (Table 12), no global
# connectivity (§6.3.2), no factorisation (Tables 3, 9), AFT-local windows (Table 5), the appendix's variants -----
_rows += [
    *[
        mini(
            f"aft_conv_{tag}_mini",
            AFT,
            f"AFT {where}",
            mixer=("aft_conv", dict(num_heads=16, kernel_size=5, **switch)),
            **AFT_CONV_MINI,
        )
        for tag, where, switch in (
            ("noreparam", "Table 10, no re-parameterisation", dict(reparam=False)),
            ("noquery", "Table 12, no query term", dict(query=False)),
            ("noglobal", "§6.3.2, w = -inf outside the window", dict(outside="-inf")),
            ("sparse", "appendix, an L1 penalty on the position bias", dict(sparsity=SPARSITY_WEIGHT)),
            ("one_point", "appendix, one context point per head", dict(one_point=True)),
        )
    ],
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

register(*_rows)
