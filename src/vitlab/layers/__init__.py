"""Building blocks shared by the models: embeddings, position encodings, MLP, DropPath, the block, and EANet's
external-attention module for CNN feature maps."""

from .block import Block, TokenBatchNorm
from .drop import DropPath, drop_path
from .external import ExternalAttentionConv
from .mlp import LayerScale, Mlp
from .patch_embed import PatchEmbed
from .pos_embed import PositionEncodingGenerator, resample_pos_embed, sincos_2d, sinusoid_1d

__all__ = [
    "Block",
    "DropPath",
    "ExternalAttentionConv",
    "LayerScale",
    "Mlp",
    "PatchEmbed",
    "PositionEncodingGenerator",
    "TokenBatchNorm",
    "drop_path",
    "resample_pos_embed",
    "sincos_2d",
    "sinusoid_1d",
]
