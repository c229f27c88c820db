"""The one switch of vitlab's fast paths, and the context queries every path decision shares.

Every mixer computes its paper's equation with plain PyTorch operations. This layer also has faster forms of some
of those operations: oneDNN's linear products on the CPU, hand-differentiated cores (AFT, external attention's
double normalisation, the head mix + BatchNorm of re-attention and the refiner), BatchNorm folded into the
preceding convolution in eval mode, in-place inference paths. Each computes the same function as the plain path
(the tests hold them equal). One switch turns them all off, as timm's ``set_fused_attn`` does for its attention:
``vitlab.ops.set_fast_paths(False)``, or ``VITLAB_FAST_PATHS=0`` in the environment (read at import). The paths
that depend on the hardware are also decided once per device and dtype by running them (:mod:`vitlab.ops.probe`).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _from_environment() -> bool:
    """The switch as ``VITLAB_FAST_PATHS`` sets it; a value that is no switch is one warning line (it is read
    while ``vitlab`` is imported, where an error would stop every program that imports it) and the default, on."""
    value = os.environ.get("VITLAB_FAST_PATHS", "").strip().lower()
    if value in ("", *_ON):
        return True
    if value in _OFF:
        return False
    # warn_explicit with a location that has no source line: one line under any warning format
    warnings.warn_explicit(
        f"VITLAB_FAST_PATHS={value!r} is not a switch: set it to one of {', '.join(_ON)} (fast paths, the default) "
        f"or {', '.join(_OFF)} (off); the fast paths stay on",
        RuntimeWarning,
        "VITLAB_FAST_PATHS",
        0,
    )
    return True


_enabled = _from_environment()


def set_fast_paths(enabled: bool) -> None:
    """Turn every fast path on (the default: each where its probe takes it) or off (the plain operations only)."""
    global _enabled
    _enabled = bool(enabled)


def fast_paths_enabled() -> bool:
    """Whether the fast paths may run (:func:`set_fast_paths`, ``VITLAB_FAST_PATHS``); never while torch.fx traces
    symbolically (tensors are then symbols: no values, flags or dtypes to choose a path by; the graph records
    the plain operations)."""
    return _enabled and not fx_tracing()


def fx_tracing() -> bool:
    """Whether ``torch.fx.symbolic_trace`` (or torchvision's ``create_feature_extractor``) is tracing."""
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing()


@contextmanager
def fast_paths(enabled: bool) -> Iterator[None]:
    """``with fast_paths(False): ...`` runs the block with the fast paths off (or on), then restores the switch."""
    before = _enabled
    set_fast_paths(enabled)
    try:
        yield
    finally:
        set_fast_paths(before)


def traced_or_exported() -> bool:
    """Whether a TorchScript trace or an ONNX export is recording: they keep one path of any data-dependent branch.

    ``torch.onnx.is_in_onnx_export()`` imports ``torch.onnx`` and both exporters' flag modules on its first call
    (27 modules, ~2.5 MB, in a model's first forward pass); an export in progress has imported them already."""
    return torch.jit.is_tracing() or ("torch.onnx._internal" in sys.modules and torch.onnx.is_in_onnx_export())


def capturing_graph() -> bool:
    """Whether a graph is being captured (``torch.compile``, TorchScript trace, ONNX export): eager-only fast paths
    (custom autograd functions, oneDNN primitives called directly) give way to the plain operations, which the
    capturing tool differentiates, fuses or exports itself."""
    return torch.compiler.is_compiling() or traced_or_exported()


def no_autograd(*tensors: Tensor) -> bool:
    """Whether autograd records nothing on ``tensors`` (inference, no_grad): a core may then reuse its own
    intermediates in place (fewer allocations, less memory traffic; the same values). False with the fast paths
    off, so that the plain path is the one the autograd form takes, and while a TorchScript trace or the
    TorchScript-based ONNX exporter records (writes into views of a new tensor are recorded wrongly there:
    TNT's logits were 0.1-0.2 off)."""
    if not fast_paths_enabled() or traced_or_exported():
        return False
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def eager_fast_path() -> bool:
    """Whether an eager-only fast path (a hand-differentiated core, an in-place inference form) may run: the
    switch on and no graph being captured."""
    return fast_paths_enabled() and not capturing_graph()
