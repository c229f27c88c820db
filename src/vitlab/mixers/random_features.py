"""The random draws of the randomised baselines: FAVOR+ features (Performer) and random rotations (Reformer).

Every draw comes from a ``torch.Generator`` seeded by a seed the module keeps in a buffer plus a draw count,
never from the global random state, so that all processes of a distributed run and a resumed run draw the same.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def redraw_due(forwards: int, every: int) -> bool:
    """Whether training forward number ``forwards`` (0-based) starts with a new draw (every ``every``; 0: never)."""
    return every > 0 and forwards % every == 0


def advance_draw(module: torch.nn.Module, drawn: Tensor) -> None:
    """One training forward of a module whose randomness is redrawn (its ``forwards`` buffer, ``redraw_every``
    and ``draw(count)``): the draw of number ``forwards // redraw_every`` copied into ``drawn`` when
    :func:`redraw_due`, then the forward counted."""
    forwards = int(module.forwards)  # read once: on a GPU each read waits for the device
    if redraw_due(forwards, module.redraw_every):
        drawn.copy_(module.draw(forwards // module.redraw_every))
    module.forwards += 1


def orthogonal_gaussian(m: int, d: int, generator: torch.Generator) -> Tensor:
    """``m`` random directions in R^d (m, d), orthogonal within each block of d (Performer, §2.4 ORF): the rows of
    Q from the QR decomposition of a Gaussian d x d matrix, each scaled to the norm of a Gaussian d-vector, so that
    every row has the marginal distribution of a Gaussian vector. Q's columns take the signs of R's diagonal: only
    then is Q uniformly (Haar) distributed, and the FAVOR+ estimate unbiased."""
    gaussian = torch.randn(math.ceil(m / d), d, d, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)  # one decomposition per block of d directions
    rows = (q * torch.diagonal(r, dim1=-2, dim2=-1).sign().unsqueeze(-2)).transpose(-2, -1).reshape(-1, d)[:m]
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (rows * norms).float()


def favor_features(x: Tensor, projection: Tensor) -> tuple[Tensor, Tensor]:
    """FAVOR+ positive random features of queries or keys x (B, H, N, d) for directions ``projection`` (m, d).

    ``φ(x) = exp(ω·x̃ - |x̃|²/2) / √m`` with x̃ = x / d^(1/4), so that ``E[φ(q)·φ(k)] = exp(q·k/√d)`` (Performer,
    Lemma 1). Returned as ``φ(x) · exp(-c)`` with the log-scale c (B, H, N), the largest exponent of each row:
    a query's cancels in its own ratio; the keys' are handed to :func:`~vitlab.mixers.linear_attention.
    linear_attention`, which brings them to a common scale."""
    d = x.shape[-1]
    xs = x * d**-0.25
    logits = xs @ projection.T - (xs * xs).sum(-1, keepdim=True) / 2
    shift = logits.detach().amax(-1, keepdim=True)
    return (logits - shift).exp() / math.sqrt(projection.shape[0]), shift[..., 0]


def random_rotations(d: int, buckets: int, rounds: int, generator: torch.Generator) -> Tensor:
    """Random rotations of Reformer's angular LSH: a Gaussian (rounds, d, buckets / 2) matrix (§2, Eq. 4)."""
    return torch.randn(rounds, d, buckets // 2, generator=generator)


__all__ = ["advance_draw", "favor_features", "orthogonal_gaussian", "random_rotations", "redraw_due"]
