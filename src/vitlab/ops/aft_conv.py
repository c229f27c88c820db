"""AFT-conv's sums (paper Eq. 6) as one linear operator, and the core as one autograd function.

Per head i, the numerators and denominators of AFT-conv are a linear operator ``L`` of the key context
``x = [e^{K^i} ⊙ V^i, e^{K^i}]`` (the r value channels of the head and its key channel)::

    L(x)_t = conv(x, e^{w - m})_t + e^{-m} (Σ_{t' outside t's window} x_t' + Σ_{prefix t'} x_t')   patch t
    L(x)_t = e^{-m} Σ_{all t'} x_t'                                                                  prefix t

``m = max(max w^i, 0)`` keeps every weight <= 1; the outside sums are products with 0/1 band matrices
(non-negative coefficients: no ``total - window`` cancellation). The patches' context is kept token-major,
``(B, H·W, h, r + 1)`` (:func:`key_context`): the channels-last layout of the depth-wise convolution, which
oneDNN runs without reordering its input or output, and the order of the tokens, so the ratio, the gate and
every gradient are elementwise passes over contiguous memory (no transposes).

Training runs the core as :class:`AFTConvCore`: ``L`` is its own adjoint up to flipping the kernel
(cross-correlation with zero padding s//2 has the flipped-kernel correlation as adjoint; the outside relation
and the prefix sums are symmetric), so the gradient of the key context is one more :func:`window_sums`; the
kernel's gradient is a correlation of x with that gradient (:func:`kernel_grad`); the ratio and gate have a
closed-form backward that needs only the gate, the output and the denominators.
:func:`vitlab.ops.aft.aft_conv` decides when this path runs (eager mode) and repairs underflowed
denominators.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable


def split_qkv(qkv: Tensor, heads: int, query: bool) -> tuple[Tensor | None, Tensor, Tensor]:
    """``[Q | K | V]`` (B, N, C + h + C), or ``[K | V]`` without the query, as views q (or None), k, v."""
    c = (qkv.shape[-1] - heads) // 2 if query else qkv.shape[-1] - heads
    if query:
        q, k, v = qkv.split([c, heads, c], -1)
        return q, k, v
    k, v = qkv.split([heads, c], -1)  # unpacked by name: torch.fx cannot star-unpack a symbol
    return None, k, v


def kernel_and_scale(w: Tensor, global_context: bool) -> tuple[Tensor, Tensor | None]:
    """``e^{w - m}`` (h, s, s) and ``e^{-m}`` (h,) with ``m = max(max w^i, 0)`` per head; without the global
    context (no pairs outside the window) ``m = max w^i`` and no scale. m is a constant to autograd: the ratio
    of the sums does not depend on it."""
    m = w.detach().amax((1, 2))
    if not global_context:
        return torch.exp(w - m[:, None, None]), None
    m = m.clamp_min(0)
    return torch.exp(w - m[:, None, None]), torch.exp(-m)


def key_context(ek: Tensor, v: Tensor, num_prefix: int) -> tuple[Tensor, Tensor | None]:
    """``[e^K ⊙ V, e^K]`` of the patches (B, H·W, h, r + 1) from ``ek`` (B, N, h) and ``v`` (B, N, C), and its
    sum over the prefix tokens (B, h, r + 1), None without any."""
    b, n, h = ek.shape
    r = v.shape[-1] // h
    x = v.new_empty(b, n - num_prefix, h, r + 1)
    torch.mul(v[:, num_prefix:].view(b, -1, h, r), ek[:, num_prefix:, :, None], out=x[..., :r])
    x[..., r] = ek[:, num_prefix:]
    pre = None
    if num_prefix:
        ek_pre = ek[:, :num_prefix]
        pre_v = torch.einsum("bph,bphr->bhr", ek_pre, v[:, :num_prefix].view(b, -1, h, r))
        pre = torch.cat([pre_v, ek_pre.sum(1)[..., None]], -1)
    return x, pre


def window_band(n: int, p: int, like: Tensor) -> Tensor:
    """(n, n) 0/1 matrix, 1 where |i - j| <= p (symmetric)."""
    i = torch.arange(n, device=like.device)
    return ((i[:, None] - i[None]).abs() <= p).to(like.dtype)


def _as_image(x: Tensor, grid: tuple[int, int]) -> Tensor:
    """Token-major patches (B, H·W, h, r + 1) as a channels-last (B, h·(r + 1), H, W) view."""
    b, _, h, r1 = x.shape
    return x.view(b, *grid, h * r1).permute(0, 3, 1, 2)


def window_sums(
    x: Tensor, pre: Tensor | None, kernel: Tensor, scale: Tensor | None, grid: tuple[int, int]
) -> tuple[Tensor, Tensor | None]:
    """``L(x)``: for the patches' context ``x`` (B, H·W, h, r + 1) on the ``grid`` and the prefix tokens' sum
    ``pre`` (B, h, r + 1) or None, the patches' ``conv(x, kernel) + scale · (Σ_outside x + pre)`` (like x) and
    the prefix rows ``scale · (pre + Σ x)`` (B, h, r + 1); ``scale=None``: the convolution only.

    With the band matrices ``A_H, A_W`` (1 within s//2), the outside sum of a grid X is
    ``A_H X (1 - A_W) + ((1 - A_H) X 1) 1ᵀ``: the window's rows outside its columns, then whole rows outside the
    window's rows. Both are matrix products over the grid's rows and columns with the channels as the long
    dimension, accumulated into the convolution's output.
    """
    b, _, h, r1 = x.shape
    (hh, ww), s = grid, kernel.shape[-1]
    weight = kernel.repeat_interleave(r1, 0)[:, None]
    nd = F.conv2d(_as_image(x, grid), weight, padding=s // 2, groups=h * r1).permute(0, 2, 3, 1)
    nd = nd.contiguous().view(x.shape)  # channels-last in, channels-last out: no copy
    if scale is None:
        return nd, None
    near_h, far_w = window_band(hh, s // 2, x), 1 - window_band(ww, s // 2, x)
    window_rows = x.new_empty(hh, ww, h, r1)  # one batch item's: 1/B of a full-size temporary
    for i in range(b):
        torch.mm(near_h, x[i].view(hh, -1), out=window_rows.view(hh, -1))
        window_rows.mul_(scale[:, None])
        nd[i].view(hh, ww, -1).baddbmm_(far_w.expand(hh, ww, ww), window_rows.view(hh, ww, -1))
    del window_rows
    rows = x.view(b, hh, ww, -1).sum(2)  # (B, H, h·(r + 1))
    outer = (1 - near_h) @ rows
    if pre is not None:
        outer += pre.view(b, 1, -1)
    nd.view(b, hh, ww, h, r1).add_(outer.view(b, hh, 1, h, r1) * scale[:, None])
    total = rows.sum(1).view(b, h, r1)
    return nd, (total if pre is None else total + pre) * scale[:, None]


def kernel_grad(x: Tensor, g: Tensor, grid: tuple[int, int], s: int) -> Tensor:
    """``Σ_{b, c, t} g_t x_{t + δ}`` per head (h, s, s): the gradient of ``conv(x, kernel)`` in the kernel for the
    output gradient ``g`` (both token-major patches, B, H·W, h, r + 1). Per batch item, one depth-wise
    convolution of x's channels with g's channels as (H x W) kernels (zero padding s//2 gives the s x s
    offsets), in the channels-last layout as laid out; summed per head. (oneDNN's own kernel gradient of a
    channels-last depth-wise convolution took ~30 MB of workspace.)"""
    b, _, h, r1 = x.shape
    corr = 0
    for i in range(b):
        image, weight = _as_image(x[i : i + 1], grid), _as_image(g[i : i + 1], grid).transpose(0, 1)
        corr = corr + F.conv2d(image, weight, padding=s // 2, groups=h * r1)
    return corr.view(h, r1, s, s).sum(1)


def _gated_ratio(nd: Tensor, nd_pre: Tensor | None, sq: Tensor | None, num_prefix: int, in_place: bool) -> Tensor:
    """``sigmoid(Q) ⊙ num / den`` (B, N, C) from the patches' sums ``nd`` (B, H·W, h, r + 1) and the prefix rows
    ``nd_pre`` (B, h, r + 1), with the gate ``sq`` (None: no query term); ``in_place``: written into ``sq``."""
    b, hw, h, r1 = nd.shape
    r, p = r1 - 1, num_prefix
    out = sq if in_place and sq is not None else nd.new_empty(b, p + hw, h * r)
    parts = [(out[:, p:].view(b, hw, h, r), nd, None if sq is None else sq[:, p:].view(b, hw, h, r))]
    if p:  # every prefix token has the same sums
        gate = None if sq is None else sq[:, :p].view(b, p, h, r)
        parts.append((out[:, :p].view(b, p, h, r), nd_pre[:, None].expand(b, p, h, r1), gate))
    for dst, sums, gate in parts:
        num, den = sums[..., :r], sums[..., r:]
        if gate is None:
            torch.div(num, den, out=dst)
        elif out is sq:
            dst.mul_(num).div_(den)
        else:
            torch.mul(gate, num, out=dst).div_(den)
    return out


def conv_core(
    qkv: Tensor, w: Tensor, grid: tuple[int, int], num_prefix: int, global_context: bool, query: bool, floor: float
) -> tuple[Tensor, Tensor]:
    """The AFT-conv core without autograd (arguments as :func:`vitlab.ops.aft.aft_conv`): the output (B, N, C)
    and the smallest denominator (0-dim); denominators below ``floor`` are clamped to it (the caller recomputes
    such a call)."""
    return _forward(qkv, w, grid, num_prefix, global_context, query, floor, keep=False)[:2]


def _forward(
    qkv: Tensor,
    w: Tensor,
    grid: tuple[int, int],
    num_prefix: int,
    global_context: bool,
    query: bool,
    floor: float,
    keep: bool,
) -> tuple[Tensor, Tensor, tuple | None]:
    """:func:`conv_core`, and with ``keep`` the tensors :class:`AFTConvCore`'s backward needs (without, the
    gate's buffer becomes the output: one allocation fewer)."""
    q, k, v = split_qkv(qkv, w.shape[0], query)
    kernel, scale = kernel_and_scale(w, global_context)
    ek = (k - k.amax(1, keepdim=True)).exp()  # the shift cancels in the ratio
    x, pre = key_context(ek, v, num_prefix)
    nd, nd_pre = window_sums(x, pre, kernel, scale, grid)
    den = nd[..., -1]
    den_min = den.amin() if nd_pre is None else torch.minimum(den.amin(), nd_pre[..., -1].amin())
    den.clamp_min_(floor)
    if nd_pre is not None:
        nd_pre[..., -1].clamp_min_(floor)
    if not keep:
        del x
    sq = None if q is None else torch.sigmoid(q)
    out = _gated_ratio(nd, nd_pre, sq, num_prefix, in_place=not keep)
    if not keep:
        return out, den_min, None
    v_pre = v[:, :num_prefix].clone() if num_prefix else None
    return out, den_min, (x, ek, v_pre, sq, out, den.clone(), nd_pre, kernel, scale)


class AFTConvCore(torch.autograd.Function):
    """The AFT-conv core (:func:`conv_core`) with a closed-form backward.

    With ``y = σ(Q) ⊙ num / den`` and the output gradient g: ``∂Q = g ⊙ y ⊙ (1 - σ(Q))``,
    ``∂num = g ⊙ σ(Q) / den``, ``∂den = -Σ_head g ⊙ y / den``; then ``∂x = L*(∂[num, den])`` (:func:`window_sums`
    with the kernel flipped), ``∂V = ∂x_V ⊙ e^K``, ``∂K = Σ_head ∂x ⊙ x`` and ``∂w = kernel_grad(x, ∂[num, den])
    ⊙ e^{w - m}`` (m carries no gradient: the ratio does not depend on it). Saved: x, σ(Q), y (which the next
    projection keeps anyway), the denominators and the small key tensors. The input is the fused projection
    ``qkv``, so its gradient is written into one buffer (no concatenation of three gradients).
    """

    @staticmethod
    def forward(ctx, qkv, w, grid, num_prefix, global_context, query, floor):
        out, den_min, saved = _forward(qkv, w, grid, num_prefix, global_context, query, floor, keep=True)
        ctx.save_for_backward(*saved)
        ctx.grid, ctx.num_prefix = grid, num_prefix
        ctx.mark_non_differentiable(den_min)
        return out, den_min

    @staticmethod
    @once_differentiable
    def backward(ctx, g, _):
        x, ek, v_pre, sq, out, den, nd_pre, kernel, scale = ctx.saved_tensors
        grid, p, h = ctx.grid, ctx.num_prefix, x.shape[2]
        g = g.contiguous()
        dot = torch.linalg.vecdot(g.view(*g.shape[:2], h, -1), out.view(*g.shape[:2], h, -1))  # Σ_head g ⊙ y
        # ∂qkv's buffer first: until it is written, it holds ∂[num, den] of the patches (no allocation of its own)
        dqkv = g.new_empty(*g.shape[:2], qkv_width(g.shape[-1], h, sq is not None))
        gnd = _ratio_grad(g[:, p:], None if sq is None else sq[:, p:], den, dot[:, p:], into=dqkv)
        pre = None
        if p:
            pre = _ratio_grad(g[:, :p], None if sq is None else sq[:, :p], nd_pre[:, None, :, -1], dot[:, :p]).sum(1)
        gx, gx_pre = window_sums(gnd, pre, kernel.flip(-1, -2), scale, grid)
        dw = kernel_grad(x, gnd, grid, kernel.shape[-1]) * kernel if ctx.needs_input_grad[1] else None
        del gnd
        if not ctx.needs_input_grad[0]:
            return None, dw, None, None, None, None, None
        _qkv_grad(dqkv, g, sq, out, gx, gx_pre, x, ek, v_pre, p)
        return dqkv, dw, None, None, None, None, None


def qkv_width(c: int, heads: int, query: bool) -> int:
    """The width of the fused projection ``[Q | K | V]`` (``[K | V]`` without the query) for C channels."""
    return (2 * c if query else c) + heads


def _ratio_grad(g: Tensor, sq: Tensor | None, den: Tensor, dot: Tensor, into: Tensor | None = None) -> Tensor:
    """The gradient of ``[num, den]`` (B, T, h, r + 1) at T tokens: ``g ⊙ σ(Q) / den`` and ``-Σ_head g ⊙ y / den``
    (``dot``, B, T, h); ``den`` (B, T, h). Written into the leading elements of ``into`` if given."""
    b, t, h = dot.shape
    shape = (b, t, h, g.shape[-1] // h + 1)
    gnd = g.new_empty(shape) if into is None else into.view(-1)[: math.prod(shape)].view(shape)
    g_num = gnd[..., :-1]
    if sq is None:
        g_num.copy_(g.view(b, t, h, -1))
    else:
        torch.mul(g.view(b, t, h, -1), sq.view(b, t, h, -1), out=g_num)
    g_num.div_(den[..., None])
    torch.div(dot, den, out=gnd[..., -1]).neg_()
    return gnd


def _qkv_grad(
    dqkv: Tensor,
    g: Tensor,
    sq: Tensor | None,
    out: Tensor,
    gx: Tensor,
    gx_pre: Tensor | None,
    x: Tensor,
    ek: Tensor,
    v_pre: Tensor | None,
    p: int,
) -> None:
    """Write the gradient of ``[Q | K | V]`` into ``dqkv``, from the key context's gradient of the patches ``gx``
    (B, H·W, h, r + 1; consumed) and of each prefix token ``gx_pre`` (B, h, r + 1)."""
    b, n, c = g.shape
    h = ek.shape[-1]
    r = c // h
    dq, dk, dv = split_qkv(dqkv, h, sq is not None)
    if sq is not None:  # g ⊙ y ⊙ (1 - σ(Q))
        torch.mul(g, out, out=dq).addcmul_(dq, sq, value=-1.0)
    torch.mul(gx[..., :r], ek[:, p:, :, None], out=dv[:, p:].view(b, n - p, h, r))
    torch.sum(gx.mul_(x), -1, out=dk[:, p:])  # Σ_head ∂x ⊙ x
    if p:
        ek_pre = ek[:, :p]
        dv[:, :p] = (gx_pre[:, None, :, :r] * ek_pre[..., None]).flatten(2)
        dk[:, :p] = ek_pre * (
            torch.einsum("bhr,bphr->bph", gx_pre[..., :r], v_pre.view(b, p, h, r)) + gx_pre[:, None, :, r]
        )
