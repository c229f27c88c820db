"""Gradient checkpointing of one block: keep only its inputs, recompute its inside during backward.

``torch.utils.checkpoint`` (non-reentrant) runs the block's forward a second time in backward. Two things
must not differ between the two runs:

* randomness (dropout, DropPath): the RNG state is saved and restored by PyTorch (``preserve_rng_state``);
* BatchNorm's running statistics (DeepViT's re-attention, Refined-ViT's refiner and CNN stem): a training
  BatchNorm updates them on every call, so the recomputation would count each batch twice. During the
  recomputation every training BatchNorm of the block stops tracking (``track_running_stats=False``): it
  still normalises with the batch statistics, the same function, but leaves its buffers alone.

Anything a block returns besides its tokens (Refined-ViT's attention map handed to the next block, TNT's
inner tokens) flows through the checkpoint like any other output, gradients included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def _batchnorm_stats_frozen(module: nn.Module) -> Iterator[None]:
    frozen = [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]
    for m in frozen:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in frozen:
            m.track_running_stats = True


def checkpoint_active(enabled: bool) -> bool:
    """Checkpoint only when asked, when autograd records, and outside TorchScript tracing/scripting."""
    return enabled and torch.is_grad_enabled() and not (torch.jit.is_scripting() or torch.jit.is_tracing())


def checkpointed(module: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a call of ``module`` or of a function using it) under non-reentrant gradient
    checkpointing, with ``module``'s BatchNorm statistics updated once, not again at the recomputation."""
    return checkpoint(
        fn,
        *args,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), _batchnorm_stats_frozen(module)),
        **kwargs,
    )
