"""Looking inside models: attention maps, attention collapse, head similarity, feature evolution, AFT biases
and keys, external attention maps, TNT's feature maps, t-SNE and pixel-level attention.

:func:`analyze` runs the analyses (:data:`ANALYSES`) on a model and writes their numbers (JSON) and figures
(PNG); :func:`load_images` prepares its input; the metrics are pure tensor functions (:mod:`vitlab.measure.maps`).
``vitlab analyze`` is the command line over this (:mod:`vitlab.cli.analyze`).
"""

from ..measure.maps import (
    adjacent_similarity,
    cross_layer_similarity,
    feature_evolution,
    head_similarity,
    query_attention,
    similar_block_count,
    similar_blocks,
    slot_maps,
    token_maps,
)
from .analyses import ANALYSES, analyze, parse_what
from .inputs import load_images

__all__ = [
    "ANALYSES",
    "adjacent_similarity",
    "analyze",
    "cross_layer_similarity",
    "feature_evolution",
    "head_similarity",
    "load_images",
    "parse_what",
    "query_attention",
    "similar_block_count",
    "similar_blocks",
    "slot_maps",
    "token_maps",
]
