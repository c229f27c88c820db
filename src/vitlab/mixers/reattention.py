"""Re-attention (DeepViT, Zhou et al. 2021, arXiv 2103.11886).

Paper: ``Re-Attention(Q, K, V) = Norm(Θᵀ · Softmax(Q Kᵀ / sqrt(d))) V`` with a
learnable head-mixing matrix ``Θ ∈ R^{H×H}`` and ``Norm`` = BatchNorm. The maps
of the H heads are mixed into H new maps, so deep blocks whose maps have
collapsed onto each other get fresh ones from the other heads' maps.

Implemented as the official code (dvit_repo ``ReAttention``; docs/semantics.md, Decision D1):
``Θᵀ`` is a 1×1 ``Conv2d(H, H)`` over the head axis (its weight ``W[g, h]`` is
``Θ[h, g]``) **with a bias**, applied after softmax and attention dropout;
``Norm`` is ``BatchNorm2d(H)`` over the ``(B, H, N, N)`` maps (heads are the
channels, statistics over B×N×N); the result is optionally scaled by
``d_h^-1/2`` (``transform_scale``, DeepViT-S) and is *not* renormalised, so its
rows need not sum to 1. Submodule names are the official ones, so official
checkpoints load unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.fold import can_fold, fold_bn
from ..ops.head_mix_norm import can_fuse, head_mix_batchnorm
from .attention import Attention, HeadMix, attention_map, attention_softmax_flops
from .base import TokenLayout, batchnorm_flops


class ReAttention(Attention):
    """Multi-head attention whose maps are re-mixed across heads before multiplying V.

    ``A = softmax(q kᵀ s)``; ``A' = BN_H(Conv1x1_{H→H}(drop(A))) · (s if transform_scale else 1)``;
    ``out = proj(merge_h(A'_h V_h))``. ``aux["attn"]`` is ``A'``. A previous
    block's map (``attn_prev``) is ignored, as in the official code.
    """

    flops_label = "re-attention maps"

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        transform_scale: bool = False,
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias, qk_scale, attn_drop, proj_drop, fused=False)
        # Θᵀ as a 1x1 conv over the head channels: A'_g = Σ_h W[g, h] A_h + b_g
        self.reatten_matrix = HeadMix(num_heads, num_heads)
        self.var_norm = nn.BatchNorm2d(num_heads)
        self.reatten_scale = self.scale if transform_scale else 1.0

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        """The softmax, then per map element the head mix's bias, the BatchNorm and the scale (when not 1)."""
        maps = batch * self.num_heads * tokens * tokens
        extra = (1 + batchnorm_flops(self.var_norm.training) + (1 if self.reatten_scale != 1.0 else 0)) * maps
        return attention_softmax_flops(batch, self.num_heads, tokens, tokens) + extra

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        q, k, v = self.qkv_heads(x)
        attn = self.attn_drop(attention_map(q, k, self.scale))
        if can_fold(self, attn):
            attn = self._remix_folded(attn)
        elif can_fuse(attn, self.var_norm):  # training: the same maps, a backward pass that keeps less
            attn = head_mix_batchnorm(attn, self.reatten_matrix, self.var_norm, self.reatten_scale)
        else:  # BN/conv may run in another precision under autocast; the map stays in V's dtype
            attn = self.var_norm(self.reatten_matrix(attn))
            attn = (attn * self.reatten_scale if self.reatten_scale != 1.0 else attn).to(v.dtype)
        out = self.project(attn @ v)
        return out, ({"attn": attn} if return_aux else {})

    def _remix_folded(self, attn: Tensor) -> Tensor:
        """Inference: ``s · BN(W A + b)`` as one head-mixing GEMM ``W' A`` plus a bias added in place, with the
        eval BatchNorm and the scale folded into ``W', b'`` (the same function; three passes over the maps fewer,
        and the result is in the standard (B, H, N, N) layout that ``attn @ v`` reads without a copy)."""
        b, h, n, _ = attn.shape
        w, bias = fold_bn(
            self.reatten_matrix.weight[:, :, 0, 0].float(), self.reatten_matrix.bias.float(), self.var_norm
        )
        w, bias = (w * self.reatten_scale).to(attn.dtype), (bias * self.reatten_scale).to(attn.dtype)
        out = torch.matmul(w, attn.reshape(b, h, n * n))  # (H, H) @ (B, H, N²): a GEMM over the head axis
        return out.add_(bias.view(h, 1)).view(b, h, n, n)
