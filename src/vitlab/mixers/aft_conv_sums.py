"""AFT-conv's sums (paper Eq. 6) as one linear operator on head planes, and the core as one autograd function.

Per head i, the numerators and denominators of AFT-conv are a linear operator ``L`` of the key context
``x = [e^{K^i} ⊙ V^i, e^{K^i}]`` (the r value channels of the head and its key channel)::

    L(x)_t = conv(x, e^{w - m})_t + e^{-m} (Σ_{t' outside t's window} x_t' + Σ_{prefix t'} x_t')   patch t
    L(x)_t = e^{-m} Σ_{all t'} x_t'                                                                  prefix t

``m = max(max w^i, 0)`` keeps every weight <= 1; the outside sums are products with 0/1 band matrices
(non-negative coefficients: no ``total - window`` cancellation). The grid part lives in *head planes*
``(B, h, r + 1, H, W)`` (:func:`head_planes`): the layout of a depth-wise convolution, in which the kernel
gradient is one convolution too (:func:`kernel_grad`).

Training runs the core as :class:`AFTConvCore`: ``L`` is its own adjoint up to flipping the kernel
(cross-correlation with zero padding s//2 has the flipped-kernel correlation as adjoint; the outside relation
and the prefix sums are symmetric), so the gradient of the key context is one more :func:`window_sums`, and the
ratio and gate have a closed-form backward that needs only the gate, the output and the denominators.
:func:`vitlab.mixers.aft.aft_conv` decides when this path runs (eager mode) and repairs underflowed
denominators.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable


def split_qkv(qkv: Tensor, heads: int, query: bool) -> tuple[Tensor | None, Tensor, Tensor]:
    """``[Q | K | V]`` (B, N, C + h + C), or ``[K | V]`` without the query, as views q (or None), k, v."""
    c = (qkv.shape[-1] - heads) // 2 if query else qkv.shape[-1] - heads
    q, k, v = qkv.split([c, heads, c], -1) if query else (None, *qkv.split([heads, c], -1))
    return q, k, v


def kernel_and_scale(w: Tensor, global_context: bool) -> tuple[Tensor, Tensor | None]:
    """``e^{w - m}`` (h, s, s) and ``e^{-m}`` (h,) with ``m = max(max w^i, 0)`` per head; without the global
    context (no pairs outside the window) ``m = max w^i`` and no scale."""
    m = w.amax((1, 2))
    if not global_context:
        return torch.exp(w - m[:, None, None]), None
    m = m.clamp_min(0)
    return torch.exp(w - m[:, None, None]), torch.exp(-m)


def token_planes(t: Tensor, num_prefix: int, heads: int) -> Tensor:
    """The patch tokens of ``t`` (B, N, h·r) as a (B, h, r, H·W) view of head planes (no copy)."""
    b, n, c = t.shape
    return t[:, num_prefix:].view(b, n - num_prefix, heads, c // heads).permute(0, 2, 3, 1)


def head_planes(ek: Tensor, v: Tensor, grid: tuple[int, int], num_prefix: int) -> tuple[Tensor, Tensor | None]:
    """The key context ``[e^K ⊙ V, e^K]`` of the patches as head planes (B, h, r + 1, H, W), written in one
    pass from the token-major ``ek`` (B, N, h) and ``v`` (B, N, C); and its sum over the prefix tokens
    (B, h, r + 1), None without any."""
    b, h = ek.shape[0], ek.shape[-1]
    r = v.shape[-1] // h
    x = v.new_empty(b, h, r + 1, grid[0] * grid[1])
    torch.mul(token_planes(v, num_prefix, h), token_planes(ek, num_prefix, h), out=x[:, :, :r])
    x[:, :, r] = ek[:, num_prefix:].transpose(1, 2)
    pre = None
    if num_prefix:
        ek_pre = ek[:, :num_prefix]
        pre = torch.cat(
            [torch.einsum("bph,bphr->bhr", ek_pre, v[:, :num_prefix].view(b, -1, h, r)), ek_pre.sum(1)[..., None]], -1
        )
    return x.view(b, h, r + 1, *grid), pre


def window_band(n: int, p: int, like: Tensor) -> Tensor:
    """(n, n) 0/1 matrix, 1 where |i - j| <= p (symmetric)."""
    i = torch.arange(n, device=like.device)
    return ((i[:, None] - i[None]).abs() <= p).to(like.dtype)


def window_sums(x: Tensor, pre: Tensor | None, kernel: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``L(x)``: for head planes ``x`` (B, h, r + 1, H, W) and the prefix tokens' sum ``pre`` (B, h, r + 1) or
    None, the planes ``conv(x, kernel) + scale · (Σ_outside x + pre)`` and the prefix rows
    ``scale · (pre + Σ x)`` (B, h, r + 1); ``scale=None``: the convolution only (no global context).

    With the band matrices ``A_H, A_W`` (1 within s//2), the outside sum of a plane X is
    ``(A_H X)(1 - A_W) + ((1 - A_H) X 1) 1ᵀ``: the window's rows outside its columns, then whole rows outside the
    window's rows. The first term is accumulated into the convolution's output per (batch, head) with
    ``scale · (1 - A_W)`` as the right factor, so the per-head scale costs no pass of its own.
    """
    b, h, r1, hh, ww = x.shape
    s = kernel.shape[-1]
    planes = x.view(b, h * r1, hh, ww)
    nd = F.conv2d(planes, kernel.repeat_interleave(r1, 0)[:, None], padding=s // 2, groups=h * r1).view(x.shape)
    if scale is None:
        return nd, None
    near_h, near_w = window_band(hh, s // 2, x), window_band(ww, s // 2, x)
    far_w = (1 - near_w) * scale[:, None, None]  # (h, W, W)
    window_rows = (near_h @ x).view(b * h, r1 * hh, ww)
    nd.view(b * h, r1 * hh, ww).baddbmm_(window_rows, far_w.repeat(b, 1, 1))
    del window_rows
    rows = x.sum(-1)  # (B, h, r + 1, H)
    outer = rows @ (1 - near_h)
    if pre is not None:
        outer += pre[..., None]
    nd += (outer * scale[:, None, None]).unsqueeze(-1)
    total = rows.sum(-1) if pre is None else rows.sum(-1) + pre
    return nd, total * scale[:, None]


def kernel_grad(x: Tensor, g: Tensor, s: int) -> Tensor:
    """``Σ_{b, c, t} g_t x_{t + δ}`` per head (h, s, s): the gradient of ``conv(x, kernel)`` in the kernel for the
    output gradient ``g`` (both head planes, B, h, r + 1, H, W). One depth-wise convolution of the B·h·(r + 1)
    planes of x with those of g as kernels (zero padding s//2 gives the s x s offsets), summed per head."""
    b, h, r1, hh, ww = x.shape
    n = b * h * r1
    corr = F.conv2d(x.reshape(1, n, hh, ww), g.reshape(n, 1, hh, ww), padding=s // 2, groups=n)
    return corr.view(b, h, r1, s, s).sum((0, 2))


def _gated_ratio(nd: Tensor, nd_pre: Tensor | None, sq: Tensor | None, num_prefix: int, in_place: bool) -> Tensor:
    """``sigmoid(Q) ⊙ num / den`` (B, N, C) in token order from the planes ``nd`` and prefix rows ``nd_pre`` of
    :func:`window_sums`, with the gate ``sq`` (None: no query term). ``in_place``: written into ``sq``."""
    b, h, r1 = nd.shape[:3]
    r, n = r1 - 1, num_prefix + nd.shape[-2] * nd.shape[-1]
    num, den = nd.flatten(3)[:, :, :r], nd.flatten(3)[:, :, r:]
    out = sq if in_place and sq is not None else nd.new_empty(b, n, h * r)
    grid_out = token_planes(out, num_prefix, h)
    if out is sq:
        grid_out.mul_(num).div_(den)
    else:
        torch.div(num, den, out=grid_out)
    if num_prefix:  # every prefix token has the same sums
        pre_out = out[:, :num_prefix].view(b, num_prefix, h, r)
        ratio = (nd_pre[..., :r] / nd_pre[..., r:])[:, None]
        if out is sq:
            pre_out.mul_(ratio)
        else:
            pre_out.copy_(ratio.expand_as(pre_out))
    if sq is not None and out is not sq:
        out.mul_(sq)
    return out


def conv_core(
    qkv: Tensor, w: Tensor, grid: tuple[int, int], num_prefix: int, global_context: bool, query: bool, floor: float
) -> tuple[Tensor, Tensor]:
    """The AFT-conv core without autograd (arguments as :func:`vitlab.mixers.aft.aft_conv`): the output (B, N, C)
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
    x, pre = head_planes(ek, v, grid, num_prefix)
    nd, nd_pre = window_sums(x, pre, kernel, scale)
    den = nd[:, :, -1:]
    den_min = den.amin() if nd_pre is None else torch.minimum(den.amin(), nd_pre[..., -1].amin())
    den.clamp_min_(floor)
    if nd_pre is not None:
        nd_pre[..., -1].clamp_min_(floor)
    sq = None if q is None else torch.sigmoid(q)
    if not keep:
        del x
        return _gated_ratio(nd, nd_pre, sq, num_prefix, in_place=True), den_min, None
    out = _gated_ratio(nd, nd_pre, sq, num_prefix, in_place=False)
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
        ctx.num_prefix = num_prefix
        ctx.mark_non_differentiable(den_min)
        return out, den_min

    @staticmethod
    @once_differentiable
    def backward(ctx, g, _):
        x, ek, v_pre, sq, out, den, nd_pre, kernel, scale = ctx.saved_tensors
        p, (b, h) = ctx.num_prefix, x.shape[:2]
        g = g.contiguous()
        dot = torch.linalg.vecdot(g.view(*g.shape[:2], h, -1), out.view(*g.shape[:2], h, -1))  # Σ_head g ⊙ y
        gnd = _ratio_grad(g, sq, den, dot, x, p)
        pre = None
        if p:
            g_num = g[:, :p] if sq is None else g[:, :p] * sq[:, :p]
            pre = torch.cat([g_num.view(b, p, h, -1).sum(1), -dot[:, :p].sum(1)[..., None]], -1) / nd_pre[..., -1:]
        gx, gx_pre = window_sums(gnd, pre, kernel.flip(-1, -2), scale)
        dw = kernel_grad(x, gnd, kernel.shape[-1]) * kernel if ctx.needs_input_grad[1] else None
        del gnd
        dqkv = _qkv_grad(g, sq, out, gx, gx_pre, x, ek, v_pre, p) if ctx.needs_input_grad[0] else None
        return dqkv, dw, None, None, None, None, None


def _ratio_grad(g: Tensor, sq: Tensor | None, den: Tensor, dot: Tensor, x: Tensor, p: int) -> Tensor:
    """The gradient of the patch planes of ``[num, den]`` (head planes like x): ``g ⊙ σ(Q) / den`` and
    ``-Σ_head g ⊙ y / den`` (``dot``, B, N, h)."""
    h, r = x.shape[1], x.shape[2] - 1
    gnd = torch.empty_like(x).flatten(3)
    g_num = gnd[:, :, :r]
    if sq is None:
        g_num.copy_(token_planes(g, p, h))
    else:
        torch.mul(token_planes(g, p, h), token_planes(sq, p, h), out=g_num)
    g_num.div_(den.flatten(3))
    torch.div(dot[:, p:].transpose(1, 2), den.flatten(2), out=gnd[:, :, r]).neg_()
    return gnd.view(x.shape)


def _qkv_grad(
    g: Tensor, sq: Tensor | None, out: Tensor, gx: Tensor, gx_pre: Tensor | None, x: Tensor, ek: Tensor, v_pre, p: int
) -> Tensor:
    """The gradient of ``[Q | K | V]`` in one buffer from the key context's gradient ``gx`` (planes; consumed) and
    ``gx_pre`` (B, h, r + 1, the same for every prefix token)."""
    b, n, c = g.shape
    h = ek.shape[-1]
    r = c // h
    dqkv = g.new_empty(b, n, (c if sq is not None else 0) + h + c)
    dq, dk, dv = split_qkv(dqkv, h, sq is not None)
    if sq is not None:  # g ⊙ y ⊙ (1 - σ(Q))
        torch.mul(g, out, out=dq).addcmul_(dq, sq, value=-1.0)
    torch.mul(gx.flatten(3)[:, :, :r], token_planes(ek, p, h), out=token_planes(dv, p, h))
    dk[:, p:] = gx.mul_(x).sum(2).flatten(2).transpose(1, 2)
    if p:
        ek_pre = ek[:, :p]
        dv[:, :p] = (gx_pre[:, None, :, :r] * ek_pre[..., None]).flatten(2)
        dk[:, :p] = ek_pre * (
            torch.einsum("bhr,bphr->bph", gx_pre[..., :r], v_pre.view(b, p, h, r)) + gx_pre[:, None, :, r]
        )
    return dqkv
