"""Linear layers with their epilogues: ``linear(x)``, then GELU or ``+ residual``, in oneDNN where it pays.

:func:`fused_linear` is what the mixers and the MLP call for every projection. It takes oneDNN's primitive
(:mod:`vitlab.ops.onednn`) only when the fast paths are on (:mod:`vitlab.ops.switch`), the probe has found the
primitive working and faster on this CPU for the dtype and mode (:mod:`vitlab.ops.probe`), and the call's context
allows it; otherwise it is ``linear(x)`` followed by the plain operations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import onednn, probe
from .switch import fast_paths_enabled, traced_or_exported

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def _context_allows(x: Tensor, weight: Tensor, compiled: bool) -> bool:
    """Whether this call's context lets oneDNN compute a linear layer of ``x``: the switch, the CPU, one dtype,
    autocast off (it picks the product's precision itself), eager mode (``compiled``: or inside ``torch.compile``),
    not traced or exported, no torch.func transform, and no dispatch mode watching the ops other than the FLOP
    counter (fake tensors know aten's ops, not all of oneDNN's)."""
    if not (fast_paths_enabled() and x.device.type == "cpu" and weight.dtype == x.dtype and x.numel() > 0):
        return False
    if x.dtype not in _ONEDNN_DTYPES:
        return False
    if torch.compiler.is_compiling():  # before the queries that torch.compile cannot trace (a graph break)
        # torch.export (also the ONNX exporter's default path) records the plain product: a graph holding the
        # registered operator vitlab::onednn_linear would run only where vitlab is imported, and no exporter
        # translates it (ONNX: "No ONNX function found"); inside torch.compile the operator stays
        return compiled and not torch.compiler.is_exporting() and not torch.is_autocast_enabled("cpu")
    mode = _get_current_dispatch_mode()
    return (
        not traced_or_exported()
        and not torch.is_autocast_enabled("cpu")
        and (mode is None or type(mode).__name__ in ("FlopCounterMode", "_FlopCounterMode"))
        and not torch._C._are_functorch_transforms_active()  # torch.func (grad, vmap): aten's ops have their rules
    )


def _records(x: Tensor, weight: Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def onednn_mode(x: Tensor, weight: Tensor) -> str | None:
    """How :func:`fused_linear` runs ``x``'s product with ``weight``: ``"infer"`` (oneDNN's fused primitive, nothing
    recorded by autograd), ``"train"`` (:class:`vitlab.ops.onednn.OneDNNLinear`, or inside ``torch.compile``
    :func:`vitlab.ops.onednn.compiled_linear`: fp32 while autograd records) or None (the plain operations). The
    call's context is checked once, then the probe's answer for the dtype and mode."""
    if not fast_paths_enabled():
        return None
    training = _records(x, weight)
    if training and x.dtype != torch.float32:
        return None
    known = probe.decided(x.dtype, training)
    if known is not None and not known.taken:  # no context to inspect (a few microseconds a layer, every layer)
        return None
    if not _context_allows(x, weight, compiled=training):
        return None
    taken = probe.onednn_linear_taken(x.dtype, training=training)
    return ("train" if training else "infer") if taken else None


def fuses_linear(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`fused_linear` takes oneDNN's fused primitive (inference; :func:`onednn_mode`)."""
    return onednn_mode(x, weight) == "infer"


def trains_linear_in_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`fused_linear` runs a training step's products in oneDNN (:func:`onednn_mode`)."""
    return onednn_mode(x, weight) == "train"


def fused_linear(linear: nn.Linear, x: Tensor, gelu: bool = False, residual: Tensor | None = None) -> Tensor:
    """``linear(x)``, then the exact GELU (``gelu``) or ``+ residual``, with the products in oneDNN where the probe
    took it.

    Inference (:func:`fuses_linear`): ``F.linear`` copies the bias into its output (a broadcast copy, slow for its
    size) and accumulates the product onto it, and GELU and the residual add are one more pass over the output
    each: in bf16 together more time than the product itself, in fp32 10-25 % of it (DeiT-S's fc1 at batch 8:
    13.8 ms plain, 10.4 ms fused, on a CPU where the probe takes oneDNN). oneDNN's linear primitive applies the
    bias, GELU or the addition to the product's result as it leaves the kernel. Training in fp32
    (:func:`trains_linear_in_onednn`): the products of :class:`vitlab.ops.onednn.OneDNNLinear` (bias and residual
    inside the forward product; GELU after it, since its gradient needs the product). Everywhere else these are
    the plain operations, unchanged."""
    if residual is not None and gelu:
        raise ValueError("fused_linear: either gelu or residual, not both")
    # a replaced layer (a subclass: LoRA, quantised; nn.Identity) runs as it is
    w, b = (linear.weight, linear.bias) if type(linear) is nn.Linear else (None, None)
    # the residual goes into the product when it has the output's shape (the primitive does not broadcast)
    fits = (
        w is not None
        and residual is not None
        and fast_paths_enabled()
        and residual.shape == (*x.shape[:-1], w.shape[0])
    )
    inside = residual if fits else None
    mode = None if w is None else onednn_mode(x, w)
    if mode == "infer":
        y, gelu = onednn.linear(x, w, b, inside, gelu), False  # GELU inside the product too
    elif mode == "train":
        product = onednn.compiled_linear if torch.compiler.is_compiling() else onednn.OneDNNLinear.apply
        y = product(x, w, b, inside)
    else:
        y, inside = linear(x), None
    y = F.gelu(y) if gelu else y
    return y if residual is None or inside is not None else residual + y


def linear_rows(linear: nn.Linear, x: Tensor, start: int, stop: int) -> Tensor:
    """Output features ``start .. stop-1`` of ``linear(x)``: the product with that block of the weight's rows, in
    oneDNN where :func:`fused_linear` takes it. For a plain ``nn.Linear`` (a replaced layer has no rows to take)."""
    w = linear.weight[start:stop]
    b = None if linear.bias is None else linear.bias[start:stop]
    return onednn.linear(x, w, b) if fuses_linear(x, w) else F.linear(x, w, b)


def gelu_(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU in place on a fresh activation nobody else reads (inference: one allocation and page-faulting of the
    widest tensor of a block fewer); out of place with the fast paths off."""
    return (
        torch.ops.aten.gelu_(x, approximate=approximate) if fast_paths_enabled() else F.gelu(x, approximate=approximate)
    )
