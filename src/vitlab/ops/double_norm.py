"""External attention's double normalisation (paper Algorithm 1) with a closed-form backward pass.

The map over the memory slots is a softmax over the tokens, then an ℓ1 normalisation over the slots. Through
autograd the composite keeps both intermediate maps and its backward pass runs PyTorch's softmax over a middle axis,
whose strided kernels are the slowest part of external attention at long sequences; :class:`_DoubleNormalize`
saves only the output and the ℓ1 norms and reduces over whole axes as laid out. A fast path
(:mod:`vitlab.ops.switch`): eager mode only, the composite otherwise. Where Triton kernels run
(:func:`~.triton_support.triton_runs_on`: CUDA tensors, any of fp32/bf16/fp16), both passes run as one kernel each
(:mod:`.triton_double_norm`), which never stores an fp32 map.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .switch import eager_fast_path, fast_paths_enabled, fx_tracing
from .triton_support import triton_runs_on


class _DoubleNormalize(torch.autograd.Function):
    """Double normalisation with a closed-form backward pass, fp32/fp64 (:func:`double_normalize`).

    Forward: ``a = softmax_tokens(x)``, ``n = Σ_slots a + eps``, ``y = a / n``. With ``r = Σ_slots gy ⊙ y`` (per
    token) and ``u = (gy - r) ⊙ y``, the chain rule through the ℓ1 step and the softmax gives

        ∂L/∂x = u - y ⊙ n ⊙ Σ_tokens u

    so the backward pass needs only ``y`` and ``n``. Every reduction runs over a whole axis of the tensor as laid
    out, never through PyTorch's softmax over a middle axis, whose strided kernels (forward and backward) are the
    slowest part of external attention at long sequences.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, token_dim: int, memory_dim: int, eps: float) -> Tensor:
        y = (logits - logits.amax(token_dim, keepdim=True)).exp_()
        y = y.div_(y.sum(token_dim, keepdim=True))
        n = y.sum(memory_dim, keepdim=True).add_(eps)
        y = y.div_(n)
        ctx.save_for_backward(y, n)
        ctx.dims = token_dim, memory_dim
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):
        y, n = ctx.saved_tensors
        token_dim, memory_dim = ctx.dims
        u = (gy - (gy * y).sum(memory_dim, keepdim=True)).mul_(y)
        return u.addcmul_(y, n * u.sum(token_dim, keepdim=True), value=-1.0), None, None, None


def double_normalize(
    logits: Tensor, token_dim: int = -2, memory_dim: int = -1, eps: float = 1e-9, inplace: bool = False
) -> Tensor:
    """EA's double normalisation (paper Algorithm 1): softmax over ``token_dim``, then ℓ1 over ``memory_dim``
    (+ ``eps``).

    Stable for any logits: the softmax subtracts the per-slot max over tokens, and
    ``eps > 0`` keeps a token that no slot attends to at 0 instead of 0/0. Half
    precision is normalised in fp32 and returned in the input dtype. ``inplace``
    (inference, no autograd) overwrites ``logits`` and normalises in place (a fast path: off with the switch).
    Where Triton runs (CUDA), one kernel per pass in any of fp32/bf16/fp16 (:mod:`.triton_double_norm`); on the
    CPU fp32/fp64 run through :class:`_DoubleNormalize` (same values, a backward pass with fewer and faster passes
    over the map).
    """
    if triton_runs_on(logits):  # triton is importable here; imported late, as it is an optional dependency
        from .triton_double_norm import double_normalize_triton, supports

        if supports(logits, token_dim, memory_dim):
            return double_normalize_triton(logits, token_dim, eps, inplace)
    low = not fx_tracing() and logits.dtype in (torch.float16, torch.bfloat16)  # fx: a symbol without a dtype
    if not low and not inplace and eager_fast_path():
        return _DoubleNormalize.apply(logits, token_dim, memory_dim, eps)
    inplace = inplace and fast_paths_enabled()
    if inplace and not low:  # softmax over a middle axis by hand, in place: faster than its strided kernel
        attn = logits.sub_(logits.amax(dim=token_dim, keepdim=True)).exp_()
        attn = attn.div_(attn.sum(dim=token_dim, keepdim=True))
    else:
        attn = logits.softmax(dim=token_dim, dtype=torch.float32 if low else None)
    norm = attn.sum(dim=memory_dim, keepdim=True).add_(eps)
    attn = attn.div_(norm) if inplace else attn / norm
    return attn.to(logits.dtype)
