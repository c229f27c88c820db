"""The explicit attention map in half precision: fp32 sums, one rounding, and no fp32 map kept for backward."""

from __future__ import annotations

import pytest
import torch

from vitlab.mixers.attention import attention_map
from vitlab.ops import fast_paths


def saved_bytes(fn):
    """Bytes of the tensors autograd keeps for the backward pass of ``fn()`` (and its result)."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(total)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_map_is_the_fp32_softmax_rounded_once_and_keeps_no_fp32_map(dtype):
    torch.manual_seed(0)
    q, k = (torch.randn(2, 3, 17, 8).mul(2).to(dtype).requires_grad_() for _ in range(2))
    fast, fast_bytes = saved_bytes(lambda: attention_map(q, k, 0.5))
    with fast_paths(False):
        plain, plain_bytes = saved_bytes(lambda: attention_map(q, k, 0.5))
    with torch.no_grad():  # the half-precision logits both paths normalise, normalised in float64
        exact = ((q * 0.5) @ k.transpose(-2, -1)).double().softmax(-1)
    eps = torch.finfo(dtype).eps
    assert fast.dtype == plain.dtype == dtype
    assert ((fast.double() - exact).abs() <= eps * exact + 1e-6).all()  # one rounding of the fp32 result
    assert ((fast.double() - plain.double()).abs() <= eps * exact + 1e-6).all()
    maps = fast.numel()
    # the plain path keeps the fp32 map (4 bytes an element) where the fast one keeps its half-precision result
    assert plain_bytes - fast_bytes == (4 - fast.element_size()) * maps
    g = torch.randn_like(exact)
    grads = torch.autograd.grad(fast, (q, k), g.to(dtype))
    plain_grads = torch.autograd.grad(plain, (q, k), g.to(dtype))
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    exact_grads = torch.autograd.grad(((qd * 0.5) @ kd.transpose(-2, -1)).softmax(-1), (qd, kd), g.to(dtype).double())
    for got, ref, want in zip(grads, plain_grads, exact_grads, strict=True):  # the products round in half precision
        scale = want.abs().max()
        assert (got.double() - want).abs().max() / scale < 2 * (ref.double() - want).abs().max() / scale + eps


def test_fp32_maps_take_the_plain_softmax():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    assert torch.equal(attention_map(q, k, 0.5), ((q * 0.5) @ k.transpose(-2, -1)).softmax(-1))
