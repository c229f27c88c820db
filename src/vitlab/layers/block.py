"""The pre-norm transformer block that holds one token mixer."""

from __future__ import annotations

from torch import Tensor, nn

from ..mixers.base import MixerOutput, TokenLayout, TokenMixer
from .drop import DropPath
from .mlp import LayerScale, Mlp


class Block(nn.Module):
    """``x += DP(ls1(mixer(LN(s·x))))/s ; x += DP(ls2(MLP(LN(s·x))))/s``.

    ``residual_scale`` s = 0.5 reproduces the official Refiner/DeepViT code
    ("adjust_ratio" / "scale_adjustment"); s = 1 is the standard pre-norm block.
    ``ls_init`` enables LayerScale per branch (Refiner: MLP branch only, 1e-5).
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
    ) -> None:
        super().__init__()
        self.residual_scale = residual_scale
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.mixer = mixer
        self.ls1 = LayerScale(dim, ls_init[0]) if ls_init[0] is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.ls2 = LayerScale(dim, ls_init[1]) if ls_init[1] is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(
        self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None = None, return_aux: bool = False
    ) -> MixerOutput:
        s = self.residual_scale
        scaled = x if s == 1.0 else x * s
        mixed = self.mixer(self.norm1(scaled), layout, attn_prev=attn_prev, return_aux=return_aux)
        mixed, aux = mixed if return_aux else (mixed, {})
        x = x + self.drop_path1(self.ls1(mixed)) / s
        scaled = x if s == 1.0 else x * s
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(scaled)))) / s
        return (x, aux) if return_aux else x
