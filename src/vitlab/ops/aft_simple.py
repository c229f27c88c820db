"""AFT-simple's non-causal core on the fused ``[Q | K | V]`` projection, with a closed-form backward pass.

AFT-simple (paper §3.2, Eq. 2 with w = 0) is, per channel, ``Y_t = sigmoid(Q_t) ⊙ s`` with the one context vector
``s = Σ_t' p_t' V_t'`` and ``p = softmax_t'(K)``. Through autograd, the composite keeps the softmax's output, the
whole ``[Q | K | V]`` projection (V is a view of it) and the sigmoid's output, and the backward pass of the
projection concatenates three separately allocated gradients. Differentiating by hand:

    gQ = gY ⊙ s ⊙ σ(Q) (1 - σ(Q)),    gs = Σ_t gY_t ⊙ σ(Q_t),
    gV_t = p_t ⊙ gs,                   gK_t = p_t ⊙ gs ⊙ (V_t - s)        (∂s/∂K_t = p_t (V_t - s))

so only the projection and three (B, 1, C) vectors (the keys' maxima, the softmax's denominators and s) are saved;
``σ(Q)`` and ``p`` are recomputed, and the three gradients are written straight into one buffer laid out as the
projection, which is what its own backward pass consumes.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .switch import fx_tracing


def context(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``s = Σ_t softmax_t(K) V_t`` (B, 1, C) from key and value views (B, T, C), with the keys' maxima and the
    shifted softmax denominators it was computed with."""
    m = k.amax(1, keepdim=True)
    e = torch.sub(k, m).exp_()  # one contiguous (B, T, C) buffer, reused for e^K ⊙ V
    den = e.sum(1, keepdim=True)
    s = e.mul_(v).sum(1, keepdim=True).div_(den)
    return s, m, den


class _AFTSimpleQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor) -> Tensor:
        q, k, v = qkv.chunk(3, -1)
        s, m, den = context(k, v)
        ctx.save_for_backward(qkv, s, m, den)
        return torch.sigmoid(q).mul_(s)

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: Tensor) -> Tensor:
        qkv, s, m, den = ctx.saved_tensors
        q, k, v = qkv.chunk(3, -1)
        grad = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        gq, gk, gv = grad.chunk(3, -1)
        sig = torch.sigmoid(q, out=gq)
        gs = torch.mul(gy, sig, out=gk).sum(1, keepdim=True)
        torch.ops.aten.sigmoid_backward.grad_input(torch.mul(gy, s, out=gk), sig, grad_input=gq)
        p = torch.sub(k, m).exp_().div_(den)  # exp on contiguous memory: on a strided view it ran 4x slower here
        torch.sub(v, s, out=gk).mul_(p).mul_(gs)
        torch.mul(p, gs, out=gv)
        return grad


def aft_simple_qkv(qkv: Tensor) -> Tensor:
    """Non-causal AFT-simple, ``sigmoid(Q_t) ⊙ Σ_t' softmax_t'(K)_t' V_t'``, from the fused projection ``qkv``
    (B, T, 3C) = ``[Q | K | V]``; (B, T, C). The same values as :func:`vitlab.ops.aft.aft_simple` on its three
    views, with the lean backward pass of this module's docstring."""
    if not fx_tracing() and torch.is_grad_enabled() and qkv.requires_grad:
        return _AFTSimpleQKV.apply(qkv)
    q, k, v = qkv.chunk(3, -1)
    s = context(k, v)[0]  # its (B, T, C) buffer is freed before the sigmoid's is allocated
    return torch.sigmoid(q).mul_(s)
