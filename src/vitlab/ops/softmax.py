"""The attention map's softmax for half-precision logits: fp32 sums, the map written once in the logits' dtype.

``logits.softmax(-1, dtype=torch.float32)`` (the plain path, and what CUDA autocast runs for ``softmax``) keeps an
fp32 map for the backward pass. ATen's softmax kernel already accumulates half-precision rows in fp32, so calling
it without the up-cast (``aten._softmax`` with ``half_to_float=False``, which autocast leaves alone) gives the same
values to one rounding and keeps a map a third the plain path's size. It lives here because it names an ATen
operator directly, which only this layer does.
"""

from __future__ import annotations

import torch
from torch import Tensor


def softmax_keeping_dtype(logits: Tensor, dim: int = -1) -> Tensor:
    """``softmax(logits)`` along ``dim`` (``exp(x_i - max) / Σ_j exp(x_j - max)``), summed in fp32 for bf16/fp16
    logits and returned in their dtype."""
    return torch._softmax(logits, dim, False)
