"""Spatial-reduction attention (PVT; the attention of Twins' PCPVT / CPVT-v2).

Queries come from every token; keys and values from the token grid shrunk by a stride-r convolution
(``k = s = r``) followed by a LayerNorm, so a stage with N tokens attends to N / r² keys::

    q = W_q x;   x_r = LN(Conv_{r×r, stride r}(grid(x)))   (x itself when r = 1);   [k | v] = W_kv x_r
    out = proj(softmax(q kᵀ / sqrt(d_h)) v)

Submodule names are Twins' (``q``, ``kv``, ``proj``, ``sr``, ``norm``), so its checkpoints load after the
block-level rename of ``attn`` to ``mixer`` (:mod:`vitlab.interop`, source ``twins_cpvtv2``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.linear import fused_linear
from .attention import attention_map, attention_softmax_flops
from .base import TokenLayout, TokenMixer, check_divisible, merge_heads, split_heads, tokens_to_grid


class SpatialReductionAttention(TokenMixer):
    """Multi-head attention with keys and values from a spatially reduced grid (``sr_ratio`` r; none for r = 1).

    Runs on the patch tokens of ``layout.grid`` only (the pyramid has no prefix tokens); the grid must be a
    multiple of r. ``aux["attn"]`` is the (B, H, N, N / r²) map.
    """

    needs_grid = True
    flops_label = "attention softmax"

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        qk_scale: float | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        sr_ratio: int = 1,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__(dim)
        head_dim = check_divisible("SpatialReductionAttention", dim, num_heads)
        if sr_ratio < 1:
            raise ValueError(f"SpatialReductionAttention: sr_ratio must be >= 1, got {sr_ratio}")
        self.num_heads = num_heads
        self.scale = qk_scale or head_dim**-0.5
        self.sr_ratio = sr_ratio
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim, eps=norm_eps)

    def reduced(self, x: Tensor, layout: TokenLayout) -> Tensor:
        """The key/value input: ``LN(Conv_r(grid(x)))`` flattened, or ``x`` when r = 1."""
        if self.sr_ratio == 1:
            return x
        if layout.num_prefix or any(g % self.sr_ratio for g in layout.grid):
            raise ValueError(
                f"SpatialReductionAttention: needs a prefix-free grid divisible by sr_ratio={self.sr_ratio}, "
                f"got grid {layout.grid} with {layout.num_prefix} prefix tokens"
            )
        _, grid = tokens_to_grid(x, layout)
        return self.norm(self.sr(grid).flatten(2).transpose(1, 2))

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        return attention_softmax_flops(batch, self.num_heads, tokens, max(1, tokens // self.sr_ratio**2))

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        q = split_heads(self.q(x), self.num_heads)
        k, v = self.kv(self.reduced(x, layout)).chunk(2, -1)  # unpacked by name: torch.fx traces it
        k, v = split_heads(k, self.num_heads), split_heads(v, self.num_heads)
        aux: dict[str, Tensor] = {}
        if return_aux:
            attn = attention_map(q, k, self.scale)
            aux["attn"] = attn
            out = self.attn_drop(attn) @ v
        else:
            drop = self.attn_drop.p if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, scale=self.scale)
        return self.proj_drop(fused_linear(self.proj, merge_heads(out))), aux
