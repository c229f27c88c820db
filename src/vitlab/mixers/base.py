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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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


class TokenMixer(nn.Module):
    """Base class: input checks and the ``return_aux`` convention.

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
