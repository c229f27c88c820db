"""The measures of the analyses, kept in :mod:`vitlab.measure.maps` (a service, so that ``vitlab study`` shares
them); the same functions under this module's name."""

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

__all__ = [
    "adjacent_similarity",
    "cross_layer_similarity",
    "feature_evolution",
    "head_similarity",
    "query_attention",
    "similar_block_count",
    "similar_blocks",
    "slot_maps",
    "token_maps",
]
