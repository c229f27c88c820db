"""T2T's soft split (overlapping windows of an image made into tokens) as one gather, with its adjoint as backward.

``nn.Unfold(k, padding=p, stride=s)`` gives an image's windows as columns (B, C·k², L); T2T reads them as tokens
(B, L, C·k²). The plain form is the unfold, then a transposed view that the next linear layer copies to contiguous
memory (in the forward pass, and again for its weight gradient), and between token layers first a transpose and
copy of the tokens back into an image; its backward pass is ``fold`` (col2im) plus the same transposes. Here the
windows are read straight from the input's memory (an image (B, C, H, W) in any layout, or a token grid (B, H·W, C)
viewed as one) into contiguous token rows, in nn.Unfold's channel-major order::

    out[b, i·W_o + j, c·kh·kw + u·kw + v] = x_pad[b, c, s_h·i + u, s_w·j + v]

one strided copy (after a zero-padded copy of the input when p > 0). The backward pass is its adjoint, a sum over
the taps (u, v) of the windows that cover each input pixel: ``kh·kw`` strided additions into a channels-last
buffer, from the gradient rearranged tap-major (B, kh, kw, H_o, W_o, C) once. The same values as the plain form
(a gather; the gradient's sums in another order). ``python benchmarks/soft_split.py`` times both.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from .switch import eager_fast_path


def gathers_windows(split: nn.Unfold, x: Tensor) -> bool:
    """Whether :func:`soft_split` gathers (the fast path): eager mode with the fast paths on, the CPU (the GPU keeps
    PyTorch's unfold, not measured against this form), a 4-D input and no dilation."""
    return eager_fast_path() and x.device.type == "cpu" and x.dim() == 4 and _pair(split.dilation) == (1, 1)


def soft_split(split: nn.Unfold, x: Tensor) -> Tensor:
    """``split(x).transpose(1, 2)``: the windows of ``x`` (B, C, H, W) as tokens (B, L, C·k²), row-major over the
    window grid, channel-major within a token. ``x`` may be a token grid's view ``tokens.view(B, H, W,
    C).permute(0, 3, 1, 2)``. Contiguous tokens from one gather where :func:`gathers_windows`, else the module's
    unfold (a transposed view)."""
    if not gathers_windows(split, x):
        return split(x).transpose(1, 2)
    return _SoftSplit.apply(x, _pair(split.kernel_size), _pair(split.stride), _pair(split.padding))


def _out_size(size: int, k: int, s: int, p: int) -> int:
    return (size + 2 * p - k) // s + 1


def _padded(x: Tensor, ph: int, pw: int) -> Tensor:
    """``x`` with ph / pw zeros around its height / width, in the layout it has (channels-last if its channels are
    the innermost axis), as a fresh tensor; ``x`` itself without padding (the gather reads any strides)."""
    if ph == pw == 0:
        return x
    b, c, h, w = x.shape
    if x.stride(1) == 1 and c > 1:
        out = x.new_zeros(b, h + 2 * ph, w + 2 * pw, c).permute(0, 3, 1, 2)
    else:
        out = x.new_zeros(b, c, h + 2 * ph, w + 2 * pw)
    out[:, :, ph : ph + h, pw : pw + w] = x
    return out


def _taps(n_out: int, n_in: int, u: int, s: int, p: int) -> tuple[int, int, int]:
    """The windows ``i0 .. i1-1`` whose tap ``u`` lands inside the input (``0 <= s·i + u - p < n_in``), and the
    input position ``s·i0 + u - p`` of the first."""
    i0 = max(0, -((u - p) // s))
    i1 = min(n_out, (n_in - 1 - u + p) // s + 1)
    return i0, i1, s * i0 + u - p


class _SoftSplit(torch.autograd.Function):
    """The gather of :func:`soft_split` and its adjoint (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]) -> Tensor:
        (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
        b, c, h, w = x.shape
        ho, wo = _out_size(h, kh, sh, ph), _out_size(w, kw, sw, pw)
        xp = _padded(x, ph, pw)
        sb, sc, sy, sx = xp.stride()
        windows = xp.as_strided((b, ho, wo, c, kh, kw), (sb, sh * sy, sw * sx, sc, sy, sx), xp.storage_offset())
        out = x.new_empty(b, ho, wo, c, kh, kw).copy_(windows)
        ctx.geometry = (b, c, h, w), kernel, stride, padding, (ho, wo)
        return out.view(b, ho * wo, c * kh * kw)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None, None]:
        (b, c, h, w), (kh, kw), (sh, sw), (ph, pw), (ho, wo) = ctx.geometry
        taps = g.reshape(b, ho, wo, c, kh, kw).permute(0, 4, 5, 1, 2, 3).contiguous()  # (B, kh, kw, Ho, Wo, C)
        dx = g.new_zeros(b, h, w, c)
        for u in range(kh):
            i0, i1, y0 = _taps(ho, h, u, sh, ph)
            for v in range(kw):
                j0, j1, z0 = _taps(wo, w, v, sw, pw)
                if i0 < i1 and j0 < j1:
                    dx[:, y0 : y0 + sh * (i1 - i0 - 1) + 1 : sh, z0 : z0 + sw * (j1 - j0 - 1) + 1 : sw] += taps[
                        :, u, v, i0:i1, j0:j1
                    ]
        return dx.permute(0, 3, 1, 2), None, None, None
