"""The Lambda baselines of AFT's Table 7 as named models: DeiT backbones with a lambda layer in every block.

As AFT's comparison: |k| = 16, batch-normalised queries and values, relative position lambdas, an output
projection, no class token but DeiT's learned position table, global average pooling: the form whose parameter
count is the paper's 4.8M / 17.7M (the arithmetic: :mod:`vitlab.mixers.lambda_layer`). ``lambda_mini`` is the
small CPU variant (patch 4, 32 px) for ``vitlab compare`` beside ``deit_mini``, ``aft_full_mini`` and
``aft_conv_mini``. Any other baseline mixer goes into any model with ``mixer=`` (docs/models.md).
"""

from __future__ import annotations

from ..registry import register
from ._shared import DEIT_SIZES, MINI, vit

LAMBDA = "Bello 2021, LambdaNetworks: Modeling Long-Range Interactions Without Attention"
# AFT removed DeiT's class token (GAP instead) and kept its learned table: its counts need the table
GAP_TABLE = dict(class_token=False, global_pool="avg", pos_embed="learned")

_rows = []
# top-1 and parameters: AFT paper Table 7 (DeiT training recipe, 224 px); 4.82M / 17.68M here
for size, top1, params in (("tiny", 72.4, 4.8), ("small", 80.0, 17.7)):
    dim, heads = DEIT_SIZES[size]
    _rows.append(
        vit(
            f"lambda_{size}",
            LAMBDA,
            "AFT Table 7: lambda layers on DeiT, |k| = 16, GAP",
            params,
            top1=top1,
            notes=f"AFT Table 7: {top1} top-1, {params}M parameters",
            embed_dim=dim,
            depth=12,
            num_heads=heads,
            **GAP_TABLE,
            mixer=("lambda", dict(key_dim=16, max_distance=13, prefix_embedding=False)),
        )
    )
_rows.append(
    vit(
        "lambda_mini",
        LAMBDA,
        "vitlab: small lambda network (|k| = 16)",
        **MINI,
        **GAP_TABLE,
        mixer=("lambda", dict(key_dim=16, max_distance=7, prefix_embedding=False)),
    )
)
register(*_rows)
