"""Linear layers on the CPU with every product in oneDNN's GEMM.

PyTorch multiplies fp32 matrices on the CPU through its BLAS (MKL in the official wheels), whose AVX-512 kernels
are dispatched on Intel CPUs only; oneDNN, which PyTorch already uses for convolutions and bf16, brings its own
JIT GEMM for any CPU. On an AMD EPYC with AVX-512, 2 threads, ViT shapes (M = 1576 tokens, K, N = 384-1536):
MKL 207-221 GFLOP/s; oneDNN 485-509 for ``x Wᵀ`` and ``g W``, 350-440 for ``gᵀ x`` (fp32 results, relative
error 3-5e-7 against float64, MKL's 2.5e-7).

:func:`linear` is ``x Wᵀ + b``, then ``+ r`` or the exact GELU, applied as the product leaves the kernel
(``torch.ops.mkldnn._linear_pointwise``, the primitive PyTorch's own inductor uses for frozen CPU graphs).
:class:`OneDNNLinear` differentiates it: ``∂L/∂x = g W``, ``∂L/∂W = gᵀ x`` (the transposes passed as strided
views; the primitive copies its left operand to contiguous memory and reads the right one's strides),
``∂L/∂b = Σ g``, ``∂L/∂r = g``; :func:`compiled_linear` is the same as registered operators, which
``torch.compile`` keeps in its graph. The FLOP counter counts the primitive as it
counts aten's products (a formula registered below).

Whether this path runs at all is decided once per dtype by :mod:`vitlab.ops.probe`.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

# a weight gradient dW = gᵀ x with an inner dimension (in or out features) below this runs faster in aten's
# BLAS product than in oneDNN's (TNT's pixel blocks, width 24-96: oneDNN 0.4-0.9x; ViT widths: 1.6-2x)
ONEDNN_WEIGHT_GRAD_MIN = 128


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None = None, gelu: bool = False
) -> Tensor:
    """``x Wᵀ + b``, then ``+ residual`` (of the output's shape) or the exact GELU, as the product leaves the
    kernel. ``x`` (..., K), strided or not, ``weight`` (N, K) or a strided view of one; fp32 or bf16."""
    if residual is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu" if gelu else "none", [], "none")


def grad_input(g: Tensor, weight: Tensor) -> Tensor:
    """``g W`` (M, K) for the output gradient ``g`` (M, N)."""
    return linear(g, weight.t(), None)


def grad_weight(g: Tensor, x: Tensor) -> Tensor:
    """``gᵀ x`` (N, K) for the output gradient ``g`` (M, N) and the input ``x`` (M, K).

    The primitive copies its left operand, a transposed view, to contiguous memory: the narrower of ``g`` and
    ``x`` goes left. A layer that widens (N > K: attention's qkv, the MLP's fc1) computes ``(xᵀ g)ᵀ``, copying
    ``x`` and then the (K, N) result instead of ``g``: an M x N buffer less at the backward pass's peak and
    0.8-0.95x the time on ViT shapes (oneDNN, 2 threads; M = 788-4096, K = 192-384, N = 3K or 4K)."""
    n, k = g.shape[1], x.shape[1]
    if min(n, k) < ONEDNN_WEIGHT_GRAD_MIN:
        return g.t() @ x
    if n > k:
        return linear(x.t(), g.t(), None).t().contiguous()
    return linear(g.t(), x.t(), None)


def _gradients(ctx, g: Tensor, input_product=grad_input, weight_product=grad_weight) -> tuple[Tensor | None, ...]:
    """The gradients of ``x Wᵀ + b (+ r)`` for x, W, b, r (those asked for) from ``ctx``'s saved x and W."""
    x, weight = ctx.saved_tensors
    n, k = weight.shape
    g2 = g.reshape(-1, n)
    # the weight gradient first: the primitive's contiguous copy of gᵀ or xᵀ (freed on return) then does not
    # coexist with the input gradient (M x K)
    gw = weight_product(g2, x.reshape(-1, k)) if ctx.needs_input_grad[1] else None
    gx = input_product(g2, weight).view(x.shape) if ctx.needs_input_grad[0] else None
    gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return gx, gw, gb, (g if ctx.has_residual and ctx.needs_input_grad[3] else None)


def _save(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None) -> None:
    ctx.save_for_backward(x, weight)
    ctx.has_bias, ctx.has_residual = bias is not None, residual is not None


class OneDNNLinear(torch.autograd.Function):
    """``y = x Wᵀ + b (+ r)`` with the forward product and both gradient products in oneDNN's fp32 GEMM (a weight
    gradient narrower than :data:`ONEDNN_WEIGHT_GRAD_MIN` in the BLAS). The eager form: see :func:`compiled_linear`
    for torch.compile."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
        _save(ctx, x, weight, bias, residual)
        return linear(x, weight, bias, residual)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        return _gradients(ctx, g)


# torch.compile: inductor lowers oneDNN's linear primitive only for frozen (constant) weights, so in a training
# graph the three products are operators of their own, which it calls as they are. Registered operators are for
# compiled graphs only: the first eager call of one imports torch's symbolic-shape machinery (~70 MB, ~0.9 s),
# which a compiled program has loaded anyway.
@torch.library.custom_op("vitlab::onednn_linear", mutates_args=())
def compiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    """:class:`OneDNNLinear` as a registered operator (autograd formula, shape functions), for torch.compile."""
    return linear(x, weight, bias, residual)


@compiled_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _compiled(name: str, fn, out_shape):
    """``fn`` as the registered operator ``vitlab::name`` with the output shape ``out_shape(a, b)`` for tracing."""
    op = torch.library.custom_op(f"vitlab::{name}", fn, mutates_args=())
    op.register_fake(lambda a, b: a.new_empty(out_shape(a, b)))
    return op


_compiled_grad_input = _compiled("onednn_linear_grad_input", grad_input, lambda g, w: (g.shape[0], w.shape[1]))
_compiled_grad_weight = _compiled("onednn_linear_grad_weight", grad_weight, lambda g, x: (g.shape[1], x.shape[1]))
compiled_linear.register_autograd(
    lambda ctx, g: _gradients(ctx, g, _compiled_grad_input, _compiled_grad_weight),
    setup_context=lambda ctx, inputs, output: _save(ctx, *inputs),
)


def _linear_flops(x_shape, second, *rest, out_shape=None, **kwargs) -> int:
    """2·M·K·N, as for aten's ``addmm``. One formula serves both overloads: ``(x, weight, bias, attr, scalars,
    algorithm)`` and the binary ``(x, other, weight, bias, attr)``."""
    w_shape = rest[0] if len(rest) == 3 else second
    return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]


# the FLOP counter counts the primitive as it counts aten's products; a torch without the op (or whose counter
# refuses the registration) only leaves the primitive uncounted, which the probe's first call never needs
with contextlib.suppress(AttributeError, RuntimeError, TypeError, ValueError):
    register_flop_formula(torch.ops.mkldnn._linear_pointwise)(_linear_flops)
