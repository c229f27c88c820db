"""The head mix + training BatchNorm ``c · BN(W A + b)`` of re-attention and the refiner as two Triton passes each way.

:mod:`.head_mix_norm` derives the backward pass from a few per-channel sums. The same algebra gives the forward
pass without the mixed maps ``Y = W A + b``: the BatchNorm's batch statistics of ``Y`` follow from the first two
moments of the maps ``A`` (H heads, M = B·N·N elements per head),

    μ_g = (W ΣA)_g / M + b_g,    σ²_g = (W Q Wᵀ)_gg / M − (μ_g − b_g)²,    Q = Σ A Aᵀ (H, H),

and the output is one affine head mix ``out = W' A + c'`` with ``W' = diag(c γ r) W``, ``c' = c (β − γ r (μ − b))``,
``r = (σ² + eps)^-½``. So the forward pass reads the maps twice (:func:`_moments_kernel` for ``ΣA, Q``, then
:func:`_mix_kernel` writes the output once, in the input's dtype, in the layout asked for) and stores no fp32
intermediate. The backward pass is the same two kernels: ``Σ g, P = Σ g Aᵀ`` (moments of the output gradient
against the maps), then ``dA = on_g g − on_a A + const`` (one mix of two inputs). ``Q`` and ``ΣA`` are kept from the
forward pass for the weight's gradient. Every product and sum accumulates in fp32 (``tl.dot`` in IEEE fp32, no
TF32); the moments of the per-program partial sums are combined, and the variance formed, in fp64, so the
difference of the two moments loses no more than fp32 rounding of each partial sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from .head_mix_terms import BatchNormTerms, function_args, token_rows
from .triton_support import launch

_BLOCK_L = 64  # map elements (rows of the heads-last view) per tile
_MAX_PROGRAMS = 1024  # programs of a moments pass: the partial sums stay small (programs x C1 x C2 floats)


def _channels_block(c: int) -> int:
    return max(16, triton.next_power_of_2(c))  # tl.dot needs 16 along every axis


@triton.jit
def _moments_kernel(
    x_ptr, z_ptr, xz_ptr, sx_ptr, L, C1, C2, sxb, sxl, sxc, szb, szl, szc, SPLIT,
    BLOCK_L: tl.constexpr, BC1: tl.constexpr, BC2: tl.constexpr,
):  # fmt: skip
    """Partial ``Σ x zᵀ`` (C1, C2) and ``Σ x`` (C1) of one batch element's rows ``split, split + SPLIT, ...``."""
    b, split = tl.program_id(0), tl.program_id(1)
    c1, c2 = tl.arange(0, BC1), tl.arange(0, BC2)
    rows0 = tl.arange(0, BLOCK_L)
    acc = tl.zeros((BC1, BC2), tl.float32)
    sx = tl.zeros((BC1,), tl.float32)
    for start in range(split * BLOCK_L, L, SPLIT * BLOCK_L):
        rows = start + rows0
        ok = rows < L
        x = tl.load(
            x_ptr + b * sxb + rows[:, None] * sxl + c1[None, :] * sxc, mask=ok[:, None] & (c1 < C1)[None, :], other=0.0
        ).to(tl.float32)
        z = tl.load(
            z_ptr + b * szb + rows[:, None] * szl + c2[None, :] * szc, mask=ok[:, None] & (c2 < C2)[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.dot(tl.trans(x), z, input_precision="ieee")
        sx += tl.sum(x, axis=0)
    pid = b * SPLIT + split
    tl.store(xz_ptr + pid * C1 * C2 + c1[:, None] * C2 + c2[None, :], acc, mask=(c1 < C1)[:, None] & (c2 < C2)[None, :])
    tl.store(sx_ptr + pid * C1 + c1, sx, mask=c1 < C1)


@triton.jit
def _mix_kernel(
    x_ptr, wx_ptr, z_ptr, wz_ptr, c_ptr, out_ptr, L, CX, CZ, G,
    sxb, sxl, sxc, szb, szl, szc, sob, sol, soc,
    BLOCK_L: tl.constexpr, BCX: tl.constexpr, BCZ: tl.constexpr, BG: tl.constexpr, TWO: tl.constexpr,
):  # fmt: skip
    """``out = x wxᵀ (+ z wzᵀ) + c`` per row of the heads-last views: wx (G, CX), wz (G, CZ), c (G,), fp32."""
    b, block = tl.program_id(0), tl.program_id(1)
    rows = block * BLOCK_L + tl.arange(0, BLOCK_L)
    ok = rows < L
    cx, g = tl.arange(0, BCX), tl.arange(0, BG)
    x = tl.load(
        x_ptr + b * sxb + rows[:, None] * sxl + cx[None, :] * sxc, mask=ok[:, None] & (cx < CX)[None, :], other=0.0
    ).to(tl.float32)
    wx = tl.load(wx_ptr + g[None, :] * CX + cx[:, None], mask=(cx < CX)[:, None] & (g < G)[None, :], other=0.0)
    out = tl.dot(x, wx, input_precision="ieee")
    if TWO:
        cz = tl.arange(0, BCZ)
        z = tl.load(
            z_ptr + b * szb + rows[:, None] * szl + cz[None, :] * szc, mask=ok[:, None] & (cz < CZ)[None, :], other=0.0
        ).to(tl.float32)
        wz = tl.load(wz_ptr + g[None, :] * CZ + cz[:, None], mask=(cz < CZ)[:, None] & (g < G)[None, :], other=0.0)
        out += tl.dot(z, wz, input_precision="ieee")
    out += tl.load(c_ptr + g, mask=g < G, other=0.0)[None, :]
    tl.store(
        out_ptr + b * sob + rows[:, None] * sol + g[None, :] * soc,
        out.to(out_ptr.dtype.element_ty),
        mask=ok[:, None] & (g < G)[None, :],
    )


def moments(x: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    """``(Σ x zᵀ, Σ x)`` over every row of the heads-last views ``x`` (B, L, C1), ``z`` (B, L, C2), in fp64 (fp32
    partial sums per program)."""
    b, length, c1 = x.shape
    c2 = z.shape[-1]
    split = max(1, min(triton.cdiv(length, _BLOCK_L), _MAX_PROGRAMS // b))
    xz = torch.empty(b * split, c1, c2, device=x.device, dtype=torch.float32)
    sx = torch.empty(b * split, c1, device=x.device, dtype=torch.float32)
    launch(
        _moments_kernel, (b, split),
        x, z, xz, sx, length, c1, c2, *x.stride(), *z.stride(), split,
        BLOCK_L=_BLOCK_L, BC1=_channels_block(c1), BC2=_channels_block(c2),
    )  # fmt: skip
    return xz.sum(0, dtype=torch.float64), sx.sum(0, dtype=torch.float64)


def mix(x: Tensor, wx: Tensor, c: Tensor, out: Tensor, z: Tensor | None = None, wz: Tensor | None = None) -> Tensor:
    """``out = x wxᵀ (+ z wzᵀ) + c`` on heads-last views (B, L, C): ``out`` any strides (it fixes the layout)."""
    b, length, cx = x.shape
    g = wx.shape[0]
    two = z is not None
    z, wz = (z, wz.float().contiguous()) if two else (x, wx)
    launch(
        _mix_kernel, (b, triton.cdiv(length, _BLOCK_L)),
        x, wx.float().contiguous(), z, wz, c.float().contiguous(), out, length, cx, z.shape[-1], g,
        *x.stride(), *z.stride(), *out.stride(),
        BLOCK_L=_BLOCK_L, BCX=_channels_block(cx), BCZ=_channels_block(z.shape[-1]), BG=_channels_block(g), TWO=two,
    )  # fmt: skip
    return out


def _empty_maps(like: Tensor, shape: torch.Size, g: int, heads_last: bool) -> tuple[Tensor, Tensor]:
    """Empty maps (B, G, N, N) like ``like`` (device, dtype) in the layout asked for, and their heads-last view
    (B, L, G) for :func:`mix`."""
    b, _, n, m = shape
    out = torch.empty(b, g, n, m, device=like.device, dtype=like.dtype)
    out = out.contiguous(memory_format=torch.channels_last) if heads_last else out
    return out, out.permute(0, 2, 3, 1).view(b, n * m, g) if heads_last else out.view(b, g, n * m).transpose(1, 2)


class _TritonHeadMixBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, weight, bias, gamma, beta, running_mean, running_var, momentum, eps, scale, heads_last):
        with torch.autocast(a.device.type, enabled=False):  # the small matrices stay fp32 under autocast
            rows = token_rows(a)
            count = rows.shape[0] * rows.shape[1]
            w = weight.double()
            q, sum_a = moments(rows, rows)
            mean = w @ sum_a / count  # of W A (the bias enters only the running mean)
            var = ((w @ q) * w).sum(1) / count - mean.square()
            rstd = (var.clamp_min(0) + eps).rsqrt()
            w_eff = (gamma.double() if gamma is not None else torch.ones_like(mean)) * scale
            shift = (beta.double() * scale if beta is not None else 0) - w_eff * rstd * mean
            out, out_rows = _empty_maps(a, a.shape, weight.shape[0], heads_last)
            mix(rows, w * (w_eff * rstd)[:, None], shift, out_rows)
            if running_mean is not None:  # as nn.BatchNorm: the running variance is the unbiased one
                batch_mean = mean + (bias.double() if bias is not None else 0)
                running_mean.lerp_(batch_mean.to(running_mean.dtype), momentum)
                unbiased = var * count / max(count - 1, 1)
                running_var.lerp_(unbiased.to(running_var.dtype), momentum)
            f32 = [t.float() for t in (weight, w_eff, mean, rstd, q, sum_a)]
        ctx.save_for_backward(rows, *f32)
        ctx.scale, ctx.has = scale, (bias is not None, gamma is not None, beta is not None)
        ctx.layout = (a.shape, a.is_contiguous(memory_format=torch.channels_last) and not a.is_contiguous())
        ctx.dtypes = weight.dtype, None if gamma is None else gamma.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, weight, w_eff, mean, rstd, q, sum_a = ctx.saved_tensors
        shape, rows_in = ctx.layout
        with torch.autocast(grad.device.type, enabled=False):
            count = rows.shape[0] * rows.shape[1]
            g = token_rows(grad)
            p, s = (t.float() for t in moments(g, rows))
            terms = BatchNormTerms.of(weight, w_eff, mean, rstd, s, p, count)
            grad_a = grad_w = None
            if ctx.needs_input_grad[0]:  # in the input's layout
                on_g, on_a, const = terms.input_grad_mix(weight)
                grad_a, grad_rows = _empty_maps(rows, shape, shape[1], rows_in)
                mix(g, on_g, const, grad_rows, z=rows, wz=-on_a)
            if ctx.needs_input_grad[1]:
                grad_w = terms.weight_grad(weight, p, q, sum_a).to(ctx.dtypes[0])
            affine = terms.affine_grads(ctx.has, ctx.needs_input_grad, ctx.scale, count)
        affine = [None if t is None else t.to(ctx.dtypes[1] or ctx.dtypes[0]) for t in affine]
        return grad_a, grad_w, *affine, None, None, None, None, None, None


def head_mix_batchnorm_triton(
    attn: Tensor, mix_conv: nn.Conv2d, bn: nn.modules.batchnorm._BatchNorm, scale: float, heads_last: bool
) -> Tensor:
    """:func:`~.head_mix_norm.head_mix_batchnorm` in Triton (:func:`~.head_mix_norm.triton_takes` says which maps): the same values,
    running statistics and gradients, output in the maps' dtype."""
    return _TritonHeadMixBatchNorm.apply(*function_args(attn, mix_conv, bn, scale, heads_last))
