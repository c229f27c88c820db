"""Sampling and grouping for PCT's neighbour embedding (Guo et al. 2021, §3.4): farthest-point sampling, k nearest
neighbours, and the grouped features an SG (sample-and-group) layer reads.

Farthest-point sampling of ``M`` of the ``N`` points ``p_1..p_N`` (:func:`farthest_point_sample`)::

    s_1 = 1                                     (the first point: deterministic, see below)
    d_j = min_{t < i} |p_j - p_{s_t}|^2         (each point's squared distance to the chosen set)
    s_i = argmax_j d_j                          (ties: the lowest index)

The start is the first point, as the CUDA kernel the reference code calls (PointNet++'s ``furthest_point_sample``)
starts; the plain PyTorch port of PointNet++ starts from a random point instead, which makes a model's output
random at evaluation. That kernel also skips points within 0.032 of the origin (``|p|^2 <= 1e-3``) as padding;
here every point is a candidate. The loop runs ``M - 1`` steps of ``O(N)`` tensor work over the whole batch.

k nearest neighbours (:func:`knn`): ``torch.cdist`` over the coordinates (its exact difference form, not the
``|a|^2 + |b|^2 - 2ab`` matrix product, so near ties resolve as the direct distances do) and the ``k`` smallest
by ``topk``, nearest first; a centre drawn from the points finds itself first (distance 0).

Grouping (:func:`group`) for centre ``c`` with neighbours ``n_1..n_k`` and features ``f``::

    g_{c, t} = [f_{n_t} - f_c, f_c]             (B, S, k, 2C)
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_xyz(xyz: Tensor, what: str) -> None:
    if xyz.dim() != 3 or xyz.shape[-1] != 3:
        raise ValueError(f"{what}: expected coordinates (B, N, 3), got {tuple(xyz.shape)}")


def gather_points(x: Tensor, idx: Tensor) -> Tensor:
    """``x[b, idx[b, ...]]``: rows of ``x (B, N, C)`` picked by ``idx (B, ...)`` -> ``(B, ..., C)``."""
    if x.dim() != 3 or idx.dim() < 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(f"gather_points: expected x (B, N, C) and idx (B, ...), got {tuple(x.shape)}, "
                         f"{tuple(idx.shape)}")  # fmt: skip
    flat = idx.reshape(idx.shape[0], -1)
    out = x.gather(1, flat[..., None].expand(-1, -1, x.shape[-1]))
    return out.reshape(*idx.shape, x.shape[-1])


@torch.no_grad()
def farthest_point_sample(xyz: Tensor, m: int) -> Tensor:
    """Indices ``(B, m)`` of ``m`` farthest points of ``xyz (B, N, 3)``, from the first point (module docstring).
    Distances are taken in float32 at least (a half-precision batch under autocast keeps exact sampling)."""
    check_xyz(xyz, "farthest_point_sample")
    b, n, _ = xyz.shape
    if not 1 <= m <= n:
        raise ValueError(f"farthest_point_sample: cannot take {m} of {n} points")
    pts = xyz.float() if xyz.dtype in (torch.float16, torch.bfloat16) else xyz
    idx = torch.zeros(b, m, dtype=torch.long, device=xyz.device)
    dist = torch.full((b, n), torch.inf, dtype=pts.dtype, device=xyz.device)
    rows = torch.arange(b, device=xyz.device)
    last = idx[:, 0]
    for i in range(1, m):
        d = ((pts - pts[rows, last][:, None]) ** 2).sum(-1)
        dist = torch.minimum(dist, d)
        last = dist.argmax(1)  # the first of equal maxima, as the naive loop's strict ">" picks
        idx[:, i] = last
    return idx


@torch.no_grad()
def knn(query: Tensor, xyz: Tensor, k: int) -> Tensor:
    """Indices ``(B, S, k)`` of the ``k`` points of ``xyz (B, N, 3)`` nearest to each of ``query (B, S, 3)``,
    nearest first (equal distances in no promised order)."""
    check_xyz(query, "knn")
    check_xyz(xyz, "knn")
    if query.shape[0] != xyz.shape[0]:
        raise ValueError(f"knn: {query.shape[0]} query sets for {xyz.shape[0]} point sets")
    if not 1 <= k <= xyz.shape[1]:
        raise ValueError(f"knn: cannot take {k} neighbours of {xyz.shape[1]} points")
    q, p = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (query, xyz))
    dist = torch.cdist(q, p, compute_mode="donot_use_mm_for_euclid_dist")
    return dist.topk(k, dim=-1, largest=False, sorted=True).indices


def group(feats: Tensor, centres: Tensor, neighbours: Tensor) -> Tensor:
    """``[f_n - f_c, f_c]`` (module docstring): ``feats (B, N, C)``, ``centres (B, S)`` and ``neighbours
    (B, S, k)`` indices into the N points -> ``(B, S, k, 2C)``."""
    centre = gather_points(feats, centres)[:, :, None]  # (B, S, 1, C)
    nbr = gather_points(feats, neighbours)  # (B, S, k, C)
    return torch.cat([nbr - centre, centre.expand_as(nbr)], -1)


def sample_and_group(xyz: Tensor, feats: Tensor, samples: int, k: int) -> tuple[Tensor, Tensor]:
    """One SG layer's inputs: ``samples`` centres by farthest-point sampling of ``xyz (B, N, 3)``, each with its
    ``k`` nearest points -> (the centres' coordinates ``(B, samples, 3)``, grouped features
    ``(B, samples, k, 2C)`` of ``feats (B, N, C)``)."""
    if feats.shape[:2] != xyz.shape[:2]:
        raise ValueError(f"sample_and_group: {tuple(feats.shape[:2])} features for {tuple(xyz.shape[:2])} points")
    centres = farthest_point_sample(xyz, samples)
    new_xyz = gather_points(xyz, centres)
    return new_xyz, group(feats, centres, knn(new_xyz, xyz, k))
