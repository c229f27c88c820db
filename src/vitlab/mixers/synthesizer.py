"""The Synthesizer (a baseline of AFT's Tables 2 and 4): attention weights synthesised without token-token
dot products (Tay et al. 2021, Eq. 1-3): ``dense``: ``B_i = W_2 relu(W_1 x_i + b_1) + b_2`` (one row of ``max_len`` logits per token and
head); ``random``: a learned ``R`` (H, max_len, max_len), or a fixed one (``trainable=False``);
``out = proj(softmax(B) G(x))`` with the value projection G. N tokens use the top-left N x N block.

Causal on request (keys j ≤ i), with incremental decoding from a value cache.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import TokenLayout, TokenMixer, check_divisible, merge_heads, split_heads

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


__all__ = ["SYNTHESIZERS", "Synthesizer"]
