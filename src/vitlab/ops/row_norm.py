"""Training BatchNorm on channels-last maps, with per-channel sums that run at memory speed for any channel count.

A channels-last map ``(B, C, N, N)`` is a ``(M, C)`` matrix of rows, M = B·N·N. BatchNorm with the batch's
statistics is, per channel c (paper: Ioffe & Szegedy 2015, Alg. 1 and its gradient)::

    μ = Σ x / M,   σ² = Σ (x − μ)² / M,   r = (σ² + ε)^-½,   y = γ r (x − μ) + β
    dx = γ r (g − Σ g / M − x̂ Σ (g x̂) / M),   dγ = Σ g x̂,   dβ = Σ g,   x̂ = r (x − μ)

All of it is elementwise work plus column sums of (M, C) matrices. PyTorch's CPU BatchNorm for channels-last
inputs vectorises over the channels and runs partly scalar unless C is a multiple of 16: on the refiner's
expanded maps (batch 4, 197 tokens) forward and backward take 22.1 ms at 18 channels and 23.5 ms at 36
(Refined-ViT-S), 2.4 ms at 16 (``benchmarks/row_norm.py``; :func:`rows_pay`). :func:`column_sums` instead sums a
wide view of the rows (several rows side by side, a multiple of 16 floats wide) and folds the copies of each
channel at the end (0.3 ms where ``rows.sum(0)`` takes 1.4 ms at 18 channels). The same wide view (f·C columns,
each one channel of every f-th row) is a matrix PyTorch's BatchNorm kernel handles at full vector width: its
per-column statistics and normalisation in one call (:func:`normalise_rows`, the f columns of a channel then
combined exactly and the result rescaled in place) and its per-column gradient sums Σ g and Σ g x̂ in one pass
(:func:`gradient_sums`), where the plain forms take a pass per product and per sum. The variance is the two-pass
one (sums of squared deviations), as accurate as the mean.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .head_mix_terms import running_momentum, uses_batch_stats
from .switch import fast_paths_enabled

# rows side by side in the wide view: a multiple of 16 values (an AVX-512 vector of fp32) times this factor
_WIDE_VECTORS = 4


def _side_by_side(channels: int) -> int:
    """f, the rows side by side in the wide view: f·C a multiple of 16 values, times :data:`_WIDE_VECTORS`."""
    return 16 // math.gcd(16, channels) * _WIDE_VECTORS


def column_sums(rows: Tensor) -> Tensor:
    """The sums over every axis but the last of ``rows`` (..., C): for contiguous rows through a wide
    (M / f, f·C) view whose columns are the channels of f consecutive rows (the last M mod f rows summed apart),
    any other layout by ``sum``."""
    c = rows.shape[-1]
    if not rows.is_contiguous() or rows.numel() == 0:
        return rows.sum(tuple(range(rows.dim() - 1)))
    rows = rows.view(-1, c)
    f = _side_by_side(c)
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


def _wide(rows: Tensor) -> tuple[int, int] | None:
    """``(f, R)``: the wide view of :func:`column_sums` holds the first R·f rows as an (R, f·C) matrix; None when it
    cannot serve PyTorch's BatchNorm kernel (rows not contiguous, or fewer than 2 rows of it)."""
    f = _side_by_side(rows.shape[-1])
    r = rows.shape[0] // f
    return (f, r) if rows.is_contiguous() and r >= 2 else None


def normalise_rows(
    rows: Tensor, out: Tensor, gamma: Tensor | None, beta: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``out = γ r (x − μ) + β`` for the rows (M, C), written into ``out`` (M, C, contiguous); returns the batch's
    mean μ, biased variance σ² and r = (σ² + ε)^-½ per channel.

    PyTorch's BatchNorm kernel normalises the wide view (R, f·C) by its own per-column statistics (m_j, v_j); the f
    columns of channel c hold R rows each, so μ_c = mean_j m_j + (the rest) and M σ²_c = Σ_j R (v_j + (m_j − μ_c)²)
    + (the rest) exactly (Chan et al.'s pairwise combination); the view is then rescaled in place to the channel's
    statistics: ``γ r (x − μ) + β = ŷ_j · γ r / r_j + (m_j − μ) γ r + β``. The kernel runs with the module's ε (a
    tiny one for ε = 0, so that a constant column stays finite); v_j = r_j^-2 − ε is then exact to a rounding of
    σ² + ε, which is what r depends on."""
    wide = _wide(rows)
    if wide is None:
        mean, var, _ = batch_stats(rows, out)
        rstd = (var + eps).rsqrt()
        scale_rows(out, rstd if gamma is None else gamma * rstd, beta)
        return mean, var, rstd
    (f, r), (m, c) = wide, rows.shape
    main = f * r
    col_eps = eps if eps > 0 else torch.finfo(rows.dtype).tiny
    col_mean, col_rstd = rows.new_empty(f * c), rows.new_empty(f * c)
    out_wide = out[:main].view(r, f * c)
    torch.ops.aten.native_batch_norm.out(
        rows[:main].view(r, f * c), None, None, None, None, True, 0.0, col_eps,
        out=out_wide, save_mean=col_mean, save_invstd=col_rstd,
    )  # fmt: skip
    rest = rows[main:]
    col_mean, col_rstd = col_mean.view(f, c), col_rstd.view(f, c)
    mean = (col_mean.sum(0) * r + rest.sum(0)) / m
    spread = (col_rstd.pow(-2).sub_(col_eps) + (col_mean - mean).square()).sum(0) * r
    var = (spread + (rest - mean).square().sum(0)) / m
    rstd = (var + eps).rsqrt()
    kappa = rstd if gamma is None else gamma * rstd
    shift = (col_mean - mean) * kappa if beta is None else torch.addcmul(beta, col_mean - mean, kappa)
    torch.addcmul(shift.view(-1), out_wide, (kappa / col_rstd).view(-1), out=out_wide)
    if main < m:
        scale_rows(torch.sub(rest, mean, out=out[main:]), kappa, beta)
    return mean, var, rstd


def gradient_sums(rows: Tensor, g: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """``Σ g`` and ``Σ g x̂`` per channel (x̂ = r (x − μ)) for the rows ``rows`` and their gradient ``g`` (M, C): on
    the wide views, PyTorch's BatchNorm backward kernel asked for its parameter gradients only (one pass over both),
    the f columns of each channel then added up; else :func:`column_sums` of g and of g (x − μ)."""
    wide = _wide(rows) if g.is_contiguous() else None
    if wide is None:
        return column_sums(g), column_sums(torch.sub(rows, mean).mul_(g)) * rstd
    (f, r), (_, c) = wide, rows.shape
    main = f * r
    _, col_g_xhat, col_g = torch.ops.aten.native_batch_norm_backward(
        g[:main].view(r, f * c), rows[:main].view(r, f * c), None, None, None,
        mean.repeat(f), rstd.repeat(f), True, 0.0, [False, True, True],
    )  # fmt: skip
    rest, g_rest = rows[main:], g[main:]
    sum_g = col_g.view(f, c).sum(0) + g_rest.sum(0)
    sum_g_xhat = col_g_xhat.view(f, c).sum(0) + (rest - mean).mul_(g_rest).sum(0) * rstd
    return sum_g, sum_g_xhat


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
    AVX-512 and AVX2 alike: 16 channels 2.4 ms against the rows' 4.1, 48 channels 11.3 against 13.6; 18 channels
    22.1 against 5.2, 36 channels 23.5 against 10.7)."""
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
        mean, var, rstd = normalise_rows(maps_as_rows(x), out_rows, gamma, beta, eps)
        ctx.save_for_backward(x, gamma, mean, rstd)
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var

    @staticmethod
    def backward(ctx, grad, _grad_mean, _grad_var):
        x, gamma, mean, rstd = ctx.saved_tensors
        rows, g = maps_as_rows(x), maps_as_rows(grad)
        count = rows.shape[0]
        sum_g, sum_g_xhat = gradient_sums(rows, g, mean, rstd)
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
