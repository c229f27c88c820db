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
import torch.nn.functional as F
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


class _AFTSimpleProjected(torch.autograd.Function):
    """The projection ``[Q | K | V] = x Wᵀ + b`` and the core in one function, the three products kept apart
    (:func:`aft_simple_projected`)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        wq, wk, wv = weight.chunk(3)  # row blocks of a contiguous weight: contiguous
        bq, bk, bv = (None, None, None) if bias is None else bias.chunk(3)
        p = F.linear(x, wk, bk)
        p.sub_(p.amax(1, keepdim=True)).exp_()
        p.div_(p.sum(1, keepdim=True))  # softmax_t(K) in the keys' own buffer
        v = F.linear(x, wv, bv)
        s = torch.mul(p, v).sum(1, keepdim=True)
        sig = F.linear(x, wq, bq).sigmoid_()
        ctx.save_for_backward(x, weight, sig, p, v, s)
        ctx.has_bias = bias is not None
        return torch.mul(sig, s)

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight, sig, p, v, s = ctx.saved_tensors
        c = sig.shape[-1]
        x2 = x.reshape(-1, x.shape[-1])
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = torch.empty_like(x2) if need_x else None
        gw = torch.empty_like(weight) if need_w else None
        gb = weight.new_empty(3 * c) if ctx.has_bias and ctx.needs_input_grad[2] else None

        def project_back(i: int, g: Tensor) -> None:
            """Block i's gradient (B, T, C) into the weight's, the bias's and the input's gradients."""
            g, rows = g.reshape(-1, c), slice(i * c, (i + 1) * c)
            if gw is not None:
                torch.mm(g.t(), x2, out=gw[rows])
            if gb is not None:
                torch.sum(g, 0, out=gb[rows])
            if gx is not None:
                torch.mm(g, weight[rows], out=gx) if i == 0 else gx.addmm_(g, weight[rows])

        # one block's gradient alive at a time, each freed before the next is formed
        gq = torch.mul(gy, sig)
        gs = gq.sum(1, keepdim=True)
        project_back(0, torch.ops.aten.sigmoid_backward.grad_input(torch.mul(gy, s, out=gq), sig, grad_input=gq))
        del gq
        project_back(1, torch.sub(v, s).mul_(p).mul_(gs))
        project_back(2, torch.mul(p, gs))
        return (None if gx is None else gx.view_as(x)), gw, gb


def aft_simple_projected(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Non-causal AFT-simple of tokens ``x`` (B, T, d) through its fused projection ``weight`` (3C, d) and ``bias``
    (3C): ``sigmoid(Q_t) ⊙ Σ_t' softmax_t'(K)_t' V_t'`` with ``[Q | K | V] = x Wᵀ + b``; (B, T, C).

    The eager training form on the CPU. Q, K and V are three products, each its own contiguous buffer, and the
    sigmoid and the softmax overwrite them: the elementwise passes read contiguous rows (on the fused projection's
    strided thirds the sigmoid ran 2x slower), and what is saved for the backward pass is what it reads, ``σ(Q)``,
    ``softmax_t(K)``, V, s and x: as much memory as the fused projection, with nothing recomputed. The backward pass
    (this module's docstring's gradients) forms one block's gradient at a time and sends it through its third of
    the weight, where the fused form held the whole (B, T, 3C) gradient of the projection."""
    return _AFTSimpleProjected.apply(x, weight, bias)
