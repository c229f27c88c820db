"""Looking inside models: attention maps, attention collapse, head similarity, feature evolution, AFT biases
and keys, external attention maps (``vitlab analyze``). Metrics are pure tensor functions in :mod:`.metrics`."""

from .metrics import (
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
