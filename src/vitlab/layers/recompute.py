"""Activation recomputation of one block ("gradient checkpointing" in PyTorch and timm): keep only its
inputs, recompute its inside during backward. (Saving a run to disk is :mod:`vitlab.checkpoint`.)

``torch.utils.checkpoint`` (non-reentrant) runs the block's forward a second time in backward. Two things
must not differ between the two runs:

* randomness (dropout, DropPath): the RNG state is saved and restored by PyTorch (``preserve_rng_state``);
* BatchNorm's running statistics (DeepViT's re-attention, Refined-ViT's refiner and CNN stem): a training
  BatchNorm updates them on every call, so the recomputation would count each batch twice. During the
  recomputation every training BatchNorm of the block updates copies of its buffers, which are then
  dropped: the module's own buffers keep the one update of the real forward pass. (Turning tracking off
  instead would change which tensors the operation saves, which the recomputation must reproduce.)

* random draws a module makes from a counter it keeps (the Performer's features, Reformer's rotations: modules
  naming those buffers in ``recompute_buffers``): the forward pass may advance the counter and redraw, so the
  recomputation runs on copies of the buffers as they were before the forward pass, and draws what it drew.

Anything a block returns besides its tokens (Refined-ViT's attention map handed to the next block, TNT's
inner tokens) flows through the checkpoint like any other output, gradients included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def _buffers_replaced(replacements: list[tuple[nn.Module, dict[str, Tensor]]]) -> Iterator[None]:
    """Within the block: each module's named buffers are copies of the values given, its own restored after."""
    kept = [(m, {name: getattr(m, name) for name in values}) for m, values in replacements]
    for m, values in replacements:
        for name, value in values.items():
            setattr(m, name, value.clone())
    try:
        yield
    finally:
        for m, buffers in kept:
            for name, value in buffers.items():
                setattr(m, name, value)


def _batchnorm_stats_frozen(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Within the block, training BatchNorms update throw-away copies of their running statistics."""
    return _buffers_replaced(
        [
            (m, {name: getattr(m, name) for name in BN_BUFFERS})
            for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
        ]
    )


def _counted_draws(module: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    return [(m, m.recompute_buffers) for m in module.modules() if m.training and getattr(m, "recompute_buffers", ())]


@contextlib.contextmanager
def _snapshot_draws(module: nn.Module, snapshot: list) -> Iterator[None]:
    """Before the forward pass: copies of the ``recompute_buffers`` of the block's training modules."""
    snapshot[:] = [(m, {name: getattr(m, name).clone() for name in names}) for m, names in _counted_draws(module)]
    yield


def _replay_draws(snapshot: list) -> contextlib.AbstractContextManager[None]:
    """During the recomputation: the buffers as they were before the forward pass (copies, then dropped)."""
    return _buffers_replaced(snapshot)


@contextlib.contextmanager
def _recomputation(module: nn.Module, snapshot: list) -> Iterator[None]:
    with _batchnorm_stats_frozen(module), _replay_draws(snapshot):
        yield


def recompute_active(enabled: bool) -> bool:
    """Recompute only when asked, when autograd records, and outside TorchScript tracing/scripting."""
    return enabled and torch.is_grad_enabled() and not (torch.jit.is_scripting() or torch.jit.is_tracing())


def recomputed(module: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a call of ``module`` or of a function using it) under non-reentrant activation
    recomputation (``torch.utils.checkpoint``), with ``module``'s BatchNorm statistics updated once, not
    again at the recomputation, and its counted random draws replayed (module docstring)."""
    snapshot: list = []
    return checkpoint(
        fn,
        *args,
        use_reentrant=False,
        context_fn=lambda: (_snapshot_draws(module, snapshot), _recomputation(module, snapshot)),
        **kwargs,
    )
