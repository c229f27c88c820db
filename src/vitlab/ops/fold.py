"""BatchNorm folded into the operation before it, for eval-only fast paths.

In eval mode a BatchNorm is an affine map with its running statistics, so ``BN(conv(x))`` is one convolution with a
rescaled weight and a shifted bias: one pass over the activations instead of two.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .switch import fast_paths_enabled, traced_or_exported


def can_fold(module: nn.Module, t: Tensor) -> bool:
    """Whether an eval-only fast path may run: the fast paths on, eval mode (BatchNorm uses its running statistics),
    no autograd (the fast paths work in place) and no graph being exported (:func:`exporting`)."""
    if not fast_paths_enabled():
        return False
    if module.training or records_grad(module, t):
        return False
    return not exporting() and all(
        m.running_var is not None for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    )


def exporting() -> bool:
    """Whether a graph is being exported: ``torch.export`` (the dynamo-based ONNX exporter, torch's default), the
    TorchScript-based ONNX exporter or a TorchScript trace.

    The folded paths give way to the modules there: they write their results in place into views of one output
    (which the TorchScript-based ONNX exporter records wrongly: Refined-ViT's logits were off by 0.07) and walk
    the batch in chunks with a Python loop (which bakes the example's batch size into an exported graph). The
    exported graph keeps the BatchNorm layers, which ONNX runtimes fold into the convolutions themselves.
    ``torch.compile`` is no export: it keeps the folded paths."""
    return torch.compiler.is_exporting() or traced_or_exported()


def records_grad(module: nn.Module, t: Tensor) -> bool:
    """Whether autograd records ``module``'s call on ``t``: grad mode on and ``t`` or one of its parameters
    requiring a gradient."""
    return torch.is_grad_enabled() and (t.requires_grad or any(p.requires_grad for p in module.parameters()))


def fold_bn(weight: Tensor, bias: Tensor | None, bn: nn.BatchNorm2d) -> tuple[Tensor, Tensor]:
    """``BN(conv(x)) = conv'(x)``: the running-statistics BatchNorm folded into the conv's weight and bias."""
    g = bn.weight / torch.sqrt(bn.running_var + bn.eps) if bn.affine else torch.rsqrt(bn.running_var + bn.eps)
    shift = (bn.bias if bn.affine else 0) - bn.running_mean * g
    w = weight * g.view(-1, *[1] * (weight.dim() - 1))
    return w, shift if bias is None else bias * g + shift
