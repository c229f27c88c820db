"""Multiply-accumulates and FLOPs of a model, without running it for real.

Two figures, labelled apart everywhere:

* **MACs** -- multiply-accumulates of the matrix products and convolutions,
  counted from shapes by ``torch.utils.flop_counter`` (MACs = counted FLOPs / 2).
  This is the papers' convention ("FLOPs" in DeiT/TNT/... tables are MACs):
  norms, activations, softmax and exponentials are not in it. The model runs
  on the meta device, so counting an 86M-parameter model takes no memory and
  about a second. The flop counter does not know the CPU kernel of
  ``scaled_dot_product_attention`` (``_scaled_dot_product_flash_attention_for_cpu``);
  it is added here, so counting on real CPU tensors gives the same MACs as on meta.
* **FLOPs** -- ``2 x MACs`` plus the elementwise work of the token mixers that
  the counter does not see: softmax of attention maps, AFT's exponentials, sums,
  divisions and gates, external attention's double normalisation, the BatchNorm /
  ReLU6 / residual terms on re-attention and refiner maps. Every mixer reports its
  own (:meth:`vitlab.mixers.base.ElementwiseFlops.extra_flops`, where the cost
  convention is); this module walks the model and asks each mixer for the calls it
  sees (:func:`mixer_extra_flops`), totalled by the mixers' ``flops_label``.

Utilisation figures use the model FLOPs ``2 x MACs`` (:mod:`vitlab.bench.models`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from ..mixers.base import ElementwiseFlops, TokenLayout


def _cpu_sdpa_mapping() -> dict[Any, Callable[..., int]]:
    """The CPU flash-attention kernels of SDPA, which ``torch.utils.flop_counter`` does not count (torch 2.x)."""

    def forward(q: tuple, k: tuple, v: tuple, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return sdpa_flop_count(q, k, v)

    def backward(grad: tuple, q: tuple, k: tuple, v: tuple, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return sdpa_backward_flop_count(grad, q, k, v)

    ops = torch.ops.aten
    mapping: dict[Any, Callable[..., int]] = {}
    if hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[ops._scaled_dot_product_flash_attention_for_cpu] = forward
    if hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        mapping[ops._scaled_dot_product_flash_attention_for_cpu_backward] = backward
    return mapping


def flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` (no display) that also counts SDPA's CPU kernels."""
    return FlopCounterMode(display=False, custom_mapping=_cpu_sdpa_mapping())


@dataclass
class MacCount:
    total: int
    by_op: dict[str, int]

    @property
    def gmacs(self) -> float:
        return self.total / 1e9


@dataclass
class FlopCount:
    """MACs (matmuls + convolutions, the papers' convention) and FLOPs (2 x MACs + elementwise mixer work)."""

    macs: int
    macs_by_op: dict[str, int]
    extra_flops: int = 0
    extra_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def flops(self) -> int:
        return 2 * self.macs + self.extra_flops

    def as_dict(self) -> dict[str, Any]:
        return {
            "macs": self.macs,
            "macs_by_op": self.macs_by_op,
            "model_flops": 2 * self.macs,
            "extra_flops": self.extra_flops,
            "extra_by_kind": self.extra_by_kind,
            "flops": self.flops,
        }


def _macs_by_op(counter: FlopCounterMode) -> dict[str, int]:
    return {str(op).removeprefix("aten."): int(n) // 2 for op, n in counter.get_flop_counts()["Global"].items()}


def count_macs(model: nn.Module, input_size: tuple[int, ...], batch: int = 1) -> MacCount:
    """MACs of one forward pass of ``model`` on a ``(batch, *input_size)`` input (run on the meta device)."""
    model = model.to("meta").eval()
    x = torch.empty(batch, *input_size, device="meta")
    with flop_counter() as counter, torch.no_grad():
        model(x)
    by_op = _macs_by_op(counter)
    return MacCount(sum(by_op.values()), by_op)


def count_flops(model: nn.Module, input_size: tuple[int, ...], batch: int = 1, device: str = "meta") -> FlopCount:
    """MACs and FLOPs of one forward pass on a ``(batch, *input_size)`` input.

    ``device="meta"`` (default) moves the model to the meta device (its weights are gone afterwards);
    ``device="cpu"`` runs it for real where it is (the same MACs: SDPA's CPU kernel is counted).
    The model's train/eval mode is kept: BatchNorm's cost depends on it.
    """
    if device == "meta":
        model = model.to("meta")
    x = torch.empty(batch, *input_size, device=device)
    extra: dict[str, int] = defaultdict(int)
    handles = [m.register_forward_hook(_extra_hook(extra), with_kwargs=True) for m in model.modules() if _counted(m)]
    try:
        with flop_counter() as counter, torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    by_op = _macs_by_op(counter)
    return FlopCount(sum(by_op.values()), by_op, sum(extra.values()), dict(extra))


# --------------------------------------------------------------------------- elementwise work of the mixers


def _counted(module: nn.Module) -> bool:
    """Whether a module reports elementwise FLOPs of its own (the token mixers, :class:`ElementwiseFlops`)."""
    return isinstance(module, ElementwiseFlops) and module.flops_label is not None


def _extra_hook(acc: dict[str, int]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        kwargs = dict(kwargs)
        x, args = (args[0], args[1:]) if args else (kwargs.pop("x"), ())
        for kind, n in mixer_extra_flops(module, x, *args, **kwargs).items():
            acc[kind] += n

    return hook


def mixer_extra_flops(module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> dict[str, int]:
    """Extra FLOPs of one call ``module(x, *args, **kwargs)`` of a mixer, by label (from shapes; nothing runs):
    the mixer's own :meth:`~vitlab.mixers.base.ElementwiseFlops.extra_flops`."""
    if not _counted(module):
        return {}
    layout = args[0] if args and isinstance(args[0], TokenLayout) else kwargs.get("layout")
    b, n, _ = x.shape
    extra = module.extra_flops(b, n, layout, with_attn_prev=kwargs.get("attn_prev") is not None)
    return {module.flops_label: int(extra)}
