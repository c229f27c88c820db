"""Building blocks shared by the models: embeddings, position encodings, MLP, DropPath, the block."""

from .block import Block
from .drop import DropPath, drop_path
from .mlp import LayerScale, Mlp
from .patch_embed import PatchEmbed
from .pos_embed import PositionEncodingGenerator, resample_pos_embed, sincos_2d, sinusoid_1d

__all__ = [
    "Block",
    "DropPath",
    "LayerScale",
    "Mlp",
    "PatchEmbed",
    "PositionEncodingGenerator",
    "drop_path",
    "resample_pos_embed",
    "sincos_2d",
    "sinusoid_1d",
]
