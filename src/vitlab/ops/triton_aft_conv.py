"""AFT-conv's window sums (paper Eq. 6) as Triton kernels, forward and backward.

AFT-conv's numerators and denominators are, per head i, a linear operator of the key context
``x = [e^{K^i - k} ⊙ V^i, e^{K^i - k}]`` (:mod:`vitlab.ops.aft_conv` explains the form without cancellation)::

    L(x)_t = Σ_{(dy, dx) in the s x s window} e^{w^i[dy, dx] - m} x_{t + (dy - s//2, dx - s//2)}  +  e^{-m} F_t

with ``m = max(max w^i, 0)`` (every weight <= 1) and ``F_t`` the sum of x outside t's window and over the prefix
tokens (sums of non-negative terms, formed by :func:`vitlab.ops.aft._outside_window_sum`'s band products). The
forward kernel owns a tile of patches, a batch row and a block of channels of the token-major context and visits
only the window's s² taps (zero padding at the grid's edges), adding ``e^{-m} F`` in the same pass: O(T·s²·d), no
T x T tensor, fp32 accumulation. Backward: L's window part is its own adjoint with the kernel flipped
(cross-correlation with zero padding s//2), so ``∂x`` is the same kernel on the output gradient g; the kernel's
gradient ``∂kernel^i[dy, dx] = Σ_{b, t, channels of i} g_t x_{t + δ}`` is one program per (batch row, block of
channels, tap), summed over the batch and the head's channels afterwards; ``∂F = e^{-m} g``.

The exponentials, the ratio with its exact float64 recomputation of underflowed denominators, and the gate are
those of the composite core (:func:`vitlab.ops.aft._aft_conv_composite`), which this module plugs its sums into:
the result is exact in the same sense as the CPU core for keys and biases of any magnitude.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from .aft import _aft_conv_composite, _outside_window_sum
from .triton_support import launch


@triton.jit
def _head_of(ch, C, R):
    """The head of each channel of the key context ``[e^K ⊙ V (C, head-major) | e^K (h)]``."""
    return tl.where(ch < C, ch // R, ch - C)


@triton.jit
def _shifted(X, x_b, x_t, b, y, x, dy, dx, ch, H, W, CX, S: tl.constexpr):
    """x at the patches (y + dy - s//2, x + dx - s//2) (tile of patches x block of channels), 0 outside the grid."""
    yy = y + dy - S // 2
    xx = x + dx - S // 2
    inside = (yy >= 0) & (yy < H) & (xx >= 0) & (xx < W)
    mask = inside[:, None] & (ch[None, :] < CX)
    return tl.load(X + b * x_b + (yy * W + xx)[:, None] * x_t + ch[None, :], mask=mask, other=0.0)


@triton.jit
def _window_fwd(X, KER, FAR, SCALE, OUT, x_b, x_t, f_b, f_t, f_c, H, W, CX, C, R,
                S: tl.constexpr, FLIP: tl.constexpr, HAS_FAR: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    i, b, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p = i * BT + tl.arange(0, BT)
    ch = cb * BC + tl.arange(0, BC)
    y = p // W
    x = p % W
    valid = p < H * W
    y = tl.where(valid, y, -S)  # padded rows: every tap outside the grid
    cmask = ch < CX
    head = _head_of(ch, C, R)
    acc = tl.zeros((BT, BC), tl.float32)
    for dy in range(0, S):
        for dx in range(0, S):
            tap = dy * S + dx
            if FLIP:  # the adjoint: the kernel flipped in both axes
                tap = S * S - 1 - tap
            wt = tl.load(KER + head * S * S + tap, mask=cmask, other=0.0)
            acc += wt[None, :] * _shifted(X, x_b, x_t, b, y, x, dy, dx, ch, H, W, CX, S)
    mask = valid[:, None] & cmask[None, :]
    if HAS_FAR:
        scale = tl.load(SCALE + head, mask=cmask, other=0.0)
        far = tl.load(FAR + b * f_b + p[:, None] * f_t + ch[None, :] * f_c, mask=mask, other=0.0)
        acc += scale[None, :] * far
    tl.store(OUT + (b * H * W + p[:, None]) * CX + ch[None, :], acc, mask=mask)


@triton.jit
def _window_grad_kernel(X, G, GK, x_b, x_t, H, W, CX, S: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    b, cb, tap = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ch = cb * BC + tl.arange(0, BC)
    cmask = ch < CX
    dy = tap // S
    dx = tap % S
    acc = tl.zeros((BC,), tl.float32)
    for i in range(0, tl.cdiv(H * W, BT)):
        p = i * BT + tl.arange(0, BT)
        valid = p < H * W
        y = tl.where(valid, p // W, -S)
        x = p % W
        g = tl.load(G + (b * H * W + p[:, None]) * CX + ch[None, :], mask=valid[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(g * _shifted(X, x_b, x_t, b, y, x, dy, dx, ch, H, W, CX, S), 0)
    tl.store(GK + (b * CX + ch) * S * S + tap, acc, mask=cmask)


def _blocks(x: Tensor) -> tuple[int, int]:
    """Tile of patches and block of channels; the interpreter (CPU tensors) takes the smallest, so that the tests'
    small grids span several tiles."""
    bt = 64 if x.device.type != "cpu" else 16
    return bt, min(64, max(16, triton.next_power_of_2(x.shape[-1])))


def _window_sums(x: Tensor, kernel: Tensor, far: Tensor | None, scale: Tensor | None, grid: tuple[int, int],
                 r: int, flip: bool) -> Tensor:  # fmt: skip
    """``L(x)`` of this module's docstring (``flip``: the window part's adjoint; ``far`` None: no global term)."""
    b, hw, cx = x.shape
    h, s = kernel.shape[0], kernel.shape[-1]
    out = x.new_empty(b, hw, cx, dtype=torch.float32)
    bt, bc = _blocks(x)
    f = far if far is not None else out
    kernel = kernel.float().contiguous()
    launch(
        _window_fwd, (triton.cdiv(hw, bt), b, triton.cdiv(cx, bc)),
        x, kernel, f, kernel if scale is None else scale.float().contiguous(), out, x.stride(0), x.stride(1),
        *f.stride(), *grid, cx, cx - h, r, S=s, FLIP=flip, HAS_FAR=far is not None, BT=bt, BC=bc,
    )  # fmt: skip
    return out


class _WindowSums(torch.autograd.Function):
    """``L(x)`` (B, H·W, C + h) of the patches' key context ``x``, the kernel ``e^{w - m}`` (h, s, s), the outside
    sums ``far`` (or None) and their weight ``e^{-m}`` (h,; a constant: m carries no gradient)."""

    @staticmethod
    def forward(ctx, x, kernel, far, scale, per_chan, grid):
        r = (x.shape[-1] - kernel.shape[0]) // kernel.shape[0]
        ctx.grid, ctx.r = grid, r
        ctx.save_for_backward(x, kernel, scale, per_chan)
        return _window_sums(x, kernel, far, scale, grid, r, flip=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, kernel, scale, per_chan = ctx.saved_tensors
        g = g.float().contiguous()
        gx = _window_sums(g, kernel, None, None, ctx.grid, ctx.r, flip=True) if ctx.needs_input_grad[0] else None
        gk = None
        if ctx.needs_input_grad[1]:
            b, _, cx = x.shape
            s = kernel.shape[-1]
            per_channel = g.new_empty(b, cx, s, s)
            bt, bc = _blocks(x)
            launch(_window_grad_kernel, (b, triton.cdiv(cx, bc), s * s), x, g, per_channel, x.stride(0), x.stride(1),
                   *ctx.grid, cx, S=s, BT=bt, BC=bc)  # fmt: skip
            gk = torch.zeros_like(kernel, dtype=torch.float32).index_add_(0, per_chan, per_channel.sum(0))
            gk = gk.to(kernel.dtype)
        gfar = g * scale[per_chan] if ctx.needs_input_grad[2] else None
        return gx, gk, gfar, None, None, None


def _triton_patch_sums(
    x: Tensor, x_pre: Tensor, kernel: Tensor, scale: Tensor | None, per_chan: Tensor, grid: tuple[int, int]
) -> Tensor:
    """:data:`vitlab.ops.aft.PatchSums` on the kernels: the outside sums from the band products (token-major views),
    the window and their sum in :class:`_WindowSums`."""
    far = None
    if scale is not None:
        b, _, cx = x.shape
        x_grid = x.view(b, *grid, cx).permute(0, 3, 1, 2)  # channel-major view, no copy
        far = (_outside_window_sum(x_grid, kernel.shape[-1]) + x_pre.sum(1)[..., None, None]).flatten(2).mT
    return _WindowSums.apply(x, kernel, far, scale, per_chan, grid)


def aft_conv_triton(
    qkv: Tensor, w: Tensor, grid: tuple[int, int], num_prefix: int = 0, global_context: bool = True, query: bool = True
) -> Tensor:
    """AFT-conv, paper Eq. 6 (arguments as :func:`vitlab.ops.aft.aft_conv`), its window sums on this module's
    kernels: ``qkv`` (B, N, C + h + C) of any float dtype, fp32 (B, N, C) out; exact for keys and biases of any
    magnitude (underflowed denominators recomputed in float64)."""
    if not global_context and num_prefix:
        raise ValueError("aft_conv: global_context=False has no pairs for prefix tokens; use num_prefix=0")
    qkv = qkv.float()  # the exponentials, ratio and gate in fp32 (the gradient returns in the projection's dtype)
    return _aft_conv_composite(qkv, w, grid, num_prefix, global_context, query, _triton_patch_sums)
