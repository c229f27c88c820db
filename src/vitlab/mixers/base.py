"""The token-mixer contract shared by every mixer family.

A token mixer maps tokens ``(B, N, C) -> (B, N, C)``. Mixers that need to know
how the tokens sit on the image (AFT-conv's 2-D kernel, a PEG) receive a
:class:`TokenLayout`; the others accept and ignore it, so any mixer can sit in
any block.

The one return path for intermediates: ``forward(x, layout, return_aux=True)``
returns ``(out, aux)`` where ``aux`` is a dict of tensors the mixer computed on
the way (``"attn"``: the (B, H, N, N) self-attention map it multiplied V with,
``"memory_attn"``: external attention's (B, H, N, S) map over its S memory
slots, ``"carry"``: a new map handed to the next block for Refined-ViT's shared
attention (absent: the block before's goes on), AFT's ``"keys"``...). Asking for aux never changes ``out``: attention
switches from SDPA to its explicit path, which computes the same function.

Mixers also describe themselves: :meth:`ElementwiseFlops.extra_flops` is the
elementwise work a MAC counter does not see (:mod:`vitlab.measure.flops` sums it
over a model), and causal mixers decode one token at a time through
:meth:`TokenMixer.init_state` / :meth:`TokenMixer.step` (:mod:`vitlab.tasks.lm.decode`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn


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


def token_count(x: Tensor, layout: TokenLayout) -> int:
    """N of tokens ``x`` (B, N, C). While torch.fx traces, ``x``'s sizes are symbols; the graph is built for the
    layout's grid (the model's own input size), so N is its prefix plus its patch tokens."""
    if isinstance(x, torch.fx.Proxy) and layout.grid is not None:
        return layout.num_prefix + layout.grid[0] * layout.grid[1]
    return x.shape[1]


def check_tokens(
    x: Tensor, name: str, dim: int, num_prefix: int, grid: tuple[int, int] | None, needs_grid: bool
) -> None:
    """ValueError unless ``x`` is ``(B, N, dim)`` tokens laid out as ``num_prefix`` prefix tokens and a ``grid``
    of patch tokens (required where ``needs_grid``); ``name`` says whose input it is."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != dim:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected tokens of shape (B, N, C={dim}), got {shape}")
    n = x.shape[1]
    if num_prefix < 0 or num_prefix > n:
        raise ValueError(f"{name}: num_prefix={num_prefix} is outside [0, N={n}]")
    if grid is not None:
        gh, gw = grid
        if gh * gw != n - num_prefix:
            raise ValueError(
                f"{name}: grid {gh}x{gw} needs N = {num_prefix} prefix + {gh * gw} patch tokens, got N = {n}"
            )
    elif needs_grid:
        raise ValueError(
            f"{name}: needs the patch grid; pass layout=TokenLayout(grid=(H, W), num_prefix=...) "
            f"with H*W = N - num_prefix"
        )


torch.fx.wrap("check_tokens")  # a torch.fx graph keeps the check as a call on the tokens it gets


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
        layout = layout or TokenLayout()
        check_tokens(x, type(self).__name__, self.dim, layout.num_prefix, layout.grid, self.needs_grid)
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


def grid_residual(x: Tensor, layout: TokenLayout, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``x + fn(x)`` on the patch grid ``(B, C, H, W)``, prefix tokens (class token) passed through unchanged: the
    form of CPVT's position encoding generator, shared by the PEG layers and the PEG-on-Q/K mixer."""
    if layout.grid is None:
        raise ValueError("a position encoding generator needs the patch grid (layout.grid)")
    prefix, grid = tokens_to_grid(x, layout)
    return grid_to_tokens(prefix, grid + fn(grid))
