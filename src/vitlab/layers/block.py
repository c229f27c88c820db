"""The pre-norm transformer block that holds one token mixer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..mixers.base import MixerOutput, TokenLayout, TokenMixer
from .drop import DropPath
from .mlp import LayerScale, Mlp


class TokenBatchNorm(nn.BatchNorm1d):
    """BatchNorm over the channels of tokens ``(B, N, C)``: statistics over the batch and the tokens (MoCo v3's
    replacement for LayerNorm, tried in EAMLP; docs/semantics.md, Decision E4)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__(dim, eps=eps)

    def _check_input_dim(self, input: Tensor) -> None:
        if not isinstance(input, torch.fx.Proxy):  # torch.fx: a symbol has no dimensions to check
            super()._check_input_dim(input)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


NORMS = ("layer", "batch")


def token_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``LayerNorm(dim, eps)`` (``"layer"``) or :class:`TokenBatchNorm` (``"batch"``, BatchNorm's own eps 1e-5)."""
    if kind not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {kind!r}")
    return nn.LayerNorm(dim, eps=eps) if kind == "layer" else TokenBatchNorm(dim)


class Block(nn.Module):
    """``x += DP(ls1(mixer(LN(s·x))))/s ; x += DP(ls2(MLP(LN(s·x))))/s``.

    ``residual_scale`` s = 0.5 reproduces the official Refiner/DeepViT code
    ("adjust_ratio" / "scale_adjustment"); s = 1 is the standard pre-norm block.
    ``ls_init`` enables LayerScale per branch (Refiner: MLP branch only, 1e-5).
    ``norm="batch"`` puts :class:`TokenBatchNorm` in place of both LayerNorms (EAMLP's BatchNorm ablation).
    """

    def __init__(
        self,
        dim: int,
        mixer: TokenMixer,
        mlp_ratio: float = 4.0,
        drop: float = 0.0,
        drop_path: float = 0.0,
        norm_eps: float = 1e-6,
        ls_init: tuple[float | None, float | None] = (None, None),
        residual_scale: float = 1.0,
        norm: str = "layer",
    ) -> None:
        super().__init__()
        self.residual_scale = residual_scale
        self.norm1 = token_norm(norm, dim, norm_eps)
        self.mixer = mixer
        self.ls1 = LayerScale(dim, ls_init[0]) if ls_init[0] is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = token_norm(norm, dim, norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.ls2 = LayerScale(dim, ls_init[1]) if ls_init[1] is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(
        self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None = None, return_aux: bool = False
    ) -> MixerOutput:
        mixed = self.mixer(self._norm(self.norm1, x), layout, attn_prev=attn_prev, return_aux=return_aux)
        mixed, aux = mixed if return_aux else (mixed, {})
        x = self._residual(x, mixed, self.ls1, self.drop_path1)
        if type(self.mlp) is Mlp and self._plain_residual(self.ls2, self.drop_path2):
            x = self.mlp(self._norm(self.norm2, x), residual=x)  # x + MLP(...): fused in bf16 inference
        else:
            x = self._residual(x, self.mlp(self._norm(self.norm2, x)), self.ls2, self.drop_path2)
        return (x, aux) if return_aux else x

    def _plain_residual(self, ls: nn.Module, drop: DropPath) -> bool:
        """Whether the residual branch is a plain ``x + y`` (no scale, no LayerScale, no active drop-path)."""
        return self.residual_scale == 1.0 and not isinstance(ls, LayerScale) and not (drop.p > 0.0 and drop.training)

    # Speed: the scale s, LayerScale and the residual add cost one full pass over the tokens each; on CPU
    # these passes are a good part of a block's time, so they are folded into the norm and the add.
    def _norm(self, norm: nn.Module, x: Tensor) -> Tensor:
        """``norm(s·x)``, computed as LayerNorm of x with eps / s² (the same function, one pass fewer)."""
        s = self.residual_scale
        if s == 1.0:
            return norm(x)
        if not isinstance(norm, nn.LayerNorm):
            return norm(x * s)
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps / (s * s))

    def _residual(self, x: Tensor, y: Tensor, ls: nn.Module, drop: DropPath) -> Tensor:
        """``x + drop(ls(y)) / s`` in one op when drop-path is inactive (eval, or rate 0)."""
        s = self.residual_scale
        if drop.p > 0.0 and drop.training:
            return x + drop(ls(y)) / s
        if isinstance(ls, LayerScale):
            return torch.addcmul(x, y, ls.gamma, value=1.0 / s)
        return x + y if s == 1.0 else torch.add(x, y, alpha=1.0 / s)
