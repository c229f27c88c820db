"""External attention's double normalisation as one Triton kernel per direction (GPU; CPU under the interpreter).

The map is ``y = a / n`` with ``a = softmax_tokens(x)`` and ``n = Σ_slots a + eps`` (:mod:`.double_norm`). The
logits are read as (P, T, Q, S): P and Q independent axes, T the tokens, S the memory slots (last axis). One
program owns one (p, q) column block of all T rows and all S slots and walks the tokens twice:

* forward: (1) an online max/sum over the tokens gives each slot's log-sum-exp ``ℓ = log Σ_t exp x``;
  (2) per token row ``a = exp(x - ℓ)``, ``n = Σ_s a + eps``, ``y = a / n`` is written once in the input dtype;
* backward (:class:`~.double_norm._DoubleNormalize`'s formula ``∂x = u - y n Σ_t u``, ``u = (gy - Σ_s gy y) y``):
  (1) ``c = Σ_t u`` per slot; (2) ``∂x = u - y n c`` per row, written once.

``y`` is recomputed from the logits and ``ℓ`` (saved: the logits in their dtype, ℓ per slot and n per row, in
fp32), so no fp32 map is ever stored and half-precision maps keep fp32 accuracy. Every sum accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

#: the most memory slots one program holds in registers (a whole row of the map)
MAX_SLOTS = 4096
_TILE = 4096  # elements of one (tokens x slots) tile


@triton.jit
def _forward_kernel(
    x_ptr, y_ptr, lse_ptr, n_ptr, T, Q, S, eps, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, SAVE: tl.constexpr
):
    pid = tl.program_id(0)
    p, q = pid // Q, pid % Q
    base = p * T * Q * S + q * S
    s = tl.arange(0, BLOCK_S)
    s_ok = s < S
    t0 = tl.arange(0, BLOCK_T)
    m = tl.full((BLOCK_S,), -3.0e38, tl.float32)
    z = tl.zeros((BLOCK_S,), tl.float32)
    for start in range(0, T, BLOCK_T):  # (1) log-sum-exp of every slot over the tokens, online
        t = start + t0
        ok = (t < T)[:, None] & s_ok[None, :]
        x = tl.load(x_ptr + base + t[:, None] * (Q * S) + s[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        z = z * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[None, :]), axis=0)
        m = m_new
    lse = tl.where(s_ok, m + tl.log(tl.where(s_ok, z, 1.0)), 0.0)
    if SAVE:
        tl.store(lse_ptr + pid * S + s, lse, mask=s_ok)
    for start in range(0, T, BLOCK_T):  # (2) softmax, then the l1 step over the slots of each token
        t = start + t0
        t_ok = t < T
        ok = t_ok[:, None] & s_ok[None, :]
        offs = base + t[:, None] * (Q * S) + s[None, :]
        x = tl.load(x_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32)
        a = tl.exp(x - lse[None, :])
        n = tl.sum(a, axis=1) + eps
        tl.store(y_ptr + offs, (a / n[:, None]).to(y_ptr.dtype.element_ty), mask=ok)
        if SAVE:
            tl.store(n_ptr + (p * T + t) * Q + q, n, mask=t_ok)


@triton.jit
def _backward_kernel(x_ptr, g_ptr, lse_ptr, n_ptr, dx_ptr, T, Q, S, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    p, q = pid // Q, pid % Q
    base = p * T * Q * S + q * S
    s = tl.arange(0, BLOCK_S)
    s_ok = s < S
    t0 = tl.arange(0, BLOCK_T)
    lse = tl.load(lse_ptr + pid * S + s, mask=s_ok, other=0.0)
    c = tl.zeros((BLOCK_S,), tl.float32)
    for phase in tl.static_range(2):  # (1) c = Σ_t u per slot; (2) ∂x = u - y n c per token row
        for start in range(0, T, BLOCK_T):
            t = start + t0
            t_ok = t < T
            ok = t_ok[:, None] & s_ok[None, :]
            offs = base + t[:, None] * (Q * S) + s[None, :]
            x = tl.load(x_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32)
            g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            n = tl.load(n_ptr + (p * T + t) * Q + q, mask=t_ok, other=1.0)
            y = tl.exp(x - lse[None, :]) / n[:, None]
            u = (g - tl.sum(g * y, axis=1)[:, None]) * y
            if phase == 0:
                c += tl.sum(u, axis=0)
            else:
                dx = u - y * n[:, None] * c[None, :]
                tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=ok)


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


def _geometry(logits: Tensor, token_dim: int) -> tuple[int, int, int, int, int, int]:
    """(P, T, Q, S, BLOCK_T, BLOCK_S) of the logits read as (P, T, Q, S)."""
    shape = logits.shape
    token_dim %= len(shape)
    p = int(torch.Size(shape[:token_dim]).numel())
    q = int(torch.Size(shape[token_dim + 1 : -1]).numel())
    block_s = triton.next_power_of_2(shape[-1])
    block_t = max(1, min(triton.next_power_of_2(shape[token_dim]), _TILE // block_s))
    return p, shape[token_dim], q, shape[-1], block_t, block_s


class TritonDoubleNormalize(torch.autograd.Function):
    """The double normalisation of :func:`double_normalize_triton`, differentiable (saves the logits, ℓ, n)."""

    @staticmethod
    def forward(ctx, logits: Tensor, token_dim: int, eps: float) -> Tensor:
        x = logits.contiguous()
        p, t, q, s, block_t, block_s = _geometry(x, token_dim)
        y = torch.empty_like(x)
        lse = torch.empty(p * q, s, device=x.device, dtype=torch.float32)
        n = torch.empty(p, t, q, device=x.device, dtype=torch.float32)
        _forward_kernel[(p * q,)](x, y, lse, n, t, q, s, eps, BLOCK_T=block_t, BLOCK_S=block_s, SAVE=True)
        ctx.save_for_backward(x, lse, n)
        ctx.token_dim = token_dim
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, lse, n = ctx.saved_tensors
        p, t, q, s, block_t, block_s = _geometry(x, ctx.token_dim)
        dx = torch.empty_like(x)
        _backward_kernel[(p * q,)](x, grad.contiguous(), lse, n, dx, t, q, s, BLOCK_T=block_t, BLOCK_S=block_s)
        return dx, None, None


def double_normalize_triton(logits: Tensor, token_dim: int, eps: float, inplace: bool = False) -> Tensor:
    """Softmax over ``token_dim``, then ℓ1 over the last axis (+ ``eps``), in the input's dtype with fp32 sums
    (:func:`supports` says which logits). Differentiable; ``inplace`` (no autograd) writes over ``logits``."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return TritonDoubleNormalize.apply(logits, token_dim, eps)
    x = logits if inplace and logits.is_contiguous() else logits.contiguous()
    p, t, q, s, block_t, block_s = _geometry(x, token_dim)
    y = x if inplace else torch.empty_like(x)
    _forward_kernel[(p * q,)](x, y, x, x, t, q, s, eps, BLOCK_T=block_t, BLOCK_S=block_s, SAVE=False)
    if inplace and y.data_ptr() != logits.data_ptr():
        logits.copy_(y)
        return logits
    return y
