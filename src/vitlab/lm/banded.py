"""Causal AFT-local in O(T·s·d): only the band of pairs inside the window is formed.

:class:`~vitlab.mixers.AFTLocal` computes AFT-local as AFT-full with a masked ``T x T`` bias, O(T² d)
time and O(T²) memory. Paper Table 1 gives AFT-local O(T s d): with ``w[t, t'] = 0`` outside the
window (global connectivity), the causal sums split into a banded part and a prefix sum::

    Σ_{t'<=t} e^{K_t' + w[t,t']} V_t' = Σ_{t-s<t'<=t} e^{K_t' + w[t,t']} V_t' + Σ_{t'<=t-s} e^{K_t'} V_t'

(and the same without V for the denominator). Both parts are sums of non-negative terms, so nothing
cancels (unlike the literal ``e^w - 1`` form). The band is computed block-wise: the queries of block i
(``b >= s`` positions) only meet keys of blocks i-1 and i, a (b x 2b) matrix of ``e^{w - c_t}``
(c_t = the row's maximum bias, at least 0 when outside pairs count) times ``[e^{K-m} V, e^{K-m}]``.
The prefix sum is a cumulative sum shifted by s. Underflowed denominators take the exact float64 path of
:mod:`vitlab.mixers.aft`, as every AFT core does.

:class:`BandedAFTLocal` is an :class:`~vitlab.mixers.AFTLocal` (same parameters, same state dict,
same outputs) that takes this path for causal sequences longer than the window.
"""

from __future__ import annotations

import functools
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..mixers.aft import AFTLocal, BiasRows, _no_autocast, _ratio
from ..mixers.base import TokenLayout

MIN_BLOCK = 16  # smaller blocks only add per-block overhead


def band_positions(n: int, block: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Query positions ``t`` (nb, b, 1) and key positions ``t'`` (nb, 1, 2b) of the block-wise band.

    Block i holds queries ``i·b .. i·b + b - 1`` and keys ``(i-1)·b .. (i+1)·b - 1`` (negative and
    ``>= n`` positions are padding).
    """
    nb = -(-n // block)
    i = torch.arange(nb, device=device)[:, None, None]
    t = i * block + torch.arange(block, device=device)[None, :, None]
    tk = (i - 1) * block + torch.arange(2 * block, device=device)[None, None, :]
    return t, tk


@functools.lru_cache(maxsize=16)
def _band_masks(n: int, block: int, window: int, outside_zero: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """Which band pairs carry their bias (0 <= t - t' < window), and the bias of the others (nb, b, 2b):
    0 for pairs outside the window (``outside_zero``), -inf for the future, padding and the -inf ablation."""
    t, tk = band_positions(n, block, device)
    lag = t - tk
    inside = (lag >= 0) & (lag < window) & (tk >= 0)
    far = (lag >= window) & (tk >= 0) & outside_zero
    fill = torch.full(inside.shape, float("-inf"), device=device).masked_fill(far, 0.0)
    return inside, fill


def local_bias_band(m: AFTLocal, n: int, block: int) -> Tensor:
    """The raw bias ``w[t, t']`` of ``m`` on the band (nb, b, 2b), in the parameters' dtype (padding entries
    arbitrary)."""
    nb = -(-n // block)
    if m.u is not None:
        d = m.u.shape[1]
        u = F.pad(m.u[:n], (0, 0, 0, nb * block - n)).view(nb, block, d)
        v = F.pad(m.v[:n], (0, 0, block, nb * block - n)).unfold(0, 2 * block, block)  # (nb, d', 2b)
        return u @ v
    t, tk = band_positions(n, block, m.w.device)
    return m.w[t.clamp(max=n - 1), tk.clamp(0, n - 1)]


def aft_local_causal(q: Tensor, k: Tensor, v: Tensor, w_band: Tensor, window: int, outside_zero: bool,
                     bias_rows: BiasRows) -> Tensor:  # fmt: skip
    """Causal AFT-local core (paper Eq. 2 with ``w[t, t'] = 0`` (or -inf) for ``t - t' >= window``).

    ``q, k, v`` (B, T, C) fp32; ``w_band`` (nb, b, 2b) the raw bias on the band of :func:`band_positions`
    with ``b >= window``; ``bias_rows(t, g)`` the full rows of the effective bias for the exact fallback
    (see :func:`vitlab.mixers.aft._ratio`). O(T·b·C) time and memory.

    Block i's queries meet blocks i-1 and i through a (b x 2b) weight matrix ``e^{w - c_t}`` (c_t = the row
    maximum; w = 0 for the pairs of these two blocks outside the window); blocks <= i-2 lie wholly outside
    the window and enter with weight ``e^{-c_t}`` through a cumulative sum of block sums.
    """
    bsz, n, c = k.shape
    nb, block = w_band.shape[:2]
    inside, fill = _band_masks(n, block, window, outside_zero, k.device)
    w = torch.where(inside, w_band, fill)  # -inf before exp: no inf * 0 in the backward pass
    # the row maximum: finite (t' = t is always inside), >= 0 whenever the row has pairs outside the window
    shift = w.detach().amax(-1, keepdim=True)  # (nb, b, 1)
    e = (w - shift).exp()  # (nb, b, 2b)
    ek = (k - k.detach().amax(1, keepdim=True)).exp()
    ctx = torch.cat([ek * v, ek], -1)  # (B, T, 2C)
    x = F.pad(ctx, (0, 0, block, nb * block - n)).view(bsz, nb + 1, block, 2 * c)  # a zero block first
    out = e[..., block:] @ x[:, 1:] + e[..., :block] @ x[:, :-1]  # keys of the own and the previous block
    if outside_zero and nb > 2:
        before = x[:, 1 : nb - 1].sum(2).cumsum(1)  # (B, nb - 2, 2C): Σ over blocks 0..j
        scale = (-shift).exp()  # <= 1 from block 2 on (those rows have pairs outside the window)
        scale[:2] = 0.0  # blocks 0, 1 have no such keys (and may have shift << 0)
        out = out + scale * F.pad(before, (0, 0, 2, 0))[:, :, None]  # block i: blocks <= i - 2
    num, den = out.flatten(1, 2)[:, :n].split(c, -1)
    y = _ratio(num.unsqueeze(-1), den, k, v.unsqueeze(-1), bias_rows)
    return torch.sigmoid(q) * y.squeeze(-1)


class BandedAFTLocal(AFTLocal):
    """:class:`~vitlab.mixers.AFTLocal` whose causal path is O(T·s·d) (:func:`aft_local_causal`).

    Same parameters and outputs; sequences no longer than the window or longer than ``max_len``, non-causal
    use and window 0 (AFT-simple) take the parent's path. ``recompute=True`` keeps only the core's inputs for the backward
    pass and recomputes its intermediates there (activation checkpointing of the core, as flash attention
    recomputes its map): less memory in training, one more core forward per step. Other arguments as
    :class:`~vitlab.mixers.AFTLocal`.
    """

    def __init__(self, *args, recompute: bool = False, **kw) -> None:
        super().__init__(*args, **kw)
        self.recompute = recompute

    def extra_repr(self) -> str:
        return super().extra_repr() + (", recompute=True" if self.recompute else "")

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        n = x.shape[1]
        if not self.causal or self.window == 0 or n <= self.window or n > self.max_len:
            return super().mix(x, layout, attn_prev, return_aux)  # (N > max_len: resampled, or the parent's error)
        q, k, v = self.qkv(x).chunk(3, -1)
        with _no_autocast(x):
            block = max(self.window, MIN_BLOCK)
            band = local_bias_band(self, n, block).float()
            args = (q.float(), k.float(), v.float(), band, self.window, self.outside == "zero",
                    partial(self._fallback_rows, n))  # fmt: skip
            if self.recompute and torch.is_grad_enabled():
                y = checkpoint(aft_local_causal, *args, use_reentrant=False)
            else:
                y = aft_local_causal(*args)
        out = self.proj(y.to(q.dtype)).to(x.dtype)
        return out, ({"keys": k} if return_aux else {})

    def _fallback_rows(self, n: int, t: Tensor, g: Tensor | None = None) -> Tensor:
        """Full rows ``w[t, :]`` (m, n) with the future excluded; only underflowed entries need them."""
        w = self.position_bias(n)[t]
        future = torch.arange(n, device=t.device)[None] > t[:, None]
        return w.masked_fill(future, float("-inf"))
