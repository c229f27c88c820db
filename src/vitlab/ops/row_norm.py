"""Training BatchNorm on channels-last maps, with per-channel sums that run at memory speed for any channel count.

A channels-last map ``(B, C, N, N)`` is a ``(M, C)`` matrix of rows, M = B·N·N. BatchNorm with the batch's
statistics is, per channel c (paper: Ioffe & Szegedy 2015, Alg. 1 and its gradient)::

    μ = Σ x / M,   σ² = Σ (x − μ)² / M,   r = (σ² + ε)^-½,   y = γ r (x − μ) + β
    dx = γ r (g − Σ g / M − x̂ Σ (g x̂) / M),   dγ = Σ g x̂,   dβ = Σ g,   x̂ = r (x − μ)

All of it is elementwise work plus column sums of (M, C) matrices. PyTorch's CPU BatchNorm for channels-last
inputs vectorises over the channels and runs partly scalar unless C is a multiple of 16: on the refiner's
expanded maps (batch 4, 197 tokens) forward and backward take 23.2 ms at 18 channels and 26.0 ms at 36
(Refined-ViT-S), 2.6 ms at 16 (``benchmarks/row_norm.py``; :func:`rows_pay`). :func:`column_sums` instead sums a
wide view of the rows (several rows side by side, a multiple of 16 floats wide) and folds the copies of each
channel at the end (0.3 ms where ``rows.sum(0)`` takes 1.4 ms at 18 channels). The variance is the two-pass one
(sums of squared deviations), as accurate as the mean.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .head_mix_terms import running_momentum, uses_batch_stats
from .switch import fast_paths_enabled

# rows side by side in the wide view: a multiple of 16 values (an AVX-512 vector of fp32) times this factor
_WIDE_VECTORS = 4


def column_sums(rows: Tensor) -> Tensor:
    """The sums over every axis but the last of ``rows`` (..., C): for contiguous rows through a wide
    (M / f, f·C) view whose columns are the channels of f consecutive rows (the last M mod f rows summed apart),
    any other layout by ``sum``."""
    c = rows.shape[-1]
    if not rows.is_contiguous() or rows.numel() == 0:
        return rows.sum(tuple(range(rows.dim() - 1)))
    rows = rows.view(-1, c)
    f = 16 // math.gcd(16, c) * _WIDE_VECTORS
    main = rows.shape[0] - rows.shape[0] % f
    if main == 0:
        return rows.sum(0)
    sums = rows[:main].view(main // f, f * c).sum(0).view(f, c).sum(0)
    return sums + rows[main:].sum(0) if main < rows.shape[0] else sums


def maps_as_rows(maps: Tensor) -> Tensor:
    """Maps (B, C, H, W) as (B·H·W, C) rows: a view for channels-last maps, a copy otherwise."""
    return maps.permute(0, 2, 3, 1).reshape(-1, maps.shape[1])


def new_maps(like: Tensor, channels: int | None = None) -> tuple[Tensor, Tensor]:
    """A new channels-last tensor shaped as the maps ``like`` (B, C, H, W) (``channels`` instead of C) and its
    (B·H·W, C) rows view. A result written through the view is returned as the tensor itself: autograd lets the
    caller modify it in place, which it refuses for a view made inside an autograd Function."""
    b, c, h, w = like.shape
    maps = torch.empty(
        (b, channels or c, h, w), dtype=like.dtype, device=like.device, memory_format=torch.channels_last
    )
    return maps, maps_as_rows(maps)


def batch_stats(rows: Tensor, centred: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-channel mean and biased variance of ``rows`` (M, C), and the centred rows ``x − μ`` (written into
    ``centred`` when given, else a new tensor)."""
    mean = column_sums(rows) / rows.shape[0]
    centred = torch.sub(rows, mean, out=centred) if centred is not None else rows - mean
    return mean, column_sums(centred * centred) / rows.shape[0], centred


def scale_rows(rows: Tensor, scale: Tensor, shift: Tensor | None) -> Tensor:
    """``rows · scale + shift`` in place (one pass: ``addcmul`` writing over its own input)."""
    return rows.mul_(scale) if shift is None else torch.addcmul(shift, rows, scale, out=rows)


def update_running(
    running_mean: Tensor | None, running_var: Tensor | None, mean: Tensor, var: Tensor, count: int, momentum: float
) -> None:
    """The running statistics as ``nn.BatchNorm`` updates them: this call's factor, the unbiased variance."""
    if running_mean is None or running_var is None:
        return
    with torch.no_grad():
        running_mean.lerp_(mean.to(running_mean.dtype), momentum)
        running_var.lerp_((var * (count / max(count - 1, 1))).to(running_var.dtype), momentum)


def rows_pay(channels: int) -> bool:
    """Whether the rows beat PyTorch's channels-last kernel at this channel count: not at multiples of 16, where
    that kernel is fully vectorised (``benchmarks/row_norm.py``, batch 4 of 197 x 197 maps, forward + backward,
    AVX-512 and AVX2 alike: 16 channels 2.6 ms against the rows' 6.6, 48 channels 13.9 against 23.6; 18 channels
    23.2 against 8.4, 36 channels 26.0 against 17.7)."""
    return channels % 16 != 0


def can_normalise_rows(x: Tensor, bn: nn.modules.batchnorm._BatchNorm) -> bool:
    """Whether :func:`batch_norm_rows` applies: the fast paths on, batch statistics, CPU maps (B, C, H, W) in the
    channels-last layout (and not also standard: C or H·W of 1) with a channel count where the rows pay
    (:func:`rows_pay`), fp32/fp64 outside autocast."""
    return (
        fast_paths_enabled()
        and uses_batch_stats(bn)
        and x.dim() == 4
        and rows_pay(x.shape[1])
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float64)
        and x.is_contiguous(memory_format=torch.channels_last)
        and not x.is_contiguous()
        and not torch.is_autocast_enabled("cpu")
    )


class _BatchNormRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, eps):
        out, out_rows = new_maps(x)
        mean, var, _ = batch_stats(maps_as_rows(x), out_rows)
        rstd = (var + eps).rsqrt()
        scale_rows(out_rows, rstd if gamma is None else gamma * rstd, beta)
        ctx.save_for_backward(x, gamma, mean, rstd)
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var

    @staticmethod
    def backward(ctx, grad, _grad_mean, _grad_var):
        x, gamma, mean, rstd = ctx.saved_tensors
        rows, g = maps_as_rows(x), maps_as_rows(grad)
        count = rows.shape[0]
        sum_g = column_sums(g)
        sum_g_xhat = column_sums(torch.sub(rows, mean).mul_(g)) * rstd  # Σ g x̂, from the centred rows
        kappa = rstd if gamma is None else gamma * rstd
        grad_x = None
        if ctx.needs_input_grad[0]:
            slope = kappa * rstd * sum_g_xhat / count  # dx = κ g − slope (x − μ) − κ Σg / M
            shift = slope * mean - kappa * sum_g / count
            grad_x, grad_rows = new_maps(x)
            torch.addcmul(shift, g, kappa, out=grad_rows).addcmul_(rows, slope, value=-1)
        grad_gamma = sum_g_xhat if gamma is not None and ctx.needs_input_grad[1] else None
        grad_beta = sum_g if ctx.needs_input_grad[2] else None
        return grad_x, grad_gamma, grad_beta, None


def batch_norm_rows(x: Tensor, bn: nn.modules.batchnorm._BatchNorm) -> Tensor:
    """``bn(x)`` for channels-last maps with the batch's statistics (:func:`can_normalise_rows`): the same values,
    running statistics and batch count as the module, computed on the maps' rows (this module's docstring). The
    result is channels-last, as the module's."""
    if x.numel() == x.shape[1]:  # the module's own check: one value per channel has no batch statistics
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.shape}")
    momentum = running_momentum(bn)
    out, mean, var = _BatchNormRows.apply(x, bn.weight, bn.bias, bn.eps)
    if bn.track_running_stats:
        update_running(bn.running_mean, bn.running_var, mean, var, out.numel() // out.shape[1], momentum)
    return out
