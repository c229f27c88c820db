"""External attention's double normalisation in Triton, two kernels each way (GPU; CPU under the interpreter).

The map is ``y = a / n`` with ``a = softmax_tokens(x)`` and ``n = Σ_slots a + eps`` (:mod:`.double_norm`). The
logits are read as (P, T, Q, S): P and Q independent axes, T the tokens, S the memory slots (last axis, all of
them in one tile row). A column pass reduces over the tokens, a row pass over the slots:

* forward: (1) :func:`_columns_kernel` gives every slot's log-sum-exp ``ℓ = log Σ_t exp x`` (an online max and sum
  per chunk of tokens, the chunks combined in PyTorch: enough programs for the GPU however few columns there are);
  (2) :func:`_rows_kernel` computes ``a = exp(x - ℓ)``, ``n = Σ_s a + eps`` and writes ``y = a / n`` once, in the
  input dtype;
* backward (:class:`~.double_norm._DoubleNormalize`'s formula ``∂x = u - y n Σ_t u``, ``u = (gy - Σ_s gy y) y``):
  (1) ``c = Σ_t u`` per slot by the column kernel; (2) ``∂x = u - y n c`` by the row kernel, written once.

``y`` is recomputed from the logits and ``ℓ`` (saved: the logits in their dtype, ℓ per slot and n per row, in
fp32), so no fp32 map is ever stored and half-precision maps keep fp32 accuracy. Every sum accumulates in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_support import launch

#: the most memory slots one program holds in registers (a whole row of the map)
MAX_SLOTS = 4096
_TILE = 4096  # elements of one (tokens x slots) tile


_TARGET_PROGRAMS = 1024  # programs of a column pass: the token chunks per column make up this many


@triton.jit
def _columns_kernel(
    x_ptr, g_ptr, lse_ptr, n_ptr, out_ptr, out2_ptr, T, Q, S, ROWS, CHUNKS,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, GRAD: tl.constexpr,
):  # fmt: skip
    """Per slot, over the tokens of one chunk (``ROWS`` of them) of one (p, q) column block: the max and the sum
    of ``exp(x - max)`` (forward), or ``Σ_t u`` (``GRAD``)."""
    pid, chunk = tl.program_id(0), tl.program_id(1)
    p, q = pid // Q, pid % Q
    base = p * T * Q * S + q * S
    s = tl.arange(0, BLOCK_S)
    s_ok = s < S
    m = tl.full((BLOCK_S,), -3.0e38, tl.float32)
    acc = tl.zeros((BLOCK_S,), tl.float32)
    if GRAD:
        lse = tl.load(lse_ptr + pid * S + s, mask=s_ok, other=0.0)
    for start in range(chunk * ROWS, tl.minimum(T, chunk * ROWS + ROWS), BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        t_ok = t < T
        ok = t_ok[:, None] & s_ok[None, :]
        offs = base + t[:, None] * (Q * S) + s[None, :]
        x = tl.load(x_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32)
        if GRAD:
            g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            n = tl.load(n_ptr + (p * T + t) * Q + q, mask=t_ok, other=1.0)
            y = tl.exp(x - lse[None, :]) / n[:, None]
            acc += tl.sum((g - tl.sum(g * y, axis=1)[:, None]) * y, axis=0)
        else:
            m_new = tl.maximum(m, tl.max(x, axis=0))
            acc = acc * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[None, :]), axis=0)
            m = m_new
    out = (pid * CHUNKS + chunk) * S + s
    tl.store(out_ptr + out, acc, mask=s_ok)
    if not GRAD:
        tl.store(out2_ptr + out, m, mask=s_ok)


@triton.jit
def _rows_kernel(
    x_ptr, g_ptr, lse_ptr, n_ptr, c_ptr, out_ptr, T, Q, S, eps,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, GRAD: tl.constexpr, SAVE: tl.constexpr,
):  # fmt: skip
    """Per token row of one block of one (p, q) column block: ``y`` (and ``n`` when ``SAVE``), or ``∂x``."""
    pid, block = tl.program_id(0), tl.program_id(1)
    p, q = pid // Q, pid % Q
    s = tl.arange(0, BLOCK_S)
    s_ok = s < S
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    ok = t_ok[:, None] & s_ok[None, :]
    offs = p * T * Q * S + q * S + t[:, None] * (Q * S) + s[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32)
    lse = tl.load(lse_ptr + pid * S + s, mask=s_ok, other=0.0)
    a = tl.exp(x - lse[None, :])
    if GRAD:
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        n = tl.load(n_ptr + (p * T + t) * Q + q, mask=t_ok, other=1.0)
        c = tl.load(c_ptr + pid * S + s, mask=s_ok, other=0.0)
        y = a / n[:, None]
        u = (g - tl.sum(g * y, axis=1)[:, None]) * y
        tl.store(out_ptr + offs, (u - y * n[:, None] * c[None, :]).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        n = tl.sum(a, axis=1) + eps
        tl.store(out_ptr + offs, (a / n[:, None]).to(out_ptr.dtype.element_ty), mask=ok)
        if SAVE:
            tl.store(n_ptr + (p * T + t) * Q + q, n, mask=t_ok)


def supports(logits: Tensor, token_dim: int, memory_dim: int) -> bool:
    """Whether the kernels take these logits: the slots on the last axis (at most :data:`MAX_SLOTS`), the tokens
    before them, a floating dtype the kernels read (fp16, bf16, fp32)."""
    nd = logits.dim()
    return (
        memory_dim % nd == nd - 1
        and token_dim % nd < nd - 1
        and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and 0 < logits.shape[-1] <= MAX_SLOTS
        and 0 < logits.numel() < 2**31  # int32 offsets in the kernels
    )


class _Geometry(NamedTuple):
    """The logits read as (P, T, Q, S), the tile (BLOCK_T rows of BLOCK_S slots), and the column passes' token
    chunks (CHUNKS of ROWS tokens per column block)."""

    p: int
    t: int
    q: int
    s: int
    block_t: int
    block_s: int
    rows: int
    chunks: int

    @staticmethod
    def of(logits: Tensor, token_dim: int) -> _Geometry:
        shape = logits.shape
        token_dim %= len(shape)
        p = int(torch.Size(shape[:token_dim]).numel())
        q = int(torch.Size(shape[token_dim + 1 : -1]).numel())
        t, s = shape[token_dim], shape[-1]
        block_s = triton.next_power_of_2(s)
        block_t = max(1, min(triton.next_power_of_2(t), _TILE // block_s))
        chunks = max(1, min(triton.cdiv(t, block_t), _TARGET_PROGRAMS // (p * q)))
        rows = triton.cdiv(triton.cdiv(t, chunks), block_t) * block_t
        return _Geometry(p, t, q, s, block_t, block_s, rows, triton.cdiv(t, rows))

    def columns(self, x: Tensor, g: Tensor | None, lse: Tensor | None, n: Tensor | None) -> tuple[Tensor, Tensor]:
        """The column pass: (sum of exp(x - max), max) per chunk and slot, or (Σ_t u per chunk and slot, unused)."""
        part = torch.empty(2, self.p * self.q, self.chunks, self.s, device=x.device, dtype=torch.float32)
        grad = g is not None
        g, lse, n = (g, lse, n) if grad else (x, x, x)  # unread without GRAD
        launch(
            _columns_kernel, (self.p * self.q, self.chunks),
            x, g, lse, n, part[0], part[1], self.t, self.q, self.s, self.rows, self.chunks,
            BLOCK_T=self.block_t, BLOCK_S=self.block_s, GRAD=grad,
        )  # fmt: skip
        return part[0], part[1]

    def rows_pass(self, x: Tensor, out: Tensor, lse: Tensor, n: Tensor | None, eps: float = 0.0, **grad) -> None:
        """The row pass: ``y`` (and ``n`` into ``n`` when given), or ``∂x`` with ``grad = dict(g=..., c=...)``."""
        g, c = grad.get("g", x), grad.get("c", lse)
        launch(
            _rows_kernel, (self.p * self.q, triton.cdiv(self.t, self.block_t)),
            x, g, lse, x if n is None else n, c, out, self.t, self.q, self.s, eps,
            BLOCK_T=self.block_t, BLOCK_S=self.block_s, GRAD=bool(grad), SAVE=n is not None,
        )  # fmt: skip


def _log_sum_exp(x: Tensor, geo: _Geometry) -> Tensor:
    """ℓ per (column block, slot), fp32, from the column pass's per-chunk sums and maxima."""
    z, m = geo.columns(x, None, None, None)
    top = m.amax(1, keepdim=True)
    return ((z * (m - top).exp()).sum(1, keepdim=True).log() + top).squeeze(1).contiguous()


class TritonDoubleNormalize(torch.autograd.Function):
    """The double normalisation of :func:`double_normalize_triton`, differentiable (saves the logits, ℓ, n)."""

    @staticmethod
    def forward(ctx, logits: Tensor, token_dim: int, eps: float) -> Tensor:
        x = logits.contiguous()
        geo = _Geometry.of(x, token_dim)
        y = torch.empty_like(x)
        lse = _log_sum_exp(x, geo)
        n = torch.empty(geo.p, geo.t, geo.q, device=x.device, dtype=torch.float32)
        geo.rows_pass(x, y, lse, n, eps)
        ctx.save_for_backward(x, lse, n)
        ctx.geo = geo
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, lse, n = ctx.saved_tensors
        geo, g = ctx.geo, grad.contiguous()
        c = geo.columns(x, g, lse, n)[0].sum(1).contiguous()
        dx = torch.empty_like(x)
        geo.rows_pass(x, dx, lse, n, g=g, c=c)
        return dx, None, None


def double_normalize_triton(logits: Tensor, token_dim: int, eps: float, inplace: bool = False) -> Tensor:
    """Softmax over ``token_dim``, then ℓ1 over the last axis (+ ``eps``), in the input's dtype with fp32 sums
    (:func:`supports` says which logits). Differentiable; ``inplace`` (no autograd) writes over ``logits``."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return TritonDoubleNormalize.apply(logits, token_dim, eps)
    x = logits if inplace and logits.is_contiguous() else logits.contiguous()
    geo = _Geometry.of(x, token_dim)
    y = x if inplace else torch.empty_like(x)
    geo.rows_pass(x, y, _log_sum_exp(x, geo), None, eps)  # each row is read before it is written
    if inplace and y.data_ptr() != logits.data_ptr():
        logits.copy_(y)
        return logits
    return y
