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
  the counter does not see (:func:`mixer_extra_flops`): softmax of attention
  maps, AFT's exponentials, sums, divisions and gates, external attention's
  double normalisation, the BatchNorm / ReLU6 / residual terms on re-attention
  and refiner maps. One FLOP per elementwise add, multiply, divide, compare or
  exponential; a softmax costs 5 per element (max, subtract, exp, sum, divide),
  a sigmoid 3, ReLU6 2, an eval-mode BatchNorm 2 (5 in training). Token-wise
  LayerNorm, GELU and the blocks' residual adds are not included (as in the
  papers' own counts).

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

SOFTMAX, SIGMOID, RELU6 = 5, 3, 2


def _bn(training: bool) -> int:
    return 5 if training else 2


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
    handles = [
        m.register_forward_hook(_extra_hook(extra), with_kwargs=True)
        for m in model.modules()
        if _formula(m) is not None
    ]
    try:
        with flop_counter() as counter, torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    by_op = _macs_by_op(counter)
    return FlopCount(sum(by_op.values()), by_op, sum(extra.values()), dict(extra))


# --------------------------------------------------------------------------- elementwise work of the mixers


def attention_softmax_flops(batch: int, heads: int, queries: int, keys: int) -> int:
    """``softmax(Q Kᵀ · s)``: the scale (1) and the softmax (5) per map element (the products are MACs)."""
    return (1 + SOFTMAX) * batch * heads * queries * keys


def double_norm_flops(maps: int, tokens: int, slots: int) -> int:
    """External attention's double normalisation of ``maps`` (tokens x slots) logits: softmax over the
    tokens (5 per element), then ℓ1 over the slots (sum 1, divide 1 per element, + eps once per row)."""
    return maps * ((SOFTMAX + 2) * tokens * slots + tokens)


def dla_flops(batch: int, heads: int, n: int, dla: nn.Module) -> int:
    """The refiner's elementwise work on (B, H, N, N) maps (expansion/conv/reduction are MACs):
    with ``official_extras``, BatchNorm + ReLU6 after expansion and after the depth-wise conv, BatchNorm
    after the reduction and the identity shortcut."""
    if not dla.residual:
        return 0
    maps = batch * n * n
    hidden = heads * dla.expansion
    bn = _bn(dla.training)
    total = 0
    if dla.expand is not None:
        total += (bn + RELU6) * hidden * maps
    if dla.local is not None:
        total += (bn + RELU6) * hidden * maps
    if dla.reduce is not None:
        total += bn * dla.out_heads * maps
    return total + dla.out_heads * maps  # + the input map


def _attention_flops(m: nn.Module, x: torch.Tensor, kw: dict[str, Any]) -> tuple[str, int]:
    b, n, _ = x.shape
    return "attention softmax", attention_softmax_flops(b, m.num_heads, n, n)


def _reattention_flops(m: nn.Module, x: torch.Tensor, kw: dict[str, Any]) -> tuple[str, int]:
    b, n, _ = x.shape
    maps = b * m.num_heads * n * n
    extra = (1 + _bn(m.var_norm.training) + (1 if m.reatten_scale != 1.0 else 0)) * maps  # head-mix bias, BN, scale
    return "re-attention maps", attention_softmax_flops(b, m.num_heads, n, n) + extra


def _refiner_flops(m: nn.Module, x: torch.Tensor, kw: dict[str, Any]) -> tuple[str, int]:
    b, n, _ = x.shape
    maps = b * m.num_heads * n * n
    prev = kw.get("attn_prev") is not None
    total = 0
    if not m.share:
        total += attention_softmax_flops(b, m.num_heads, n, n)
        if m.residual_attention and prev:
            total += 2 * maps  # + s · attn_prev
    if m.refiner is not None and (prev or not m.share):
        total += dla_flops(b, m.num_heads, n, m.refiner)
        if m.adapt_bn is not None:
            total += _bn(m.adapt_bn.training) * b * m.value_heads * n * n
        if m.share:
            total += b * m.value_heads * n * n  # · s
    return "refiner maps", total


def _external_flops(m: nn.Module, x: torch.Tensor, kw: dict[str, Any]) -> tuple[str, int]:
    b, n, _ = x.shape
    return "external attention norm", double_norm_flops(b, n, m.memory_size)


def _external_mh_flops(m: nn.Module, x: torch.Tensor, kw: dict[str, Any]) -> tuple[str, int]:
    b, n, _ = x.shape
    return "external attention norm", double_norm_flops(b * m.num_heads, n, m.memory_size)


def _token_external_flops(m: nn.Module, x: torch.Tensor, kw: dict[str, Any]) -> tuple[str, int]:
    b, n, _ = x.shape
    width = m.q_linear.out_features
    return "external attention norm", double_norm_flops(b, n, m.mk.out_features) + b * n * width  # + residual t


def _token_attention_flops(m: nn.Module, x: torch.Tensor, kw: dict[str, Any]) -> tuple[str, int]:
    b, n, _ = x.shape
    width = m.proj.out_features
    return "attention softmax", attention_softmax_flops(b, 1, n, n) + b * n * width  # + residual v


def aft_full_flops(batch: int, tokens: int, channels: int) -> int:
    """AFT-full / AFT-local core (Eq. 2 as two products with ``e^w``, which are MACs): ``e^{K - max}`` and
    ``e^{w - max}`` (max, subtract, exp: 3 per element), ``e^K ⊙ V`` 1, the division 1, ``sigmoid(Q)`` 3 and the
    gate 1 per output element."""
    return 9 * batch * tokens * channels + 3 * tokens * tokens


def aft_local_banded_flops(batch: int, tokens: int, channels: int, block: int, causal: bool = True) -> int:
    """AFT-local on its O(T·s·d) band (:func:`vitlab.mixers.aft.aft_local_banded`; the band products are MACs):
    ``e^{w - max}`` 3 per band entry (``nb`` blocks of ``b x 2b``, non-causal ``b x 3b``), ``e^{K - max}`` 3 and
    ``e^K ⊙ V`` 1 per element, the prefix of the pairs outside the window (block sums, cumulative sum, scale,
    add) 6 per output element of numerator and denominator together, then divide 1, ``sigmoid(Q)`` 3 and the
    gate 1. Non-causal also: the third band product's add 2 per output element, and per block the suffix's
    reversed cumulative sum and its add to the prefix (2 per block and element of the 2C channels)."""
    nb = -(-tokens // block)
    if causal:
        return 15 * batch * tokens * channels + 6 * nb * block * block
    return 17 * batch * tokens * channels + 4 * batch * nb * channels + 9 * nb * block * block


def aft_simple_flops(batch: int, tokens: int, channels: int) -> int:
    """AFT-simple core: softmax of K over the tokens 5, ``⊙ V`` 1, the sum over tokens 1, ``sigmoid(Q)`` 3 and
    the gate 1 per element (the causal form: exp 3, ``⊙ V`` 1, two cumulative sums 2, divide 1, sigmoid 3, gate 1)."""
    return 11 * batch * tokens * channels


def aft_conv_flops(
    batch: int, tokens: int, channels: int, heads: int, kernel: int, grid: tuple[int, int], global_context: bool = True
) -> int:
    """AFT-conv core besides its convolution and band-matrix products (MACs): ``e^{K - max}`` 3 per key,
    ``e^K ⊙ V`` 1 per value, the kernel ``e^{w - m}`` 2 per tap, the row sums of the outside-window term 1 and
    ``local + e^{-m} · outside`` 2 per grid element of the C + h channels, the prefix tokens' global sums
    1 per token and channel, then divide 1, ``sigmoid(Q)`` 3 and the gate 1 per output element."""
    width = channels + heads
    cells = grid[0] * grid[1]
    total = 3 * batch * tokens * heads + batch * tokens * channels + 2 * heads * kernel * kernel
    if global_context:
        total += 3 * batch * width * cells
    total += batch * tokens * width  # prefix: the sum over all tokens
    return total + 5 * batch * tokens * channels


def _aft_flops(m: nn.Module, x: torch.Tensor, kw: dict[str, Any]) -> tuple[str, int]:
    from ..mixers import AFTConv, AFTFull, AFTLocal

    b, n, _ = x.shape
    if isinstance(m, AFTConv):
        layout = kw.get("layout") or _positional_layout(kw)
        grid = layout.grid if layout is not None and layout.grid is not None else (n, 1)
        return "AFT", aft_conv_flops(b, n, m.dim, m.num_heads, m.kernel_size, grid, m.outside == "zero")
    if isinstance(m, AFTLocal) and 0 < m.window < n <= m.max_len and (m.causal or n == m.max_len):  # banded path
        from ..mixers.aft_banded import MIN_BLOCK

        return "AFT", aft_local_banded_flops(b, n, m.hidden_dim, max(m.window, MIN_BLOCK), m.causal)
    if isinstance(m, AFTFull) and not (isinstance(m, AFTLocal) and m.window == 0):
        return "AFT", aft_full_flops(b, n, m.hidden_dim)
    return "AFT", aft_simple_flops(b, n, m.hidden_dim)


def _positional_layout(kw: dict[str, Any]) -> Any:
    args = kw.get("_args", ())
    return args[1] if len(args) > 1 else None


def _formula(m: nn.Module) -> Callable[[nn.Module, torch.Tensor, dict[str, Any]], tuple[str, int]] | None:
    """The extra-FLOPs formula of a module, or None (most modules: their work is MACs or not counted)."""
    from ..mixers import (
        AFTConv,
        AFTFull,
        AFTSimple,
        Attention,
        ExternalAttention,
        MultiHeadExternalAttention,
        ReAttention,
        RefinerAttention,
    )
    from ..models.t2t import TokenExternalAttention, TokenSelfAttention

    table = (
        (ReAttention, _reattention_flops),
        (RefinerAttention, _refiner_flops),
        (Attention, _attention_flops),
        (MultiHeadExternalAttention, _external_mh_flops),
        (ExternalAttention, _external_flops),
        (TokenExternalAttention, _token_external_flops),
        (TokenSelfAttention, _token_attention_flops),
        ((AFTFull, AFTSimple, AFTConv), _aft_flops),
    )
    return next((f for cls, f in table if isinstance(m, cls)), None)


def _extra_hook(acc: dict[str, int]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        x = args[0] if args else kwargs["x"]
        kind, n = _formula(module)(module, x, {**kwargs, "_args": args})
        acc[kind] += int(n)

    return hook


def mixer_extra_flops(module: nn.Module, x: torch.Tensor, **kwargs: Any) -> dict[str, int]:
    """Extra FLOPs of one call ``module(x, **kwargs)`` of a mixer, by kind (computed from shapes, nothing runs)."""
    f = _formula(module)
    if f is None:
        return {}
    kind, n = f(module, x, kwargs)
    return {kind: int(n)}
