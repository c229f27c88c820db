"""The band sums of AFT-local in O(T·s·d): only the pairs inside the window are formed.

Dense AFT-local (:func:`vitlab.ops.aft.aft_full` with a masked ``T x T`` bias) costs O(T² d) time and
O(T²) memory; paper Table 1 gives AFT-local O(T s d). With ``w[t, t'] = 0`` outside the window (global
connectivity), the sums split into a banded part and sums of whole blocks outside the window::

    Σ_t' e^{K_t' + w[t,t']} V_t' = Σ_{|t-t'|<s} e^{K_t' + w[t,t']} V_t' + Σ_{|t-t'|>=s} e^{K_t'} V_t'

(and the same without V for the denominator; causal: t' <= t only). Every part is a sum of non-negative
terms, so nothing cancels (unlike the literal ``e^w - 1`` form). The band is computed block-wise: the
queries of block i (``b >= s`` positions) only meet keys of blocks i-1 and i (causal) or i-1, i and i+1
(non-causal), a (b x 2b) or (b x 3b) matrix of ``e^{w - c_t}`` (c_t = the row's maximum bias, at least 0
when outside pairs count) times ``[e^{K-m} V, e^{K-m}]``. The blocks further away lie wholly outside the
window: a cumulative sum of block sums shifted by two blocks (and, non-causal, the same from the end).

:func:`vitlab.ops.aft.aft_local_banded` divides these sums (with the exact float64 fallback of every
AFT core) and applies the gate; :class:`~vitlab.mixers.AFTLocal` takes that path for sequences longer
than its window whose bias is a block of its table.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

MIN_BLOCK = 16  # smaller blocks only add per-block overhead


def band_block(window: int) -> int:
    """The block size b of the band for a window s: b >= s, and at least :data:`MIN_BLOCK`."""
    return max(window, MIN_BLOCK)


def _span(causal: bool) -> int:
    """Blocks of keys a query block meets: i-1, i (causal) or i-1, i, i+1."""
    return 2 if causal else 3


def band_positions(
    n: int, block: int, device: torch.device | None = None, causal: bool = True
) -> tuple[Tensor, Tensor]:
    """Query positions ``t`` (nb, b, 1) and key positions ``t'`` (nb, 1, 2b or 3b) of the block-wise band.

    Block i holds queries ``i·b .. i·b + b - 1`` and keys ``(i-1)·b .. (i+1)·b - 1`` (causal) or
    ``.. (i+2)·b - 1`` (negative and ``>= n`` positions are padding).
    """
    nb = -(-n // block)
    i = torch.arange(nb, device=device)[:, None, None]
    t = i * block + torch.arange(block, device=device)[None, :, None]
    tk = (i - 1) * block + torch.arange(_span(causal) * block, device=device)[None, None, :]
    return t, tk


@functools.lru_cache(maxsize=16)
def _band_masks(
    n: int, block: int, window: int, outside_zero: bool, device: torch.device, causal: bool = True
) -> tuple[Tensor, Tensor]:
    """Which band pairs carry their bias (|t - t'| < window; causal: 0 <= t - t'), and the bias of the others
    (nb, b, 2b or 3b): 0 for pairs outside the window (``outside_zero``), -inf for the future, padding and the
    -inf ablation. Padding queries (``t >= n``, discarded) keep their padding keys: their rows stay finite.

    Built as ordinary tensors even when first asked for under ``torch.inference_mode()`` (an evaluation
    loop): the cache outlives that context, and autograd refuses to save inference tensors for backward."""
    with torch.inference_mode(False):
        t, tk = band_positions(n, block, device, causal)
        lag = t - tk
        seen = (tk >= 0) & ((tk < n) | (t >= n))
        if causal:
            seen &= lag >= 0
        inside = seen & (lag.abs() < window)
        fill = torch.full(inside.shape, float("-inf"), device=device)
        # a Python branch, not `seen & ~inside & outside_zero`: a TorchScript trace records that as aten::__and__
        # of a tensor and a bool, which TorchScript cannot run (AFT-local failed to export)
        if outside_zero:
            fill = fill.masked_fill(seen & ~inside, 0.0)
    return inside, fill


def local_bias_band(
    n: int,
    block: int,
    u: Tensor | None = None,
    v: Tensor | None = None,
    w: Tensor | None = None,
    causal: bool = True,
) -> Tensor:
    """The raw bias ``w[t, t']`` on the band of :func:`band_positions` (nb, b, 2b or 3b), from the factors
    ``u, v`` (``w = u vᵀ``, paper Eq. 7) or the table ``w``, in their dtype (padding entries arbitrary)."""
    nb = -(-n // block)
    if u is not None:
        d, span = u.shape[1], _span(causal)
        rows = F.pad(u[:n], (0, 0, 0, nb * block - n)).view(nb, block, d)
        cols = F.pad(v[:n], (0, 0, block, (nb + span - 2) * block - n)).unfold(0, span * block, block)
        return rows @ cols  # cols: (nb, d', span·b)
    t, tk = band_positions(n, block, w.device, causal)
    return w[t.clamp(max=n - 1), tk.clamp(0, n - 1)]


def banded_sums(
    k: Tensor, v: Tensor, w_band: Tensor, window: int, outside_zero: bool, causal: bool = True
) -> tuple[Tensor, Tensor]:
    """Max-shifted numerator and denominator (B, T, C) of AFT-local (paper Eq. 2 with ``w[t, t'] = 0``, or
    -inf, for ``|t - t'| >= window``; ``causal``: t' <= t only); their ratio is the weighted average.
    O(T·b·C) time and memory.

    ``k, v`` (B, T, C) fp32; ``w_band`` (nb, b, 2b or 3b) the raw bias on the band of :func:`band_positions`
    with ``b >= window``. Block i's queries meet blocks i-1, i (and i+1 unless causal) through a band of
    weights ``e^{w - c_t}`` (c_t = the row maximum; w = 0 for the pairs of these blocks outside the window);
    blocks <= i-2 (and >= i+2) lie wholly outside the window and enter with weight ``e^{-c_t}`` through
    cumulative sums of block sums.
    """
    if torch.jit.is_tracing() and torch.onnx.is_in_onnx_export():  # eager: the first test is False
        # that exporter has no unfold of a tensor whose size it does not track (the band's windows), and with
        # the windows copied instead it breaks the band's broadcasts: refused here rather than fail inside torch
        raise ValueError(
            "AFT-local does not export with the TorchScript-based ONNX exporter (torch.onnx.export(..., "
            "dynamo=False)): export with the default exporter (dynamo=True), as `vitlab export` does"
        )
    bsz, n, c = k.shape
    nb, block = w_band.shape[:2]
    span = _span(causal)
    masks = _band_masks.__wrapped__ if torch.compiler.is_compiling() else _band_masks  # compile: traced, not cached
    inside, fill = masks(n, block, window, outside_zero, k.device, causal)
    w = torch.where(inside, w_band, fill)  # -inf before exp: no inf * 0 in the backward pass
    # the row maximum: finite (t' = t is always inside), >= 0 whenever the row has pairs outside the window
    shift = w.detach().amax(-1, keepdim=True)  # (nb, b, 1)
    e = (w - shift).exp()  # (nb, b, span·b)
    ek = (k - k.detach().amax(1, keepdim=True)).exp()
    # token-major (T, B·2C): one (b x span·b) @ (span·b x B·2C) product per block for the whole batch
    ctx = torch.cat([ek * v, ek], -1).transpose(0, 1).reshape(n, bsz * 2 * c)
    x = F.pad(ctx, (0, 0, block, (nb + span - 2) * block - n))  # a zero block first (and last)
    keys = x.unfold(0, span * block, block).transpose(1, 2)  # (nb, span·b, B·2C) view: blocks i-1 .. of block i
    out = torch.bmm(e, keys)  # (nb, b, B·2C)
    if outside_zero and nb > 2:
        sums = x[block : (nb + 1) * block].view(nb, block, -1).sum(1)  # (nb, B·2C) block sums
        far = F.pad(sums[: nb - 2].cumsum(0), (0, 0, 2, 0))  # block i: Σ over blocks <= i - 2
        if not causal:  # block i: Σ over blocks >= i + 2
            far = far + F.pad(sums[2:].flip(0).cumsum(0).flip(0), (0, 0, 0, 2))
        # rows with such blocks have pairs outside the window in the band (c_t >= 0, scale <= 1); the others
        # have far = 0 and may have c_t << 0
        out = out + (-shift.clamp_min(0)).exp() * far[:, None]
    num, den = out.view(nb * block, bsz, 2 * c)[:n].transpose(0, 1).split(c, -1)
    return num, den


def banded_flops(batch: int, tokens: int, channels: int, block: int, causal: bool = True) -> int:
    """Elementwise FLOPs of AFT-local on its band (:func:`vitlab.ops.aft.aft_local_banded`; the band products
    are MACs): ``e^{w - max}`` 3 per band entry (``nb`` blocks of ``b x 2b``, non-causal ``b x 3b``),
    ``e^{K - max}`` 3 and ``e^K ⊙ V`` 1 per element, the prefix of the pairs outside the window (block sums,
    cumulative sum, scale, add) 6 per output element of numerator and denominator together, then divide 1,
    ``sigmoid(Q)`` 3 and the gate 1. Non-causal also: the third band product's add 2 per output element, and per
    block the suffix's reversed cumulative sum and its add to the prefix (2 per block and element of the 2C
    channels)."""
    nb = -(-tokens // block)
    if causal:
        return 15 * batch * tokens * channels + 6 * nb * block * block
    return 17 * batch * tokens * channels + 4 * batch * nb * channels + 9 * nb * block * block
