"""AFT-simple (paper §3.2, Eq. 2 with w = 0) as Triton kernels, forward and backward, causal and not.

Per channel, ``Y_t = σ(Q_t) ⊙ r_t`` with ``r_t = Σ_t' e^{K_t'} V_t' / Σ_t' e^{K_t'}`` over all t' (non-causal)
or t' <= t (causal). Each program owns a batch row and a block of channels and walks the tokens in chunks,
keeping for every channel the state ``(m, n, d)`` of a log-sum-exp: the running maximum m of the keys and the
sums ``n = Σ e^{K - m} V``, ``d = Σ e^{K - m}``. Two states combine as

    (m1, n1, d1) ⊕ (m2, n2, d2) = (m, n1 e^{m1-m} + n2 e^{m2-m}, d1 e^{m1-m} + d2 e^{m2-m}),  m = max(m1, m2)

(associative and commutative), so a causal chunk is one associative scan plus the carry of the chunks before.
The maximal key of every sum contributes e^0: ``d >= 1``, nothing underflows whatever the keys' magnitude, and no
entry needs a repair. Accumulation is fp32 for bf16, fp16 and fp32 inputs.

Backward, with ``g_t = ∂L/∂Y_t ⊙ σ(Q_t) / d_t`` and ``h_t = g_t ⊙ r_t`` (m_t, d_t, r_t of query t)::

    ∂L/∂Q_t = ∂L/∂Y_t ⊙ r_t σ(Q_t)(1 - σ(Q_t))
    ∂L/∂V_t' = Σ_{t ∋ t'} e^{K_t' - m_t} g_t,     ∂L/∂K_t' = Σ_{t ∋ t'} e^{K_t' - m_t} (g_t V_t' - h_t)

Non-causal, ``m_t, d_t, r_t`` are the same for every t (two passes: the sums, then the elementwise terms).
Causal, the sums over t >= t' run backwards through the chunks as a reverse scan of ``(-m_t, g_t, h_t)``
with the same combine (``-m`` is largest at t = t', so every factor ``e^{K_t' - m_t}`` stays <= 1); a chunk's
forward states are recomputed from the carry saved at its start (the forward pass keeps three (B, chunks, C)
carries, not the (B, T, C) intermediates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from .triton_support import launch

# a padded token's key: its weight e^{_PAD - m} is 0 for any real m, and (unlike -inf) _PAD - _PAD is 0, not NaN
_PAD = tl.constexpr(-1.0e30)


@triton.jit
def _lse_combine(m1, n1, d1, m2, n2, d2):
    m = tl.maximum(m1, m2)
    a, b = tl.exp(m1 - m), tl.exp(m2 - m)
    return m, n1 * a + n2 * b, d1 * a + d2 * b


@triton.jit
def _chunk(ptr, s_b, s_t, b, t, c, T, C, other):
    """Pointers and mask of the (BT, BC) tile of tokens t and channels c of batch row b."""
    mask = (t[:, None] < T) & (c[None, :] < C)
    x = tl.load(ptr + b * s_b + t[:, None] * s_t + c[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, x, other)  # after the cast: _PAD has no bf16/fp16 value


@triton.jit
def _reduce(m, n, d, x, y):
    """The state ``(m, n, d)`` combined with a chunk's log-sum-exp sums of ``e^x y`` and ``e^x`` over its tokens."""
    cm = tl.max(x, 0)
    e = tl.exp(x - cm[None, :])
    return _lse_combine(m, n, d, cm, tl.sum(e * y, 0), tl.sum(e, 0))


@triton.jit
def _prefix(m, n, d, k, v):
    """The causal states of every token of a chunk: the scan of ``(K_t, V_t, 1)`` after the carry ``(m, n, d)``."""
    sm, sn, sd = tl.associative_scan((k, v, tl.full(k.shape, 1.0, tl.float32)), 0, _lse_combine)
    return _lse_combine(m[None, :], n[None, :], d[None, :], sm, sn, sd)


@triton.jit
def _simple_fwd(Q, K, V, Y, CM, CN, CD, s_b, s_t, y_b, y_t, T, C, n_chunks,
                CAUSAL: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    b, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    cmask = c < C
    m = tl.full((BC,), _PAD, tl.float32)
    n = tl.zeros((BC,), tl.float32)
    d = tl.zeros((BC,), tl.float32)
    for i in range(n_chunks):
        t = i * BT + tl.arange(0, BT)
        k = _chunk(K, s_b, s_t, b, t, c, T, C, _PAD)
        v = _chunk(V, s_b, s_t, b, t, c, T, C, 0.0)
        if CAUSAL:  # the carry before the chunk, saved for the backward pass, then the chunk's outputs
            at = (b * n_chunks + i) * C + c
            tl.store(CM + at, m, mask=cmask)
            tl.store(CN + at, n, mask=cmask)
            tl.store(CD + at, d, mask=cmask)
            _, sn, sd = _prefix(m, n, d, k, v)
            sig = tl.sigmoid(_chunk(Q, s_b, s_t, b, t, c, T, C, 0.0))
            _store(Y, y_b, y_t, b, t, c, (t[:, None] < T) & cmask[None, :], sig * sn / sd)
        m, n, d = _reduce(m, n, d, k, v)
    if not CAUSAL:  # the context r = n / d, then the gate of every token
        r = n / d
        tl.store(CM + b * C + c, m, mask=cmask)
        tl.store(CN + b * C + c, r, mask=cmask)
        tl.store(CD + b * C + c, d, mask=cmask)
        for i in range(n_chunks):
            t = i * BT + tl.arange(0, BT)
            sig = tl.sigmoid(_chunk(Q, s_b, s_t, b, t, c, T, C, 0.0))
            _store(Y, y_b, y_t, b, t, c, (t[:, None] < T) & cmask[None, :], sig * r[None, :])


@triton.jit
def _causal_bwd(Q, K, V, GY, GQ, GK, GV, CM, CN, CD, s_b, s_t, g_b, g_t, o_b, o_t, T, C, n_chunks,
                BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    b, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    cmask = c < C
    mu = tl.full((BC,), _PAD, tl.float32)  # the reverse carry over the later tokens: max of -m, Σ g, Σ h
    sg = tl.zeros((BC,), tl.float32)
    sh = tl.zeros((BC,), tl.float32)
    for j in range(n_chunks):
        i = n_chunks - 1 - j
        t = i * BT + tl.arange(0, BT)
        mask = (t[:, None] < T) & cmask[None, :]
        k = _chunk(K, s_b, s_t, b, t, c, T, C, _PAD)
        v = _chunk(V, s_b, s_t, b, t, c, T, C, 0.0)
        sig = tl.sigmoid(_chunk(Q, s_b, s_t, b, t, c, T, C, 0.0))
        gy = _chunk(GY, g_b, g_t, b, t, c, T, C, 0.0)
        at = (b * n_chunks + i) * C + c
        m0 = tl.load(CM + at, mask=cmask, other=_PAD)
        n0 = tl.load(CN + at, mask=cmask, other=0.0)
        d0 = tl.load(CD + at, mask=cmask, other=0.0)
        fm, fn, fd = _prefix(m0, n0, d0, k, v)  # the forward states, recomputed
        fd = tl.where(mask, fd, 1.0)
        r = fn / fd
        g = tl.where(mask, gy * sig / fd, 0.0)
        neg_m = tl.where(mask, -fm, _PAD)
        rm, rg, rh = tl.associative_scan((neg_m, g, g * r), 0, _lse_combine, reverse=True)
        rm, rg, rh = _lse_combine(mu[None, :], sg[None, :], sh[None, :], rm, rg, rh)
        mu, sg, sh = _lse_combine(mu, sg, sh, *_reduce_pair(neg_m, g, g * r))
        e = tl.exp(k + rm)  # e^{K_t' - m_t'} <= 1
        _store(GQ, o_b, o_t, b, t, c, mask, gy * r * sig * (1.0 - sig))
        _store(GV, o_b, o_t, b, t, c, mask, e * rg)
        _store(GK, o_b, o_t, b, t, c, mask, e * (v * rg - rh))


@triton.jit
def _reduce_pair(x, y1, y2):
    """A chunk's log-sum-exp state of the sums of ``e^x y1`` and ``e^x y2`` over its tokens."""
    cm = tl.max(x, 0)
    e = tl.exp(x - cm[None, :])
    return cm, tl.sum(e * y1, 0), tl.sum(e * y2, 0)


@triton.jit
def _global_bwd(Q, K, V, GY, GQ, GK, GV, CM, CN, CD, s_b, s_t, g_b, g_t, o_b, o_t, T, C, n_chunks,
                BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    b, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    cmask = c < C
    m = tl.load(CM + b * C + c, mask=cmask, other=0.0)
    r = tl.load(CN + b * C + c, mask=cmask, other=0.0)
    d = tl.load(CD + b * C + c, mask=cmask, other=1.0)
    gs = tl.zeros((BC,), tl.float32)  # Σ_t ∂L/∂Y_t σ(Q_t)
    for i in range(n_chunks):
        t = i * BT + tl.arange(0, BT)
        sig = tl.sigmoid(_chunk(Q, s_b, s_t, b, t, c, T, C, 0.0))
        gs += tl.sum(_chunk(GY, g_b, g_t, b, t, c, T, C, 0.0) * sig, 0)
    g = gs / d
    for i in range(n_chunks):
        t = i * BT + tl.arange(0, BT)
        mask = (t[:, None] < T) & cmask[None, :]
        k = _chunk(K, s_b, s_t, b, t, c, T, C, _PAD)
        v = _chunk(V, s_b, s_t, b, t, c, T, C, 0.0)
        sig = tl.sigmoid(_chunk(Q, s_b, s_t, b, t, c, T, C, 0.0))
        gy = _chunk(GY, g_b, g_t, b, t, c, T, C, 0.0)
        pg = tl.exp(k - m[None, :]) * g[None, :]
        _store(GQ, o_b, o_t, b, t, c, mask, gy * r[None, :] * sig * (1.0 - sig))
        _store(GV, o_b, o_t, b, t, c, mask, pg)
        _store(GK, o_b, o_t, b, t, c, mask, pg * (v - r[None, :]))


@triton.jit
def _store(ptr, s_b, s_t, b, t, c, mask, x):
    tl.store(ptr + b * s_b + t[:, None] * s_t + c[None, :], x, mask=mask)


def _blocks(qkv: Tensor) -> tuple[int, int]:
    """Token chunk and channel block of the programs; the interpreter (CPU tensors) takes the smallest chunks, so
    that the tests' short sequences span several."""
    t, c = qkv.shape[1], qkv.shape[2] // 3
    bt = 64 if t > 32 and qkv.device.type != "cpu" else 16
    return bt, min(32, max(16, triton.next_power_of_2(c)))


def _launch(kernel, qkv: Tensor, extra: tuple, causal: bool | None, out: Tensor, carries: tuple) -> None:
    q, k, v = qkv.chunk(3, -1)
    b, t, c = q.shape
    bt, bc = _blocks(qkv)
    flag = () if causal is None else (causal,)
    launch(
        kernel, (b, triton.cdiv(c, bc)),
        q, k, v, *extra, *carries, qkv.stride(0), qkv.stride(1), *_strides(extra, out), t, c, triton.cdiv(t, bt),
        *flag, BT=bt, BC=bc,
    )  # fmt: skip


def _strides(extra: tuple, out: Tensor) -> tuple[int, ...]:
    """Batch and token strides of the output (forward) or of the incoming gradient and the gradient buffer."""
    if len(extra) == 1:
        return out.stride(0), out.stride(1)
    gy = extra[0]
    return gy.stride(0), gy.stride(1), out.stride(0), out.stride(1)


class _AFTSimpleTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, causal: bool) -> Tensor:
        b, t, c3 = qkv.shape
        c = c3 // 3
        y = qkv.new_empty(b, t, c, dtype=torch.float32)
        n_chunks = triton.cdiv(t, _blocks(qkv)[0]) if causal else 1
        carries = tuple(qkv.new_empty(b, n_chunks, c, dtype=torch.float32) for _ in range(3))
        _launch(_simple_fwd, qkv, (y,), causal, y, carries)
        ctx.causal = causal
        ctx.save_for_backward(qkv, *carries)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: Tensor) -> tuple[Tensor, None]:
        qkv, *carries = ctx.saved_tensors
        gy = gy if gy.stride(-1) == 1 else gy.contiguous()
        grad = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        kernel = _causal_bwd if ctx.causal else _global_bwd
        _launch(kernel, qkv, (gy, *grad.chunk(3, -1)), None, grad, tuple(carries))
        return grad, None


def aft_simple_triton(qkv: Tensor, causal: bool = False) -> Tensor:
    """AFT-simple, ``σ(Q_t) ⊙ Σ_{t'} softmax_{t'}(K)_{t'} V_{t'}`` (causal: t' <= t), from the fused projection
    ``qkv`` (B, T, 3C) = ``[Q | K | V]`` of any float dtype (token-contiguous channels); fp32 (B, T, C).
    Exact for keys of any magnitude (this module's docstring); the gradient of ``qkv`` comes in one buffer."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    return _AFTSimpleTriton.apply(qkv, causal)
