"""A patch projection (a convolution whose kernel is its stride, no padding) as one matrix product over the patches.

With kernel = stride = (p, q) every output position sees its own patch, so

    y[n, o, i, j] = b[o] + Σ_{c, u, v} W[o, c, u, v] · x[n, c, p·i + u, q·j + v]

is the product of the patch matrix (B·N, C·p·q) with the weight as a (C_out, C·p·q) matrix: a linear layer on the
flattened patches, and its output is already the token matrix (B, N, C_out) the transformer reads. On the CPU the
product (the BLAS's GEMM) is faster than oneDNN's convolution for these shapes, most of all in training, whose
weight and input gradients of a strided convolution are slow on the CPU. Measured with 2 threads, forward and
backward, the 8 x 8 projection of Refined-ViT's stem (128 -> 384 channels, 112 x 112, batch 4): 121 ms as a
convolution, 57 ms as the product on an AVX-512 Xeon; 232 ms and 56 ms with oneDNN limited to AVX2. (DeiT-S's
16 x 16 embedding of the image, whose convolution needs no input gradient: 4.2 -> 3.6 ms and 5.6 -> 3.3 ms.)

The patches are gathered in the order of the input's memory: channels-last activations (a CNN stem's) give rows of
(u, v, c), for which the weight's taps are permuted to match (a copy of the weight, small beside the patches);
other inputs give rows of (c, u, v), the weight's own order (a view).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .fold import exporting
from .switch import fast_paths_enabled


def projects_as_product(conv: nn.Conv2d, x: Tensor) -> bool:
    """Whether :func:`patch_tokens` computes ``conv(x)`` as one product: the fast paths on, the CPU (the GPU keeps
    its convolution kernels, not measured against this form), no graph being exported (the exported graph keeps the
    convolution), a plain ``nn.Conv2d`` patch projection (kernel = stride, no padding, dilation or groups) and an
    image batch whose sides are multiples of the stride."""
    return (
        fast_paths_enabled()
        and x.device.type == "cpu"
        and type(conv) is nn.Conv2d
        and tuple(conv.kernel_size) == tuple(conv.stride)
        and tuple(conv.padding) == (0, 0)
        and tuple(conv.dilation) == (1, 1)
        and conv.groups == 1
        and x.dim() == 4
        and x.shape[-2] % conv.stride[0] == 0
        and x.shape[-1] % conv.stride[1] == 0
        and not exporting()
    )


def patch_tokens(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """``conv(x)`` (B, C_out, H/p, W/q) as tokens (B, N, C_out), N = (H/p)·(W/q) in row-major grid order: the
    module's ``conv(x).flatten(2).transpose(1, 2)``; one product over the patches where
    :func:`projects_as_product` allows (the module's docstring), else the convolution."""
    if not projects_as_product(conv, x):
        return conv(x).flatten(2).transpose(1, 2)
    b, c, h, w = x.shape
    p, q = conv.stride
    gh, gw = h // p, w // q
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        patches = x.permute(0, 2, 3, 1).reshape(b, gh, p, gw, q, c).transpose(2, 3).reshape(b, gh * gw, p * q * c)
        weight = conv.weight.permute(0, 2, 3, 1).reshape(conv.out_channels, p * q * c)
    else:
        patches = x.reshape(b, c, gh, p, gw, q).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * p * q)
        weight = conv.weight.reshape(conv.out_channels, c * p * q)
    return F.linear(patches, weight, conv.bias)
