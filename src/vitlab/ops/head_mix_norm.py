"""A head mix followed by a training-mode BatchNorm on attention maps, with a backward pass that saves less.

Re-attention (DeepViT) and the refiner (Refined-ViT) apply ``c · BN(W A + b)`` to maps ``A`` (B, H, N, N): a 1x1
convolution over the head axis (``W`` (G, H), bias ``b``), a BatchNorm over the G output maps with the batch's
statistics (training), and a constant scale ``c``. Through autograd, this chain keeps the mixed maps ``Y = W A + b``
for the BatchNorm's backward pass, on top of the input and the output that the neighbouring operations keep anyway,
and its backward pass makes several full passes over the maps (the BatchNorm's, the mix's products, layout copies).

The backward pass needs neither ``Y`` nor the normalised maps: with per-channel mean ``μ`` and inverse deviation
``r`` of ``Y`` over its M = B·N·N elements, ``κ = c·γ·r``, the output gradient ``g`` and

    S = Σ g,    P = Σ_b g_b A_bᵀ (G, H),    Σ g Y = Σ_h W ⊙ P + b S,
    m₁ = S / M, m₂ = r (Σ g Y − μ S) / M                          (mean of g and of g ⊙ x̂ per channel)

the BatchNorm's input gradient ``dY = κ (g − m₁ − x̂ m₂)`` is affine in ``g`` and in ``W A``, so

    dA = Wᵀ diag(κ) g − Wᵀ diag(κ r m₂) W A + Wᵀ (κ (r m₂ μ − m₁))
    dW = diag(κ) P − diag(κ r m₂) W Q + (κ (r m₂ μ − m₁)) ⊗ Σ A,    Q = Σ_b A_b A_bᵀ (H, H)
    dγ = c M m₂,  dβ = c S,  db = 0 (the batch mean cancels the bias)

with ``μ`` the mean of ``W A + b``. Only ``A`` (which the softmax before keeps) and small (G, H) matrices are
saved; the backward pass is a few reductions and two head-mixing products over the maps. The products run on the
maps' (B, N·N, H) view, which needs no copy whether the maps are in the standard layout or channels-last (one
exception on the CPU, for the BLAS's speed: a heads-last product of standard-layout maps copies its operand,
:func:`mix_heads`): the input stays in its layout (its gradient too) and the output takes the layout its consumer
reads best.
The forward pass is the same BatchNorm (``torch.native_batch_norm``, which also updates the running statistics).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .head_mix_terms import BatchNormTerms, function_args, token_rows, uses_batch_stats
from .row_norm import column_sums, new_maps, normalise_rows, rows_pay, update_running
from .switch import fast_paths_enabled
from .triton_support import triton_runs_on

#: the most heads (in or out) the Triton kernels' tiles hold (:mod:`.triton_head_mix`)
TRITON_MAX_HEADS = 64


def triton_takes(attn: Tensor, heads_out: int) -> bool:
    """Whether the Triton kernels (:mod:`.triton_head_mix`) take these maps: where Triton runs (CUDA), fp32, bf16
    or fp16 maps (under autocast or not), at most :data:`TRITON_MAX_HEADS` heads in and out."""
    return (
        attn.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and max(attn.shape[1], heads_out) <= TRITON_MAX_HEADS
        and attn.numel() < 2**31  # int32 offsets in the kernels
        and triton_runs_on(attn)
    )


def can_fuse(attn: Tensor, bn: nn.modules.batchnorm._BatchNorm) -> bool:
    """Whether :func:`head_mix_batchnorm` applies: the fast paths on, autograd records, the BatchNorm uses batch
    statistics, and either the Triton kernels take the maps (:func:`triton_takes`) or the maps are fp32/fp64
    outside autocast (under autocast the plain modules pick their own precisions). The closed-form function also
    runs under ``torch.compile``, which traces its forward and backward into its graph (no graph break; the
    compiled step saves what this function saves)."""
    if not (fast_paths_enabled() and torch.is_grad_enabled() and uses_batch_stats(bn)):
        return False
    if attn.device.type not in ("cpu", "cuda"):  # before the autocast query, which rejects e.g. "meta"
        return False
    if triton_takes(attn, bn.num_features):
        return True
    return attn.dtype in (torch.float32, torch.float64) and not torch.is_autocast_enabled(attn.device.type)


def mix_heads(weight: Tensor, rows: Tensor, heads_last: bool, out: Tensor | None = None, alpha: float = 1.0) -> Tensor:
    """``weight @ maps`` for a (G, C) matrix and maps given as :func:`token_rows` (B, L, C), added to ``out`` (times
    ``alpha``) when given: (B, L, G) when ``heads_last`` (channels-last maps), else (B, G, L) (standard layout)."""
    b = rows.shape[0]
    if heads_last and rows.stride(-1) != 1 and rows.device.type == "cpu":
        # rows of standard-layout maps are a transposed view, each row's few heads N·N values apart: the BLAS
        # reads that operand about 2x slower than a contiguous copy of it (AMD Zen 3, 12 heads over (4, 38809)
        # rows, MKL: 13.8 ms against 1.5 for the copy + 6.0 for the product)
        rows = rows.contiguous()
    lhs, rhs = (
        (rows, weight.t().expand(b, *weight.shape[::-1]))
        if heads_last
        else (weight.expand(b, *weight.shape), rows.transpose(1, 2))
    )
    return torch.bmm(lhs, rhs) if out is None else out.baddbmm_(lhs, rhs, alpha=alpha)


def as_maps(t: Tensor, n: int, heads_last: bool) -> Tensor:
    """:func:`mix_heads`'s result as maps (B, G, N, N): channels-last strides when ``heads_last``."""
    return t.view(t.shape[0], n, n, -1).permute(0, 3, 1, 2) if heads_last else t.view(t.shape[0], -1, n, n)


class _HeadMixBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, weight, bias, gamma, beta, running_mean, running_var, momentum, eps, scale, heads_last):
        rows = token_rows(a)
        y = mix_heads(weight, rows, heads_last)  # W A; b enters the running mean
        w_eff = gamma * scale if gamma is not None else weight.new_full((weight.shape[0],), scale)
        b_eff = beta * scale if beta is not None else None
        if heads_last and a.device.type == "cpu" and rows_pay(weight.shape[0]):  # channels-last: as rows (.row_norm)
            out, out_rows = new_maps(a, y.shape[-1])
            mean, var, rstd = normalise_rows(y.view(-1, y.shape[-1]), out_rows, w_eff, b_eff, eps)
            update_running(running_mean, running_var, mean, var, y.shape[0] * y.shape[1], momentum)
        else:
            y = as_maps(y, a.shape[-1], heads_last)
            out, mean, rstd = torch.native_batch_norm(y, w_eff, b_eff, running_mean, running_var, True, momentum, eps)
        if running_mean is not None and bias is not None:  # mean(W A + b) = mean(W A) + b
            running_mean.add_(bias, alpha=momentum)
        ctx.save_for_backward(rows, weight, w_eff, mean, rstd)
        ctx.scale, ctx.has = scale, (bias is not None, gamma is not None, beta is not None)
        ctx.layout = (a.shape, a.is_contiguous(memory_format=torch.channels_last) and not a.is_contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, weight, w_eff, mean, rstd = ctx.saved_tensors
        shape, rows_in = ctx.layout
        count = rows.shape[0] * rows.shape[1]
        g = token_rows(grad)  # (B, L, G)
        s = column_sums(g)  # (G,)
        p = torch.bmm(g.transpose(1, 2), rows).sum(0)  # (G, H)
        terms = BatchNormTerms.of(weight, w_eff, mean, rstd, s, p, count)
        grad_a = grad_w = None
        if ctx.needs_input_grad[0]:  # in the input's layout
            on_g, on_a, const = terms.input_grad_mix(weight)
            grad_a = mix_heads(on_g, g, rows_in)
            mix_heads(on_a, rows, rows_in, out=grad_a, alpha=-1.0)
            grad_a = as_maps(grad_a.add_(const.view((1, 1, -1) if rows_in else (1, -1, 1))), shape[-1], rows_in)
        if ctx.needs_input_grad[1]:
            q = torch.bmm(rows.transpose(1, 2), rows).sum(0)  # (H, H)
            grad_w = terms.weight_grad(weight, p, q, column_sums(rows))
        affine = terms.affine_grads(ctx.has, ctx.needs_input_grad, ctx.scale, count)
        return grad_a, grad_w, *affine, None, None, None, None, None, None


def head_mix_batchnorm(
    attn: Tensor,
    mix: nn.Conv2d,
    bn: nn.modules.batchnorm._BatchNorm,
    scale: float = 1.0,
    heads_last: bool = False,
) -> Tensor:
    """``scale · bn(mix(attn))`` for maps ``attn`` (B, H, N, N), a 1x1 head mix ``mix`` (H -> G, a Conv2d weight
    (G, H, 1, 1)) and a BatchNorm with batch statistics (:func:`can_fuse`): the same values and running-statistics
    update as the modules, with the lean backward pass of this module's docstring. The result has channels-last
    strides when ``heads_last`` (what a following depth-wise conv reads fastest), else the standard layout; the
    input may be in either. Where Triton runs, the kernels of :mod:`.triton_head_mix` (any of fp32/bf16/fp16)."""
    if triton_takes(attn, mix.out_channels):  # imported late: triton is an optional dependency
        from .triton_head_mix import head_mix_batchnorm_triton

        return head_mix_batchnorm_triton(attn, mix, bn, scale, heads_last)
    return _HeadMixBatchNorm.apply(*function_args(attn, mix, bn, scale, heads_last))
