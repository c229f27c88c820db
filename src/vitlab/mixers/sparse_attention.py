"""Fixed-pattern sparse attention (a baseline of AFT's Tables 2 and 4).

* :class:`SparseAttention` -- softmax attention restricted to a fixed set of keys per query (Child et al. 2019,
  Eq. 2: ``attend(X, S) = (a(x_i, S_i))_i``, ``a = softmax(q_i K_{S_i}ᵀ/√d) V_{S_i}``):
  ``pattern="local"``: ``S_i = {j : |i - j| < window}`` (the sliding window of the Sparse Transformer's local
  component and of the Image Transformer's 1-D local attention); ``pattern="strided"``: the Sparse Transformer's
  strided pattern, ``|i - j| < stride`` or ``(i - j) mod stride = 0``, both in every head (its "merged head"
  form). Prefix tokens (class token) attend to and are attended by every token. The pattern is applied as a
  mask over the dense N x N products: the function of the paper, not its block-sparse kernels' cost.
Causal on request (keys j ≤ i), with incremental decoding from a key/value cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import Attention, attention_map
from .base import TokenLayout, merge_heads

PATTERNS = ("local", "strided")


def sparse_pattern(
    n: int, pattern: str, width: int, causal: bool, num_prefix: int = 0, device: torch.device | None = None
) -> Tensor:
    """Which keys each query sees, (N, N) bool (True = attended): ``local`` ``|i - j| < width``; ``strided``
    ``|i - j| < width`` or ``(i - j) mod width = 0``; positions counted after the ``num_prefix`` prefix tokens,
    which see and are seen by all; ``causal`` keeps j ≤ i."""
    pos = torch.arange(n, device=device)
    allowed = pattern_allows(pos[:, None] - pos[None, :], pattern, width)
    allowed[:num_prefix] = True
    allowed[:, :num_prefix] = True
    return allowed.tril() if causal else allowed


def pattern_allows(offset: Tensor, pattern: str, width: int) -> Tensor:
    """Whether the pattern lets a query see a key ``offset = i - j`` positions before it."""
    allowed = offset.abs() < width
    return allowed | (offset % width == 0) if pattern == "strided" else allowed


class SparseAttention(Attention):
    """Softmax attention over the fixed pattern :func:`sparse_pattern` (module docstring); ``width`` =
    ``window`` for ``local``, ``stride`` for ``strided``. Same parameters as :class:`Attention`."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        causal: bool = False,
        pattern: str = "local",
        window: int = 256,
        stride: int = 128,
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias, None, attn_drop, proj_drop, causal)
        if pattern not in PATTERNS:
            raise ValueError(f"SparseAttention: pattern must be one of {PATTERNS}, got {pattern!r}")
        if min(window, stride) < 1:
            raise ValueError(f"SparseAttention: window and stride must be >= 1, got {window}, {stride}")
        self.pattern = pattern
        self.width = window if pattern == "local" else stride

    def extra_repr(self) -> str:
        return f"pattern={self.pattern}, width={self.width}, causal={self.causal}"

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        # the pattern carries causality: one mask, not SDPA's is_causal (Attention.attend_heads) as well
        q, k, v = self.qkv_heads(x)
        allowed = sparse_pattern(x.shape[1], self.pattern, self.width, self.causal, layout.num_prefix, x.device)
        if return_aux or not self.fused:
            attn = attention_map(q, k, self.scale, bias=masking_bias(allowed, q.dtype))
            return self.project(self.attn_drop(attn) @ v), ({"attn": attn} if return_aux else {})
        drop = self.attn_drop.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=drop, scale=self.scale)
        return self.project(out), {}

    def step(self, x: Tensor, t: int, state: tuple[Tensor, Tensor]) -> Tensor:
        """Position t: the new query against the cached keys and values the pattern lets it see."""
        keys, values = state
        q, k, v = self.qkv_heads(x[:, None])
        keys[:, :, t : t + 1], values[:, :, t : t + 1] = k, v
        row = pattern_allows(t - torch.arange(t + 1, device=x.device), self.pattern, self.width)[None]
        out = F.scaled_dot_product_attention(
            q, keys[:, :, : t + 1], values[:, :, : t + 1], attn_mask=row, scale=self.scale
        )
        return self.proj(merge_heads(out))[:, 0]


def masking_bias(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``allowed``, -inf elsewhere: a mask as additive logits."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


__all__ = [
    "PATTERNS",
    "SparseAttention",
    "masking_bias",
    "pattern_allows",
    "sparse_pattern",
]
