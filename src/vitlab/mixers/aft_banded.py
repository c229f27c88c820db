"""The band sums of causal AFT-local in O(T·s·d): only the pairs inside the window are formed.

Dense AFT-local (:func:`vitlab.mixers.aft.aft_full` with a masked ``T x T`` bias) costs O(T² d) time and
O(T²) memory; paper Table 1 gives AFT-local O(T s d). With ``w[t, t'] = 0`` outside the window (global
connectivity), the causal sums split into a banded part and a prefix sum::

    Σ_{t'<=t} e^{K_t' + w[t,t']} V_t' = Σ_{t-s<t'<=t} e^{K_t' + w[t,t']} V_t' + Σ_{t'<=t-s} e^{K_t'} V_t'

(and the same without V for the denominator). Both parts are sums of non-negative terms, so nothing
cancels (unlike the literal ``e^w - 1`` form). The band is computed block-wise: the queries of block i
(``b >= s`` positions) only meet keys of blocks i-1 and i, a (b x 2b) matrix of ``e^{w - c_t}``
(c_t = the row's maximum bias, at least 0 when outside pairs count) times ``[e^{K-m} V, e^{K-m}]``.
The prefix sum is a cumulative sum of block sums shifted by two blocks.

:func:`vitlab.mixers.aft.aft_local_causal` divides these sums (with the exact float64 fallback of every
AFT core) and applies the gate; :class:`~vitlab.mixers.AFTLocal` takes that path for causal sequences
longer than its window.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

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


def local_bias_band(
    n: int, block: int, u: Tensor | None = None, v: Tensor | None = None, w: Tensor | None = None
) -> Tensor:
    """The raw bias ``w[t, t']`` on the band of :func:`band_positions` (nb, b, 2b), from the factors ``u, v``
    (``w = u vᵀ``, paper Eq. 7) or the table ``w``, in their dtype (padding entries arbitrary)."""
    nb = -(-n // block)
    if u is not None:
        d = u.shape[1]
        rows = F.pad(u[:n], (0, 0, 0, nb * block - n)).view(nb, block, d)
        cols = F.pad(v[:n], (0, 0, block, nb * block - n)).unfold(0, 2 * block, block)  # (nb, d', 2b)
        return rows @ cols
    t, tk = band_positions(n, block, w.device)
    return w[t.clamp(max=n - 1), tk.clamp(0, n - 1)]


def banded_causal_sums(k: Tensor, v: Tensor, w_band: Tensor, window: int, outside_zero: bool) -> tuple[Tensor, Tensor]:
    """Max-shifted numerator and denominator (B, T, C) of causal AFT-local (paper Eq. 2 with ``w[t, t'] = 0``,
    or -inf, for ``t - t' >= window``); their ratio is the weighted average. O(T·b·C) time and memory.

    ``k, v`` (B, T, C) fp32; ``w_band`` (nb, b, 2b) the raw bias on the band of :func:`band_positions` with
    ``b >= window``. Block i's queries meet blocks i-1 and i through a (b x 2b) weight matrix ``e^{w - c_t}``
    (c_t = the row maximum; w = 0 for the pairs of these two blocks outside the window); blocks <= i-2 lie
    wholly outside the window and enter with weight ``e^{-c_t}`` through a cumulative sum of block sums.
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
    return num, den
