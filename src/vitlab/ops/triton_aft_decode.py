"""The one-token decoding step of causal AFT (paper Eq. 2, t' <= t) as Triton kernels: state update and output
read in one pass.

AFT-simple (:class:`~vitlab.ops.aft_decode.RunningSums`): per channel the state ``(m, n, d)`` of a log-sum-exp, the
running maximum m of the keys and ``n = Σ e^{K - m} V``, ``d = Σ e^{K - m}``. Position t's key and value enter as

    m' = max(m, K_t),   n' = n e^{m - m'} + e^{K_t - m'} V_t,   d' = d e^{m - m'} + e^{K_t - m'},   Y_t = σ(Q_t) n' / d'

(the maximal key contributes e^0, so ``d' >= 1``: nothing underflows). One program per batch row and block of
channels; the state is returned in new tensors.

AFT-full/local (:class:`~vitlab.ops.aft_decode.PrefixCache`): the cache holds ``[e^{K - m} V, e^{K - m}]`` of the prefix
with a per-channel reference m. A program owns a batch row and a block of channels: it raises m for the channels
whose new key exceeds it by more than the margin (rescaling those channels' cached terms as it reads them, so the
cached terms stay <= e^margin), writes the new token's terms and raw K, V into the cache, and forms

    num = Σ_{t' <= t} e^{w[t, t'] - max_t' w[t, t']} e^{K_t' - m} V_t',    den = the same without V_t'

over the cache in tiles of tokens. The ratio, its exact float64 recomputation of underflowed denominators and the
gate are the caller's (:func:`vitlab.ops.aft._ratio`), as in the plain step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_support import launch

# the state's maximum before any token: finite, so that _PAD - _PAD is 0, not NaN, and e^{_PAD - K} is 0
_PAD = tl.constexpr(-1.0e30)
_PAD_VALUE = -1.0e30


@triton.jit
def _running_step(Q, K, V, M, NUM, DEN, Y, M_OUT, NUM_OUT, DEN_OUT, in_b, C, BC: tl.constexpr):
    b, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    mask = c < C
    src = b * in_b + c
    q = tl.load(Q + src, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(K + src, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + src, mask=mask, other=0.0).to(tl.float32)
    at = b * C + c
    m = tl.load(M + at, mask=mask, other=0.0)
    m_new = tl.maximum(m, k)
    old, new = tl.exp(m - m_new), tl.exp(k - m_new)
    n = tl.load(NUM + at, mask=mask, other=0.0) * old + new * v
    d = tl.load(DEN + at, mask=mask, other=1.0) * old + new
    tl.store(M_OUT + at, m_new, mask=mask)
    tl.store(NUM_OUT + at, n, mask=mask)
    tl.store(DEN_OUT + at, d, mask=mask)
    tl.store(Y + at, tl.sigmoid(q) * n / d, mask=mask)


@triton.jit
def _row_max(ROW, t, BT: tl.constexpr):
    """The maximum of the bias row ``w[t, :t+1]`` (finite: w[t, t] is never excluded)."""
    top = tl.full((BT,), _PAD, tl.float32)
    for j in range(0, t // BT + 1):
        tk = j * BT + tl.arange(0, BT)
        top = tl.maximum(top, tl.load(ROW + tk, mask=tk <= t, other=_PAD).to(tl.float32))
    return tl.max(top, 0)


@triton.jit
def _prefix_step(K, V, ROW, M, CTX, KC, VC, NUM, DEN, M_OUT, t, in_b, ctx_b, ctx_t, raw_b, raw_t, C, margin,
                 BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    b, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    cmask = c < C
    k = tl.load(K + b * in_b + c, mask=cmask, other=0.0).to(tl.float32)
    v = tl.load(V + b * in_b + c, mask=cmask, other=0.0).to(tl.float32)
    m = tl.load(M + b * C + c, mask=cmask, other=0.0)
    m_new = tl.where(k > m + margin, k, m)  # raised only where the new key would exceed e^margin
    scale = tl.exp(m - m_new)
    rescale = scale < 1.0
    e = tl.exp(k - m_new)
    top = _row_max(ROW, t, BT)
    acc_n = tl.zeros((BC,), tl.float32)
    acc_d = tl.zeros((BC,), tl.float32)
    base = CTX + b * ctx_b
    for j in range(0, tl.cdiv(t, BT)):  # the cached tokens t' < t
        tk = j * BT + tl.arange(0, BT)
        mask = (tk < t)[:, None] & cmask[None, :]
        at = base + tk[:, None] * ctx_t + c[None, :]
        xn = tl.load(at, mask=mask, other=0.0) * scale[None, :]
        xd = tl.load(at + C, mask=mask, other=0.0) * scale[None, :]
        tl.store(at, xn, mask=mask & rescale[None, :])  # the raised channels' terms, rescaled in the cache
        tl.store(at + C, xd, mask=mask & rescale[None, :])
        a = tl.exp(tl.load(ROW + tk, mask=tk < t, other=_PAD).to(tl.float32) - top)
        acc_n += tl.sum(a[:, None] * xn, 0)
        acc_d += tl.sum(a[:, None] * xd, 0)
    a_t = tl.exp(tl.load(ROW + t).to(tl.float32) - top)  # the new token, from registers
    acc_n += a_t * e * v
    acc_d += a_t * e
    tl.store(base + t * ctx_t + c, e * v, mask=cmask)
    tl.store(base + t * ctx_t + C + c, e, mask=cmask)
    tl.store(KC + b * raw_b + t * raw_t + c, k, mask=cmask)
    tl.store(VC + b * raw_b + t * raw_t + c, v, mask=cmask)
    tl.store(NUM + b * C + c, acc_n, mask=cmask)
    tl.store(DEN + b * C + c, acc_d, mask=cmask)
    tl.store(M_OUT + b * C + c, m_new, mask=cmask)


def _channel_block(c: int) -> int:
    return min(128, max(16, triton.next_power_of_2(c)))


def _rows(*xs: Tensor) -> tuple[Tensor, ...]:
    """(B, C) inputs with channels contiguous and one row stride for all."""
    if any(x.stride(-1) != 1 or x.stride(0) != xs[0].stride(0) for x in xs):
        return tuple(x.contiguous() for x in xs)
    return xs


def running_step(
    q: Tensor, k: Tensor, v: Tensor, m: Tensor | None, num: Tensor | None, den: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One causal AFT-simple position: ``q, k, v`` (B, C), the state ``(m, num, den)`` (None before the first
    token). Returns the new state and the output ``σ(Q_t) num / den`` (B, C), fp32."""
    q, k, v = _rows(q, k, v)
    b, c = k.shape
    if m is None:
        m = k.new_full((b, c), _PAD_VALUE, dtype=torch.float32)
        num, den = torch.zeros_like(m), torch.zeros_like(m)
    m, num, den = (x.float().contiguous() for x in (m, num, den))
    out = [torch.empty_like(m) for _ in range(4)]
    bc = _channel_block(c)
    launch(_running_step, (b, triton.cdiv(c, bc)), q, k, v, m, num, den, *out, k.stride(0), c, BC=bc)
    return out[1], out[2], out[3], out[0]


def prefix_step(
    k: Tensor, v: Tensor, row: Tensor, m: Tensor | None, ctx: Tensor, raw_k: Tensor, raw_v: Tensor, t: int,
    margin: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """One causal AFT-full/local position t: ``k, v`` (B, C), the bias row ``w[t, :t+1]``, the per-channel
    reference ``m`` (B, C; None before the first token), the cache ``ctx`` (B, L, 2C) and the raw keys and values
    (B, L, C), updated in place. Returns the new reference and ``num, den`` (B, C) of this module's docstring."""
    k, v = _rows(k, v)
    b, c = k.shape
    m = k.new_full((b, c), _PAD_VALUE, dtype=torch.float32) if m is None else m.float().contiguous()
    m_out, num, den = (torch.empty_like(m) for _ in range(3))
    row = row.contiguous()
    bt, bc = (16, _channel_block(c)) if k.device.type == "cpu" else (64, _channel_block(c))
    strides = (k.stride(0), ctx.stride(0), ctx.stride(1), raw_k.stride(0), raw_k.stride(1))
    launch(_prefix_step, (b, triton.cdiv(c, bc)), k, v, row, m, ctx, raw_k, raw_v, num, den, m_out, t, *strides, c,
           margin, BT=bt, BC=bc)  # fmt: skip
    return m_out, num, den
