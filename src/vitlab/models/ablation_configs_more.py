"""More ablation rows as named configurations (docs/studies.md): CPVT's learned position table before every block,
AFT-conv with a sparsity penalty on its position bias and AFT-conv with one context point per head (the AFT paper's
appendix). Each at paper size and as a small ``*_mini`` row (the family's mini with the one switch).
"""

from __future__ import annotations

from typing import Any

from .ablation_configs import AFT_CONV_MINI, AFT_CONV_SMALL, mini
from .configs import AFT, CPVT, DEIT_SIZES, vit
from .registry import ModelConfig, register

#: the sparsity penalty's weight of the rows below (the paper gives none; docs/studies.md)
SPARSITY_WEIGHT = 1e-2

dim, heads = DEIT_SIZES["tiny"]
_rows: list[ModelConfig] = [
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
    mini(
        "deit_pe_every_block_mini",
        CPVT,
        "CPVT, a learned position table before every block",
        pos_embed_every_block=True,
    ),
]


def aft_conv_row(name: str, k: int, params: float, what: str, **opts: Any) -> ModelConfig:
    """AFT-conv small with 384 heads and a k x k kernel, with mixer options ``opts``."""
    return vit(
        name,
        AFT,
        f"AFT paper appendix: {what} (AFT-conv small, 384 heads, kernel {k})",
        params,
        mixer=("aft_conv", dict(num_heads=384, kernel_size=k, **opts)),
        **AFT_CONV_SMALL,
    )


_rows += [
    aft_conv_row(
        "aft_conv_small_384_11_sparse", 11, 22.54, "an L1 penalty on the position bias", sparsity=SPARSITY_WEIGHT
    ),
    aft_conv_row("aft_conv_small_384_11_one_point", 11, 21.98, "one context point per head", one_point=True),
    mini(
        "aft_conv_sparse_mini",
        AFT,
        "AFT appendix, an L1 penalty on the position bias",
        mixer=("aft_conv", dict(num_heads=16, kernel_size=5, sparsity=SPARSITY_WEIGHT)),
        **AFT_CONV_MINI,
    ),
    mini(
        "aft_conv_one_point_mini",
        AFT,
        "AFT appendix, one context point per head",
        mixer=("aft_conv", dict(num_heads=16, kernel_size=5, one_point=True)),
        **AFT_CONV_MINI,
    ),
]

register(*_rows)
