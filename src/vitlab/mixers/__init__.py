"""Token mixers: one module per method, all ``(B, N, C) -> (B, N, C)``.

``build(kind, dim, **kw)`` constructs any of them by name, which is how model
configs choose a mixer per block.
"""

from __future__ import annotations

import inspect

from ..common.registry import check_options, unknown_name_error
from .aft import AFTConv, AFTFull, AFTLocal, AFTSimple
from .attention import Attention, attention_map
from .attention_variants import (
    DoubleNormAttention,
    DropAttention,
    PEGQKAttention,
    RelPos2dAttention,
    TemperatureAttention,
)
from .base import TokenLayout, TokenMixer
from .external import ExternalAttention, MultiHeadExternalAttention
from .lambda_layer import LambdaLayer
from .linear_attention import LinearAttention, Performer
from .lsh_attention import LSHAttention
from .reattention import ReAttention
from .refiner import DistributedLocalAttention, RefinerAttention
from .sparse_attention import LocalAttention2d, SparseAttention
from .spatial_reduction import SpatialReductionAttention
from .synthesizer import Synthesizer

MIXERS: dict[str, type[TokenMixer]] = {
    "attention": Attention,
    "refiner": RefinerAttention,
    "reattention": ReAttention,
    "external": ExternalAttention,
    "external_mh": MultiHeadExternalAttention,
    "aft_full": AFTFull,
    "aft_local": AFTLocal,
    "aft_simple": AFTSimple,
    "aft_conv": AFTConv,
}
#: further kinds ``build`` knows: the alternatives the papers' ablations compare against (docs/semantics.md,
#: Decisions C2, D3, E3) and the attention of Twins' pyramid. Not in :data:`MIXERS`, the methods' own mixers that
#: the mixer benchmark sweeps.
EXTRA_MIXERS: dict[str, type[TokenMixer]] = {
    "attention_temperature": TemperatureAttention,
    "attention_dropmap": DropAttention,
    "attention_double_norm": DoubleNormAttention,
    "attention_rpe2d": RelPos2dAttention,
    "attention_peg_qk": PEGQKAttention,
    # Twins PCPVT / CPVT-v2: keys and values from a spatially reduced grid
    "sr_attention": SpatialReductionAttention,
}
#: the efficient-attention baselines AFT's tables compare against (docs/models.md, "Baselines of the AFT paper");
#: ``local_attention`` / ``strided_attention`` are :class:`SparseAttention` with its pattern preset
#: (``local2d_attention``: the Image Transformer's 2-D blocks, :class:`LocalAttention2d`), and
#: ``synthesizer_dense`` / ``synthesizer_random`` :class:`Synthesizer` with its kind preset.
BASELINE_MIXERS: dict[str, type[TokenMixer]] = {
    "linear_attention": LinearAttention,
    "performer": Performer,
    "synthesizer_dense": Synthesizer,
    "synthesizer_random": Synthesizer,
    "local_attention": SparseAttention,
    "strided_attention": SparseAttention,
    "local2d_attention": LocalAttention2d,
    "lsh_attention": LSHAttention,
    "lambda": LambdaLayer,
}
#: the option each preset kind fixes
PRESETS: dict[str, dict[str, str]] = {
    "synthesizer_dense": {"synthesizer": "dense"},
    "synthesizer_random": {"synthesizer": "random"},
    "local_attention": {"pattern": "local"},
    "strided_attention": {"pattern": "strided"},
}


def build(kind: str, dim: int, *, defaults: dict | None = None, **kw) -> TokenMixer:
    """Build the token mixer ``kind`` of width ``dim``; ``kw`` go to its constructor.

    ``defaults`` are model-wide settings (num_heads, qkv_bias, max_len, ...) given
    only to mixers whose constructor takes them, so one model config can place
    any mixer in any block. ``external`` is the paper's single-head Algorithm 1
    whatever the model's head count (a model-wide ``num_heads`` default is not
    applied to it); an explicit ``num_heads > 1`` builds the official multi-head
    external attention (:class:`MultiHeadExternalAttention`).
    """
    kinds = {**MIXERS, **EXTRA_MIXERS, **BASELINE_MIXERS}
    if kind not in kinds:
        raise unknown_name_error("mixer kind", kind, kinds)
    cls = kinds[kind]
    preset = PRESETS.get(kind, {})
    for key, value in preset.items():
        if kw.get(key, value) != value:
            raise ValueError(f"mixer {kind!r} is {key}={value!r}; for {key}={kw[key]!r} use its own kind")
    if kind == "external" and kw.get("num_heads", 1) > 1:
        cls = MultiHeadExternalAttention
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "dim")]
    if cls is ExternalAttention:  # single-head by definition: the model's head count is not its own
        accepted.remove("num_heads")
    kw = {**{k: v for k, v in (defaults or {}).items() if k in accepted}, **kw}
    check_options(f"mixer {kind!r}", kw, cls)
    return cls(dim, **{**kw, **preset})


__all__ = [
    "BASELINE_MIXERS",
    "EXTRA_MIXERS",
    "MIXERS",
    "AFTConv",
    "AFTFull",
    "AFTLocal",
    "AFTSimple",
    "Attention",
    "DistributedLocalAttention",
    "DoubleNormAttention",
    "DropAttention",
    "ExternalAttention",
    "LSHAttention",
    "LambdaLayer",
    "LinearAttention",
    "LocalAttention2d",
    "MultiHeadExternalAttention",
    "PEGQKAttention",
    "Performer",
    "ReAttention",
    "RefinerAttention",
    "RelPos2dAttention",
    "SparseAttention",
    "SpatialReductionAttention",
    "Synthesizer",
    "TemperatureAttention",
    "TokenLayout",
    "TokenMixer",
    "attention_map",
    "build",
]
