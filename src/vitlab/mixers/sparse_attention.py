"""Fixed-pattern sparse attention and the Synthesizer (baselines of AFT's Tables 2 and 4).

* :class:`SparseAttention` -- softmax attention restricted to a fixed set of keys per query (Child et al. 2019,
  Eq. 2: ``attend(X, S) = (a(x_i, S_i))_i``, ``a = softmax(q_i K_{S_i}ᵀ/√d) V_{S_i}``):
  ``pattern="local"``: ``S_i = {j : |i - j| < window}`` (the sliding window of the Sparse Transformer's local
  component and of the Image Transformer's 1-D local attention); ``pattern="strided"``: the Sparse Transformer's
  strided pattern, ``|i - j| < stride`` or ``(i - j) mod stride = 0``, both in every head (its "merged head"
  form). Prefix tokens (class token) attend to and are attended by every token. The pattern is applied as a
  mask over the dense N x N products: the function of the paper, not its block-sparse kernels' cost.
* :class:`Synthesizer` -- attention weights synthesised without token-token dot products (Tay et al. 2021,
  Eq. 1-3): ``dense``: ``B_i = W_2 relu(W_1 x_i + b_1) + b_2`` (one row of ``max_len`` logits per token and
  head); ``random``: a learned ``R`` (H, max_len, max_len), or a fixed one (``trainable=False``);
  ``out = proj(softmax(B) G(x))`` with the value projection G. N tokens use the top-left N x N block.

Both are causal on request (keys j ≤ i) and decode incrementally from a key/value cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Attention, attention_map
from .base import TokenLayout, TokenMixer, check_divisible, merge_heads, split_heads

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


SYNTHESIZERS = ("dense", "random")


class Synthesizer(TokenMixer):
    """Synthesizer attention (Tay et al. 2021): ``out = proj(softmax(B) G(x))`` with synthesised logits B per head
    (module docstring). Needs N ≤ ``max_len``; ``causal`` masks keys after the query."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        max_len: int = 197,
        causal: bool = False,
        synthesizer: str = "dense",
        trainable: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__(dim)
        check_divisible("Synthesizer", dim, num_heads)
        if synthesizer not in SYNTHESIZERS:
            raise ValueError(f"Synthesizer: synthesizer must be one of {SYNTHESIZERS}, got {synthesizer!r}")
        if max_len < 1:
            raise ValueError(f"Synthesizer: max_len must be >= 1, got {max_len}")
        self.num_heads, self.max_len, self.causal, self.kind = num_heads, max_len, causal, synthesizer
        if synthesizer == "dense":
            self.synth = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, num_heads * max_len))
            self.register_parameter("random_logits", None)
        else:
            self.synth = None
            self.random_logits = nn.Parameter(torch.randn(num_heads, max_len, max_len) * 0.02, trainable)
        self.value = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def extra_repr(self) -> str:
        return f"{self.kind}, num_heads={self.num_heads}, max_len={self.max_len}, causal={self.causal}"

    def logits(self, x: Tensor, rows: slice, n: int) -> Tensor:
        """The synthesised logits (B, H, rows, n) of queries ``x`` (B, r, C) at positions ``rows``."""
        if self.synth is not None:
            b, r, _ = x.shape
            return self.synth(x).view(b, r, self.num_heads, self.max_len)[..., :n].transpose(1, 2)
        return self.random_logits[:, rows, :n].unsqueeze(0).expand(x.shape[0], -1, -1, -1)

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        n = x.shape[1]
        if n > self.max_len:
            raise ValueError(f"Synthesizer: {n} tokens, but max_len = {self.max_len}; build it with max_len >= {n}")
        logits = self.logits(x, slice(0, n), n)
        if self.causal:
            logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        attn = logits.float().softmax(-1).to(x.dtype)
        out = self.attn_drop(attn) @ split_heads(self.value(x), self.num_heads)
        return self.proj_drop(self.proj(merge_heads(out))), ({"attn": attn} if return_aux else {})

    def init_state(self, batch: int, max_len: int, like: Tensor) -> Tensor:
        """The value cache (B, H, max_len, d_h)."""
        return like.new_zeros(batch, self.num_heads, min(max_len, self.max_len), self.dim // self.num_heads)

    def step(self, x: Tensor, t: int, state: Tensor) -> Tensor:
        """Position t: its synthesised logits over positions ≤ t, against the cached values."""
        state[:, :, t] = split_heads(self.value(x[:, None]), self.num_heads)[:, :, 0]
        attn = self.logits(x[:, None], slice(t, t + 1), t + 1).float().softmax(-1).to(x.dtype)
        return self.proj(merge_heads(attn @ state[:, :, : t + 1]))[:, 0]


__all__ = [
    "PATTERNS",
    "SYNTHESIZERS",
    "SparseAttention",
    "Synthesizer",
    "masking_bias",
    "pattern_allows",
    "sparse_pattern",
]
