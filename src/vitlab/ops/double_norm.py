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

    Each map-sized buffer is a fresh allocation, and a map at or above glibc's largest mmap threshold (32 MiB, the
    size of multi-head EA's map at T = 4096 per sequence) is mapped and page-faulted anew on every call, 2-3 µs a page,
    more than the arithmetic on it. So ``overwrite`` (logits the caller owns) normalises in the logits' buffer,
    and the backward pass allocates one buffer, the gradient it returns: the normalisation allocates one map-sized
    buffer a training step instead of four.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, token_dim: int, memory_dim: int, eps: float, overwrite: bool) -> Tensor:
        shift = logits.amax(token_dim, keepdim=True)
        # overwrite: the caller's fresh logits become the map, one map-sized buffer fewer. Not ctx.mark_dirty: the
        # logits are a linear layer's output viewed to the map's shape, and autograd would rebase that view's
        # history, copying the map in the backward pass (CopySlices). The in-place ops move the logits' version
        # counter, so any other node that saved them fails loudly.
        y = logits.sub_(shift) if overwrite else torch.sub(logits, shift)
        y = y.exp_()
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
        # one map-sized buffer for the whole pass, the gradient returned: first gy ⊙ y for r, then u in its place,
        # and u - y ⊙ n ⊙ Σ u as n ⊙ (u / n - y ⊙ Σ u), whose factors broadcast (n ⊙ Σ u would be a map of its own)
        u = torch.mul(gy, y)
        u = torch.sub(gy, u.sum(memory_dim, keepdim=True), out=u).mul_(y)
        total = u.sum(token_dim, keepdim=True)
        return u.div_(n).addcmul_(y, total, value=-1.0).mul_(n), None, None, None, None


def double_normalize(
    logits: Tensor, token_dim: int = -2, memory_dim: int = -1, eps: float = 1e-9, inplace: bool = False
) -> Tensor:
    """EA's double normalisation (paper Algorithm 1): softmax over ``token_dim``, then ℓ1 over ``memory_dim``
    (+ ``eps``).

    Stable for any logits: the softmax subtracts the per-slot max over tokens, and
    ``eps > 0`` keeps a token that no slot attends to at 0 instead of 0/0. Half
    precision is normalised in fp32 and returned in the input dtype. ``inplace``: the caller owns ``logits`` and
    will not read them again, so they may be overwritten by the map (a fast path, off with the switch; on the CPU
    with or without autograd, which then sees the logits modified in place).
    Where Triton runs (CUDA), one kernel per pass in any of fp32/bf16/fp16 (:mod:`.triton_double_norm`); on the
    CPU fp32/fp64 run through :class:`_DoubleNormalize` (same values, a backward pass with fewer and faster passes
    over the map).
    """
    if triton_runs_on(logits):  # triton is importable here; imported late, as it is an optional dependency
        from .triton_double_norm import double_normalize_triton, supports

        if supports(logits, token_dim, memory_dim):
            return double_normalize_triton(logits, token_dim, eps, inplace)
    low = not fx_tracing() and logits.dtype in (torch.float16, torch.bfloat16)  # fx: a symbol without a dtype
    inplace = inplace and fast_paths_enabled()
    if not low and eager_fast_path():
        return _DoubleNormalize.apply(logits, token_dim, memory_dim, eps, inplace)
    # softmax over a middle axis by hand, in place: faster than its strided kernel (not while autograd records:
    # the max's backward pass needs the logits as they were)
    inplace = inplace and not (torch.is_grad_enabled() and logits.requires_grad)
    if inplace and not low:
        attn = logits.sub_(logits.amax(dim=token_dim, keepdim=True)).exp_()
        attn = attn.div_(attn.sum(dim=token_dim, keepdim=True))
    else:
        attn = logits.softmax(dim=token_dim, dtype=torch.float32 if low else None)
    norm = attn.sum(dim=memory_dim, keepdim=True).add_(eps)
    attn = attn.div_(norm) if inplace else attn / norm
    return attn.to(logits.dtype)
