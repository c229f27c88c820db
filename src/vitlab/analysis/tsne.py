"""Exact t-SNE (van der Maaten & Hinton 2008) in float64 torch, for the few hundred points of an analysis (TNT's
t-SNE of the feature maps): all ``n²`` pairs, no Barnes-Hut approximation.

* input similarities: ``p_{j|i} = exp(-β_i ‖x_i - x_j‖²) / Σ_{k≠i} exp(-β_i ‖x_i - x_k‖²)`` with ``β_i`` found by
  bisection so that the entropy of ``p_{·|i}`` is ``log(perplexity)`` (nats); ``p_ij = (p_{j|i} + p_{i|j}) / 2n``;
* output similarities (Student t, one degree of freedom): ``q_ij = (1 + ‖y_i - y_j‖²)⁻¹ / Σ_{k≠l} (1 + ‖y_k - y_l‖²)⁻¹``;
* cost ``KL(P ‖ Q) = Σ p_ij log(p_ij / q_ij)``, gradient ``∂C/∂y_i = 4 Σ_j (p_ij - q_ij)(y_i - y_j)(1 + ‖y_i - y_j‖²)⁻¹``,
  descended with momentum (0.5, then 0.8), per-coordinate gains and early exaggeration (P × 12 for the first
  250 steps), as the paper's optimisation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["conditional_probabilities", "joint_probabilities", "kl_gradient", "tsne"]


def _squared_distances(x: Tensor) -> Tensor:
    sq = (x * x).sum(1)
    return (sq[:, None] + sq[None] - 2 * x @ x.T).clamp_min(0.0).fill_diagonal_(0.0)


def conditional_probabilities(x: Tensor, perplexity: float, steps: int = 64) -> Tensor:
    """``p_{j|i}`` (n, n), row i calibrated to the perplexity by bisection on ``log β_i`` (all rows at once)."""
    n = x.shape[0]
    d = _squared_distances(x.double())
    off = ~torch.eye(n, dtype=torch.bool, device=x.device)
    target = math.log(perplexity)
    # log β in [lo, hi]: scaled by the typical distance, the bracket covers every calibration in practice
    scale = d[off].median().clamp_min(1e-12).log()
    lo = torch.full((n, 1), -30.0, dtype=torch.float64, device=x.device) - scale
    hi = torch.full((n, 1), 30.0, dtype=torch.float64, device=x.device) - scale
    for _ in range(steps):
        mid = (lo + hi) / 2
        logits = torch.where(off, -mid.exp() * d, -math.inf)
        p = logits.softmax(1)
        entropy = -(p * torch.where(off, p.clamp_min(1e-300).log(), 0.0)).sum(1, keepdim=True)
        too_flat = entropy > target  # a larger β (narrower kernel) lowers the entropy
        lo, hi = torch.where(too_flat, mid, lo), torch.where(too_flat, hi, mid)
    return torch.where(off, -((lo + hi) / 2).exp() * d, -math.inf).softmax(1)


def joint_probabilities(x: Tensor, perplexity: float) -> Tensor:
    """``p_ij = (p_{j|i} + p_{i|j}) / 2n`` (symmetric, sums to 1)."""
    p = conditional_probabilities(x, perplexity)
    return (p + p.T) / (2 * x.shape[0])


def _student(y: Tensor) -> Tensor:
    """``(1 + ‖y_i - y_j‖²)⁻¹`` with a zero diagonal."""
    return (1.0 / (1.0 + _squared_distances(y))).fill_diagonal_(0.0)


def kl_gradient(p: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """``(KL(P ‖ Q), ∂KL/∂Y)`` at the embedding ``y`` (n, 2) (module docstring)."""
    w = _student(y)
    q = (w / w.sum()).clamp_min(1e-300)
    kl = (p * (p.clamp_min(1e-300) / q).log()).sum()
    coef = (p - q) * w
    grad = 4 * (coef.sum(1, keepdim=True) * y - coef @ y)
    return kl, grad


def tsne(
    x: Tensor,
    perplexity: float = 30.0,
    steps: int = 1000,
    learning_rate: float | None = None,
    exaggeration: float = 12.0,
    exaggerated_steps: int = 250,
    seed: int = 0,
) -> tuple[Tensor, float]:
    """Embed the rows of ``x`` (n, D) in 2-D: returns ``(Y (n, 2), the final KL(P ‖ Q))``.

    ``perplexity`` must be below ``n - 1`` (each point's effective number of neighbours); the learning rate
    defaults to ``max(n / exaggeration, 50)``. Deterministic for a ``seed``.
    """
    n = x.shape[0]
    if x.dim() != 2 or n < 3:
        raise ValueError(f"t-SNE needs at least 3 points as rows (n, D), got {tuple(x.shape)}")
    if not 0 < perplexity < n - 1:
        raise ValueError(f"t-SNE: the perplexity must be in (0, {n - 1}) for {n} points, got {perplexity}")
    p = joint_probabilities(x.double().cpu(), perplexity)
    lr = learning_rate if learning_rate is not None else max(n / exaggeration, 50.0)
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(n, 2, generator=gen, dtype=torch.float64) * 1e-4
    velocity, gains = torch.zeros_like(y), torch.ones_like(y)
    for step in range(steps):
        early = step < exaggerated_steps
        _, grad = kl_gradient(p * exaggeration if early else p, y)
        same_sign = (grad > 0) == (velocity > 0)  # delta-bar-delta gains (the paper's implementation)
        gains = torch.where(same_sign, gains * 0.8, gains + 0.2).clamp_min(0.01)
        velocity = (0.5 if early else 0.8) * velocity - lr * gains * grad
        y = y + velocity
        y = y - y.mean(0)
    kl, _ = kl_gradient(p, y)
    return y, float(kl)
