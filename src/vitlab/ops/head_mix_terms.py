"""What the two forms of the head mix + training BatchNorm share: the maps' heads-last view, the running-statistics
factor, and the per-channel terms of the backward pass (:mod:`.head_mix_norm` derives them; :mod:`.head_mix_norm`
and :mod:`.triton_head_mix` both use them)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn


def token_rows(maps: Tensor) -> Tensor:
    """Maps (B, C, N, N) as a (B, N·N, C) view (no copy for the standard layout or channels-last): every head
    mix below is a batched product on this view, with the transposes passed to BLAS rather than copied."""
    b, c, n, m = maps.shape
    return maps.permute(0, 2, 3, 1).reshape(b, n * m, c)


def uses_batch_stats(bn: nn.modules.batchnorm._BatchNorm) -> bool:
    """Whether ``bn`` normalises with the batch's statistics (training, or no running statistics)."""
    return bn.training or bn.running_mean is None


def running_momentum(bn: nn.modules.batchnorm._BatchNorm) -> float:
    """The running-statistics factor of this call, as ``nn.BatchNorm`` computes it (counting the batch)."""
    if not (bn.training and bn.track_running_stats and bn.num_batches_tracked is not None):
        return 0.0 if bn.momentum is None else bn.momentum
    bn.num_batches_tracked.add_(1)
    return 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum


def function_args(
    attn: Tensor, mix: nn.Conv2d, bn: nn.modules.batchnorm._BatchNorm, scale: float, heads_last: bool
) -> tuple:
    """The arguments both autograd Functions take, in their order: the maps, the mix's weight (G, H) and bias,
    BatchNorm's affine parameters, running statistics (None where it keeps none), this call's momentum, eps, the
    output scale and the output layout. Counts the batch in ``bn`` (:func:`running_momentum`)."""
    tracked = bn.track_running_stats
    return (
        attn,
        mix.weight[:, :, 0, 0],
        mix.bias,
        bn.weight,
        bn.bias,
        bn.running_mean if tracked else None,
        bn.running_var if tracked else None,
        running_momentum(bn),
        bn.eps,
        float(scale),
        heads_last,
    )


class BatchNormTerms(NamedTuple):
    """The per-channel terms of the backward pass of ``c · BN(W A + b)``: ``κ = c γ r``,
    ``slope = κ r m₂``, ``shift = slope μ − κ m₁``, with the output gradient's sum ``s`` and mean of ``g ⊙ x̂``
    ``m₂``, derived in :mod:`.head_mix_norm`."""

    kappa: Tensor
    slope: Tensor
    shift: Tensor
    s: Tensor
    m2: Tensor

    @staticmethod
    def of(weight: Tensor, w_eff: Tensor, mean: Tensor, rstd: Tensor, s: Tensor, p: Tensor, count: int):
        """From ``s = Σ g`` (G,) and ``P = Σ g Aᵀ`` (G, H) over the ``count`` map elements per channel."""
        m1 = s / count
        m2 = rstd * ((weight * p).sum(1) - mean * s) / count  # mean of g·x̂ (mean: of W A)
        kappa = w_eff * rstd
        slope = kappa * rstd * m2  # dY = κ g − slope ⊙ (W A) + shift
        return BatchNormTerms(kappa, slope, slope * mean - kappa * m1, s, m2)

    def input_grad_mix(self, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``dA = on_g g − on_a A + const`` per map element: (H, G), (H, H) and (H,)."""
        wt = weight.t()
        return wt * self.kappa, (wt * self.slope) @ weight, wt @ self.shift

    def weight_grad(self, weight: Tensor, p: Tensor, q: Tensor, sum_a: Tensor) -> Tensor:
        """``dW = diag(κ) P − diag(slope) W Q + shift ⊗ Σ A`` with ``Q = Σ A Aᵀ`` (H, H)."""
        return self.kappa[:, None] * p - self.slope[:, None] * (weight @ q) + self.shift[:, None] * sum_a

    def affine_grads(self, has: tuple[bool, bool, bool], needs: tuple[bool, ...], scale: float, count: int):
        """The gradients of the mix bias (0: the batch mean cancels it), of γ (``c M m₂``) and of β (``c s``)."""
        has_bias, has_gamma, has_beta = has
        grad_bias = torch.zeros_like(self.s) if has_bias and needs[2] else None
        grad_gamma = scale * count * self.m2 if has_gamma and needs[3] else None
        grad_beta = scale * self.s if has_beta and needs[4] else None
        return grad_bias, grad_gamma, grad_beta
