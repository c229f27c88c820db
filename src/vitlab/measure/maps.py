"""What the papers measure inside a ViT, as pure tensor functions (no model, no plotting): the measures of
``vitlab analyze`` and of ``vitlab study`` (DeepViT's cross-layer similarity).

Maps follow the mixers' ``aux["attn"]`` convention: ``A[b, h, i, t]`` is how much output
(query) token i takes from input token t, so row i sums to 1 for softmax attention and
**column** t, ``A[b, h, :, t]``, says how token t contributes to every output token.
External attention's maps (``aux["memory_attn"]``) are ``(B, heads, N, S)`` over S memory slots.

Similarities are averaged with equal weight per image, so a mean over batches weighted by
batch size is the mean over all images.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

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

_EPS = 1e-12  # a zero column / token has cosine 0 with everything instead of 0/0


def _as_float(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _unit_columns(maps: Tensor) -> Tensor:
    """Every column ``maps[..., :, t]`` scaled to unit ℓ2 norm (zero columns stay 0)."""
    maps = _as_float(maps)
    return maps / maps.norm(dim=-2, keepdim=True).clamp_min(_EPS)


def _check_maps(maps: Tensor, what: str, square: bool = False) -> None:
    if not isinstance(maps, Tensor) or maps.dim() != 4:
        shape = tuple(maps.shape) if isinstance(maps, Tensor) else type(maps).__name__
        raise ValueError(f"{what}: expected attention maps of shape (B, H, N, N), got {shape}")
    if square and maps.shape[-1] != maps.shape[-2]:
        raise ValueError(f"{what}: expected square self-attention maps (B, H, N, N), got {tuple(maps.shape)}")


def cross_layer_similarity(maps: Sequence[Tensor] | Tensor) -> Tensor:
    """DeepViT's cross-layer similarity of attention maps (DeepViT §3), averaged: ``(L, L)``.

    ``M^{p,q}_{h,t} = A^p_{h,:,t}ᵀ A^q_{h,:,t} / (‖A^p_{h,:,t}‖ ‖A^q_{h,:,t}‖)``: the cosine between
    the columns of token t (how t contributes to every output token) in layers p and q, for
    head h. Returned: ``M^{p,q}`` averaged over heads h, tokens t and the batch. ``maps`` is a
    list of L maps ``(B, H, N, N)`` of one shape, or a stacked ``(L, B, H, N, N)`` tensor.
    """
    if isinstance(maps, Tensor):
        if maps.dim() != 5:
            raise ValueError(f"cross_layer_similarity: expected (L, B, H, N, N) maps, got {tuple(maps.shape)}")
        maps = list(maps)
    if not maps:
        raise ValueError("cross_layer_similarity: need at least one layer's map")
    for m in maps:
        _check_maps(m, "cross_layer_similarity", square=True)
    shapes = {tuple(m.shape) for m in maps}
    if len(shapes) > 1:
        raise ValueError(f"cross_layer_similarity: every layer's map needs the same shape, got {sorted(shapes)}")
    b, h, _, n = maps[0].shape
    # Σ_i of products of unit columns, summed over (b, h, t) = one Gram matrix of the flattened maps
    u = torch.stack([_unit_columns(m).flatten() for m in maps])
    return (u @ u.T) / (b * h * n)


def adjacent_similarity(sim: Tensor) -> Tensor:
    """``sim[k-1, k]`` for k = 1..L-1: how similar each layer is to the one before it."""
    if sim.dim() != 2 or sim.shape[0] != sim.shape[1]:
        raise ValueError(f"expected a square (L, L) similarity matrix, got {tuple(sim.shape)}")
    return sim.diagonal(offset=1)


def similar_blocks(sim: Tensor, threshold: float = 0.9) -> list[int]:
    """Layers k (row indices of ``sim``) whose attention maps are "similar" to the previous layer's.

    vitlab's reading of the DeepViT README's "#Similar Blocks": layer k >= 1 counts when its
    averaged cross-layer similarity with layer k-1 is **above** ``threshold`` (0.9, the
    paper's "above 90%"). The paper reports similarity above 90% for the blocks after the
    17th of a 32-block ViT, i.e. blocks 18..32: 15 blocks, the README's count for ViT-32.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be a cosine similarity in [0, 1], got {threshold}")
    return [k + 1 for k, s in enumerate(adjacent_similarity(sim).tolist()) if s > threshold]


def similar_block_count(sim: Tensor, threshold: float = 0.9) -> int:
    """The number of "similar blocks" (see :func:`similar_blocks`)."""
    return len(similar_blocks(sim, threshold))


def head_similarity(maps: Tensor) -> Tensor:
    """Similarity between the heads of one block (DeepViT §3, "below 30%"): ``(H, H)``.

    The cross-layer measure with heads in place of layers: ``S_{g,h} = mean_{b,t} cos(A_{g,:,t},
    A_{h,:,t})``, the cosine between the columns of token t in heads g and h. ``maps`` is
    ``(B, H, R, C)``: self-attention ``(B, H, N, N)``, or external attention ``(B, heads, N, S)``,
    whose columns are the memory slots' attention over the tokens.
    """
    _check_maps(maps, "head_similarity")
    u = _unit_columns(maps)
    b, _, _, c = maps.shape
    return torch.einsum("bgrc,bhrc->gh", u, u) / (b * c)


def feature_evolution(tokens: Sequence[Tensor], num_prefix: int = 0) -> Tensor:
    """How much token features change from block to block (Refiner paper Figs. 2 and 4): ``(L - 1,)``.

    Entry k-1 is ``mean_{b,n} cos(X^{k-1}_{b,n}, X^k_{b,n})``: the cosine between the feature of
    token n at the outputs of consecutive blocks k-1 and k, averaged over tokens and images.
    Close to 1 = the block barely changed the features ("slow evolution"). ``tokens``: the L
    block outputs ``(B, N, C)``; the first ``num_prefix`` tokens (class token) are left out.
    """
    if len(tokens) < 2:
        raise ValueError(f"feature_evolution: need the outputs of at least 2 blocks, got {len(tokens)}")
    shapes = {tuple(t.shape) for t in tokens}
    if len(shapes) > 1 or tokens[0].dim() != 3:
        raise ValueError(f"feature_evolution: expected L block outputs (B, N, C) of one shape, got {sorted(shapes)}")
    if not 0 <= num_prefix < tokens[0].shape[1]:
        raise ValueError(f"feature_evolution: num_prefix={num_prefix} leaves no token of N={tokens[0].shape[1]}")
    x = torch.stack([_as_float(t[:, num_prefix:]) for t in tokens])  # (L, B, N, C)
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    return (x[:-1] * x[1:]).sum(-1).mean((1, 2))


def token_maps(x: Tensor, grid: tuple[int, int], num_prefix: int = 0) -> Tensor:
    """Per-channel images of token values: ``(B, N, C) -> (B, C, H, W)`` over the patch grid.

    The first ``num_prefix`` tokens (class token) have no place on the image and are dropped.
    Used for AFT's keys as feature maps (AFT Figs. 9-12).
    """
    if x.dim() != 3:
        raise ValueError(f"token_maps: expected tokens (B, N, C), got {tuple(x.shape)}")
    gh, gw = grid
    if x.shape[1] != num_prefix + gh * gw:
        raise ValueError(
            f"token_maps: a {gh}x{gw} grid with {num_prefix} prefix tokens needs N = {num_prefix + gh * gw}, "
            f"got N = {x.shape[1]}"
        )
    return x[:, num_prefix:].transpose(1, 2).reshape(x.shape[0], x.shape[2], gh, gw)


def query_attention(maps: Tensor, query: int, grid: tuple[int, int], num_prefix: int = 0) -> Tensor:
    """Where one query token looks, per head, as images: ``(B, H, N, N) -> (B, H, gh, gw)``.

    Row ``A[b, h, query, :]`` restricted to the patch tokens (the attention given to prefix
    tokens is left out, so an image need not sum to 1). ``query`` is a position in the
    sequence: 0 is the class token when there is one, ``num_prefix + r * gw + c`` the patch
    in row r, column c.
    """
    _check_maps(maps, "query_attention", square=True)
    n = maps.shape[-1]
    if not 0 <= query < n:
        raise ValueError(f"query_attention: query must be a token position in [0, {n}), got {query}")
    return token_maps(maps[:, :, query].transpose(1, 2), grid, num_prefix)


def slot_maps(maps: Tensor, slots: Sequence[int], grid: tuple[int, int], num_prefix: int = 0) -> Tensor:
    """External attention of the patches to chosen memory slots (EA Fig. 5): ``(B, heads, N, S) ->
    (B, len(slots), heads, gh, gw)``; entry ``[b, j, h]`` is the image of ``A[b, h, :, slots[j]]``."""
    _check_maps(maps, "slot_maps")
    s = maps.shape[-1]
    if not slots or any(not 0 <= j < s for j in slots):
        raise ValueError(f"slot_maps: slots must be memory slots in [0, {s}), got {list(slots)}")
    b, h = maps.shape[:2]
    picked = maps[..., list(slots)].flatten(0, 1)  # (B*heads, N, k)
    img = token_maps(picked, grid, num_prefix)  # (B*heads, k, gh, gw)
    return img.view(b, h, len(slots), *grid).transpose(1, 2)
