"""The token-mixer contract shared by every mixer family.

A token mixer maps tokens ``(B, N, C) -> (B, N, C)``. Mixers that need to know
how the tokens sit on the image (AFT-conv's 2-D kernel, a PEG) receive a
:class:`TokenLayout`; the others accept and ignore it, so any mixer can sit in
any block.

The one return path for intermediates: ``forward(x, layout, return_aux=True)``
returns ``(out, aux)`` where ``aux`` is a dict of tensors the mixer computed on
the way (``"attn"``: the (B, H, N, N) self-attention map it multiplied V with,
``"memory_attn"``: external attention's (B, H, N, S) map over its S memory
slots, ``"carry"``: the map handed to the next block for Refined-ViT's shared
attention, AFT's ``"keys"``...). Asking for aux never changes ``out``: attention
switches from SDPA to its explicit path, which computes the same function.

Mixers also describe themselves: :meth:`ElementwiseFlops.extra_flops` is the
elementwise work a MAC counter does not see (:mod:`vitlab.measure.flops` sums it
over a model), and causal mixers decode one token at a time through
:meth:`TokenMixer.init_state` / :meth:`TokenMixer.step` (:mod:`vitlab.lm.decode`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import onednn


@dataclass(frozen=True)
class TokenLayout:
    """Where the tokens of a ``(B, N, C)`` sequence come from.

    ``num_prefix`` tokens (class, distillation) lead the sequence; the other
    ``N - num_prefix`` tokens are a row-major ``grid = (H, W)`` of patches, or a
    plain 1-D sequence when ``grid`` is None.
    """

    grid: tuple[int, int] | None = None
    num_prefix: int = 0

    @staticmethod
    def sequence(num_prefix: int = 0) -> TokenLayout:
        return TokenLayout(None, num_prefix)


MixerOutput = Tensor | tuple[Tensor, dict[str, Tensor]]

# FLOPs per element of the elementwise steps ``extra_flops`` counts: a softmax is max, subtract, exp, sum and
# divide; a sigmoid 3; ReLU6 2 (a BatchNorm: batchnorm_flops)
SOFTMAX, SIGMOID, RELU6 = 5, 3, 2


def batchnorm_flops(training: bool) -> int:
    """FLOPs per element of a BatchNorm: 2 in eval mode (its running statistics), 5 in training."""
    return 5 if training else 2


class ElementwiseFlops:
    """A token mixer's FLOPs outside its matrix products, which a MAC counter does not see.

    Convention: matrix products and convolutions are MACs (counted from shapes by
    :mod:`vitlab.measure.flops`, which reports ``FLOPs = 2 x MACs + extra_flops``). ``extra_flops`` counts
    one FLOP per elementwise add, multiply, divide, compare or exponential of one forward call on ``batch``
    sequences of ``tokens`` tokens laid out as ``layout``: a softmax costs :data:`SOFTMAX` per element, a
    sigmoid :data:`SIGMOID`, ReLU6 :data:`RELU6`, a BatchNorm :func:`batchnorm_flops` in the mode the
    mixer is in now. Token-wise LayerNorm, GELU and the blocks' residual adds are not counted (as the papers'
    own counts). ``with_attn_prev``: the call receives the previous block's map (Refined-ViT's chain).

    The default is no such work: 0, and no ``flops_label`` (the mixer is left out of per-label totals).
    """

    #: the label of these FLOPs in per-label totals (the mixers of one family share it); None = none counted
    flops_label: ClassVar[str | None] = None

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        return 0


class TokenMixer(ElementwiseFlops, nn.Module):
    """Base class: input checks, the ``return_aux`` convention, and the defaults of the self-descriptions
    (:class:`ElementwiseFlops`, incremental decoding).

    Subclasses implement ``mix(x, layout, attn_prev, return_aux) -> (out, aux)``.
    """

    #: the mixer cannot run without ``layout.grid`` (2-D local operators)
    needs_grid: ClassVar[bool] = False
    #: the mixer consumes the previous block's attention map (Refined-ViT)
    uses_attn_prev: ClassVar[bool] = False

    def __init__(self, dim: int) -> None:
        super().__init__()
        if dim <= 0:
            raise ValueError(f"{type(self).__name__}: dim must be positive, got {dim}")
        self.dim = dim

    def forward(
        self,
        x: Tensor,
        layout: TokenLayout | None = None,
        *,
        attn_prev: Tensor | None = None,
        return_aux: bool = False,
    ) -> MixerOutput:
        layout = self.check_input(x, layout)
        out, aux = self.mix(x, layout, attn_prev, return_aux)
        return (out, aux) if return_aux else out

    def mix(
        self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool
    ) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def init_state(self, batch: int, max_len: int, like: Tensor) -> Any:
        """Incremental decoding of a causal mixer: the state before the first token of ``batch`` sequences of at
        most ``max_len`` tokens (on ``like``'s device). Mixers that can decode override this and :meth:`step`."""
        raise ValueError(f"no incremental decoding for {type(self).__name__}")

    def step(self, x: Tensor, t: int, state: Any) -> Tensor:
        """The output (B, C) at position ``t`` for its input ``x`` (B, C), reading (and updating in place) the
        ``state`` of positions < t: position t of the causal forward on the whole sequence."""
        raise NotImplementedError

    def check_input(self, x: Tensor, layout: TokenLayout | None) -> TokenLayout:
        name = type(self).__name__
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected tokens of shape (B, N, C={self.dim}), got {shape}")
        layout = layout or TokenLayout()
        n = x.shape[1]
        if layout.num_prefix < 0 or layout.num_prefix > n:
            raise ValueError(f"{name}: num_prefix={layout.num_prefix} is outside [0, N={n}]")
        if layout.grid is not None:
            gh, gw = layout.grid
            if gh * gw != n - layout.num_prefix:
                raise ValueError(
                    f"{name}: grid {gh}x{gw} needs N = {layout.num_prefix} prefix + {gh * gw} patch tokens, got N = {n}"
                )
        elif self.needs_grid:
            raise ValueError(
                f"{name}: needs the patch grid; pass layout=TokenLayout(grid=(H, W), num_prefix=...) "
                f"with H*W = N - num_prefix"
            )
        return layout


def split_heads(t: Tensor, num_heads: int) -> Tensor:
    """(B, N, H*d) -> (B, H, N, d), head-major channel split (as every reference code)."""
    b, n, c = t.shape
    return t.view(b, n, num_heads, c // num_heads).transpose(1, 2)


def merge_heads(t: Tensor) -> Tensor:
    """(B, H, N, d) -> (B, N, H*d)."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def check_divisible(name: str, dim: int, num_heads: int) -> int:
    if num_heads <= 0 or dim % num_heads:
        raise ValueError(f"{name}: dim={dim} must be divisible by num_heads={num_heads}")
    return dim // num_heads


def tokens_to_grid(x: Tensor, layout: TokenLayout) -> tuple[Tensor, Tensor]:
    """Split ``(B, N, C)`` into prefix ``(B, P, C)`` and the patch grid ``(B, C, H, W)``."""
    assert layout.grid is not None
    p = layout.num_prefix
    b, _, c = x.shape
    grid = x[:, p:].transpose(1, 2).reshape(b, c, *layout.grid)
    return x[:, :p], grid


def grid_to_tokens(prefix: Tensor, grid: Tensor) -> Tensor:
    """Inverse of :func:`tokens_to_grid`."""
    return torch.cat([prefix, grid.flatten(2).transpose(1, 2)], dim=1)


# --------------------------------------------------------------------------- inference fast paths


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


_ONEDNN = torch.backends.mkldnn.is_available()


def _onednn_cpu(x: Tensor, weight: Tensor, dtypes: tuple[torch.dtype, ...], compiled: bool = False) -> bool:
    """Whether oneDNN may compute a linear layer of ``x``: the dtype, the CPU, autocast off (it picks the product's
    precision itself), eager mode (``compiled``: or inside ``torch.compile``), not traced or exported, no torch.func
    transform, and no dispatch mode watching the ops other than the FLOP counter (fake tensors know aten's ops, not
    all of oneDNN's)."""
    if not (x.dtype in dtypes and weight.dtype == x.dtype and x.device.type == "cpu" and x.numel() > 0 and _ONEDNN):
        return False
    if torch.compiler.is_compiling():  # before the queries that torch.compile cannot trace (a graph break)
        return compiled and not torch.is_autocast_enabled("cpu")
    mode = _get_current_dispatch_mode()
    return (
        not traced_or_exported()
        and not torch.is_autocast_enabled("cpu")
        and (mode is None or type(mode).__name__ in ("FlopCounterMode", "_FlopCounterMode"))
        and not torch._C._are_functorch_transforms_active()  # torch.func (grad, vmap): aten's ops have their rules
    )


def _records(x: Tensor, weight: Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def fuses_linear(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`fused_linear` takes oneDNN's fused primitive (inference): fp32 or bf16 input and weights of
    one dtype on the CPU, autocast off, nothing recorded by autograd, eager mode (not compiled, traced or
    exported) and no dispatch mode but the FLOP counter."""
    return _onednn_cpu(x, weight, (torch.float32, torch.bfloat16)) and not _records(x, weight)


def trains_linear_in_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`fused_linear` runs a training step's products in :class:`vitlab.mixers.onednn.OneDNNLinear`
    (compiled: :func:`vitlab.mixers.onednn.compiled_linear`): fp32 on the CPU while autograd records, under the
    other conditions of :func:`fuses_linear`."""
    return _onednn_cpu(x, weight, (torch.float32,), compiled=True) and _records(x, weight)


def fused_linear(linear: nn.Linear, x: Tensor, gelu: bool = False, residual: Tensor | None = None) -> Tensor:
    """``linear(x)``, then the exact GELU (``gelu``) or ``+ residual``, with the products in oneDNN on the CPU.

    Inference (:func:`fuses_linear`): ``F.linear`` copies the bias into its output (a broadcast copy, slow for its
    size) and accumulates the product onto it, and GELU and the residual add are one more pass over the output
    each: in bf16 together more time than the product itself, in fp32 10-25 % of it (DeiT-S's fc1 at batch 8:
    13.8 ms plain, 10.4 ms fused). oneDNN's linear primitive applies the bias, GELU or the addition to the
    product's result as it leaves the kernel. Training in fp32 (:func:`trains_linear_in_onednn`): the products
    of :class:`vitlab.mixers.onednn.OneDNNLinear` (bias and residual inside the forward product; GELU after it,
    since its gradient needs the product). In float64, under autocast, on other devices and while a graph is
    traced or exported these are the plain operations, unchanged."""
    if residual is not None and gelu:
        raise ValueError("fused_linear: either gelu or residual, not both")
    # a replaced layer (a subclass: LoRA, quantised; nn.Identity) runs as it is
    w, b = (linear.weight, linear.bias) if type(linear) is nn.Linear else (None, None)
    # the residual goes into the product when it has the output's shape (the primitive does not broadcast)
    fits = w is not None and residual is not None and residual.shape == (*x.shape[:-1], w.shape[0])
    inside = residual if fits else None
    if w is not None and fuses_linear(x, w):
        y, gelu = onednn.linear(x, w, b, inside, gelu), False  # GELU inside the product too
    elif w is not None and trains_linear_in_onednn(x, w):
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


def can_fold(module: nn.Module, t: Tensor) -> bool:
    """Whether an eval-only fast path may run: eval mode (BatchNorm uses its running statistics) and no
    autograd (the fast paths work in place)."""
    if module.training or (torch.is_grad_enabled() and (t.requires_grad or _any_grad(module))):
        return False
    return all(m.running_var is not None for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))


def _any_grad(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def fold_bn(weight: Tensor, bias: Tensor | None, bn: nn.BatchNorm2d) -> tuple[Tensor, Tensor]:
    """``BN(conv(x)) = conv'(x)``: the running-statistics BatchNorm folded into the conv's weight and bias."""
    g = bn.weight / torch.sqrt(bn.running_var + bn.eps) if bn.affine else torch.rsqrt(bn.running_var + bn.eps)
    shift = (bn.bias if bn.affine else 0) - bn.running_mean * g
    w = weight * g.view(-1, *[1] * (weight.dim() - 1))
    return w, shift if bias is None else bias * g + shift


def grid_residual(x: Tensor, layout: TokenLayout, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``x + fn(x)`` on the patch grid ``(B, C, H, W)``, prefix tokens (class token) passed through unchanged: the
    form of CPVT's position encoding generator, shared by the PEG layers and the PEG-on-Q/K mixer."""
    if layout.grid is None:
        raise ValueError("a position encoding generator needs the patch grid (layout.grid)")
    prefix, grid = tokens_to_grid(x, layout)
    return grid_to_tokens(prefix, grid + fn(grid))
