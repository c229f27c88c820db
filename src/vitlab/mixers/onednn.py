"""fp32 linear layers for training on the CPU with every product in oneDNN's GEMM, as operators of their own.

PyTorch multiplies fp32 matrices on the CPU through its BLAS (MKL in the official wheels), whose AVX-512 kernels
are dispatched on Intel CPUs only; oneDNN, which PyTorch already uses for convolutions and bf16, brings its own
JIT GEMM for any CPU. On an AMD EPYC with AVX-512, 2 threads, ViT shapes (M = 1576 tokens, K, N = 384-1536):
MKL 207-221 GFLOP/s; oneDNN 485-509 for ``x Wᵀ`` and ``g W``, 350-440 for ``gᵀ x`` (fp32 results, relative
error 3-5e-7 against float64, MKL's 2.5e-7).

``y = x Wᵀ + b (+ r)`` and its gradients ``∂L/∂x = g W``, ``∂L/∂W = gᵀ x``, ``∂L/∂b = Σ g``, ``∂L/∂r = g`` are
three registered operators (``vitlab::onednn_linear`` and its two gradient products) with an autograd formula
and shape functions: eager autograd runs them, and ``torch.compile`` keeps them as calls of their own inside
its graph (inductor fuses the elementwise work around them; its own decomposition would take the BLAS).
"""

from __future__ import annotations

import torch
from torch import Tensor

# a weight gradient dW = gᵀ x with an inner dimension (in or out features) below this runs faster in aten's
# BLAS product than in oneDNN's (TNT's pixel blocks, width 24-96: oneDNN 0.4-0.9x; ViT widths: 1.6-2x)
ONEDNN_WEIGHT_GRAD_MIN = 128


def _product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x Wᵀ + b`` for 2-D ``x`` (M, K) and ``weight`` (N, K), either of them a strided view (oneDNN reads the
    strides: transposed operands need no copies)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "none")


@torch.library.custom_op("vitlab::onednn_linear", mutates_args=())
def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    """``x Wᵀ + b (+ residual)`` (bias and residual applied as the product leaves the kernel)."""
    x2 = x.reshape(-1, x.shape[-1])
    if residual is None:
        y = _product(x2, weight, bias)
    else:
        r2 = residual.reshape(-1, weight.shape[0])
        y = torch.ops.mkldnn._linear_pointwise.binary(x2, r2, weight, bias, "add")
    return y.view(*x.shape[:-1], weight.shape[0])


@onednn_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("vitlab::onednn_linear_grad_input", mutates_args=())
def grad_input(g: Tensor, weight: Tensor) -> Tensor:
    """``g W`` (M, K) for the output gradient ``g`` (M, N)."""
    return _product(g, weight.t())


@grad_input.register_fake
def _(g: Tensor, weight: Tensor) -> Tensor:
    return g.new_empty(g.shape[0], weight.shape[1])


@torch.library.custom_op("vitlab::onednn_linear_grad_weight", mutates_args=())
def grad_weight(g: Tensor, x: Tensor) -> Tensor:
    """``gᵀ x`` (N, K) for the output gradient ``g`` (M, N) and the input ``x`` (M, K)."""
    if min(g.shape[1], x.shape[1]) >= ONEDNN_WEIGHT_GRAD_MIN:
        return _product(g.t(), x.t())
    return g.t() @ x


@grad_weight.register_fake
def _(g: Tensor, x: Tensor) -> Tensor:
    return g.new_empty(g.shape[1], x.shape[1])


def _setup_context(ctx, inputs: tuple, output: Tensor) -> None:
    x, weight, bias, residual = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias, ctx.has_residual = bias is not None, residual is not None


def _backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
    x, weight = ctx.saved_tensors
    n, k = weight.shape
    g2 = g.reshape(-1, n)
    gx = grad_input(g2, weight).view(x.shape) if ctx.needs_input_grad[0] else None
    gw = grad_weight(g2, x.reshape(-1, k)) if ctx.needs_input_grad[1] else None
    gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    gr = g if ctx.has_residual and ctx.needs_input_grad[3] else None
    return gx, gw, gb, gr


onednn_linear.register_autograd(_backward, setup_context=_setup_context)
