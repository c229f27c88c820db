"""Fixed-pattern sparse attention (baselines of AFT's Tables 2 and 4).

Softmax attention restricted to a fixed set of keys per query (Child et al. 2019, Eq. 2:
``attend(X, S) = (a(x_i, S_i))_i``, ``a(x_i, S_i) = softmax(q_i K_{S_i}ᵀ/√d) V_{S_i}``):

* :class:`SparseAttention` ``pattern="local"``: ``S_i = {j : |i - j| < window}`` (the sliding window of the Sparse
  Transformer's local component and of the Image Transformer's 1-D local attention); ``pattern="strided"``: the
  Sparse Transformer's strided pattern, ``|i - j| < stride`` or ``(i - j) mod stride = 0``, both in every head
  (its "merged head" form);
* :class:`LocalAttention2d`: the Image Transformer's 2-D local attention (Parmar et al. 2018): the image split
  into query blocks of ``(h_q, w_q)``, ``S_i`` the memory block around i's query block (``h_f`` rows above and
  ``w_f`` columns either side; rows below too when not causal).

Prefix tokens (class token) attend to and are attended by every token. Causal on request (keys j ≤ i, raster
order), with incremental decoding from a key/value cache. The fast path computes the pattern block by block
(:mod:`vitlab.ops.block_sparse`: O(N·s) time and memory for s keys a block); the plain path (the switch off,
``fused=False``, or the map asked for) masks the dense N x N product. Both compute the same function.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops import block_sparse as bs
from ..ops.switch import fast_paths_enabled
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
    return with_prefix(pattern_allows(pos[:, None] - pos[None, :], pattern, width), num_prefix, causal)


def with_prefix(allowed: Tensor, num_prefix: int, causal: bool) -> Tensor:
    """``allowed`` (N, N) with the prefix tokens seeing and seen by all, and j ≤ i if ``causal``."""
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

    def allows(self, row_len: int) -> bs.Predicate:
        """Whether query position i sees key position j (positions after the prefix; ``row_len`` unused)."""
        local = bs.local_allows(self.width, self.causal)
        if self.pattern == "local":
            return local
        strided = bs.strided_allows(self.width, self.causal)
        return lambda i, j: local(i, j) | strided(i, j)

    def blocks(self, n: int, layout: TokenLayout, device: torch.device) -> bs.Blocks | tuple[bs.Blocks, ...]:
        """The pattern over ``n`` tokens cut into blocks (:mod:`vitlab.ops.block_sparse`)."""
        if self.pattern == "local":
            return bs.local_blocks(n, self.width, self.causal, 0, device)
        return bs.strided_blocks(n, self.width, self.causal, device)

    def mask(self, n: int, layout: TokenLayout, device: torch.device) -> Tensor:
        """The dense (N, N) pattern of ``n`` tokens laid out as ``layout``."""
        return sparse_pattern(n, self.pattern, self.width, self.causal, layout.num_prefix, device)

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        q, k, v = self.qkv_heads(x)
        n, drop = x.shape[1], self.attn_drop.p if self.training else 0.0
        if self.fused and not return_aux and fast_paths_enabled():
            parts = self.blocks(n - layout.num_prefix, layout, x.device)
            if bs.pays_off(parts, n):
                out = bs.blocked_attention(q, k, v, parts, self.scale, drop, layout.num_prefix, self.causal)
                return self.project(out), {}
        # the pattern carries causality: one mask, not SDPA's is_causal (Attention.attend_heads) as well
        allowed = self.mask(n, layout, x.device)
        if return_aux or not self.fused:
            attn = attention_map(q, k, self.scale, bias=masking_bias(allowed, q.dtype))
            return self.project(self.attn_drop(attn) @ v), ({"attn": attn} if return_aux else {})
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=drop, scale=self.scale)
        return self.project(out), {}

    def step(self, x: Tensor, t: int, state: tuple[Tensor, Tensor]) -> Tensor:
        """Position t: the new query against the cached keys and values the pattern lets it see."""
        keys, values = state
        q, k, v = self.qkv_heads(x[:, None])
        keys[:, :, t : t + 1], values[:, :, t : t + 1] = k, v
        pos = torch.arange(t + 1, device=x.device)
        row = self.allows(self.row_length(t + 1))(pos[t], pos)
        out = F.scaled_dot_product_attention(
            q, keys[:, :, : t + 1], values[:, :, : t + 1], attn_mask=row[None], scale=self.scale
        )
        return self.proj(merge_heads(out))[:, 0]

    def row_length(self, n: int, layout: TokenLayout | None = None) -> int:
        """Tokens per image row (the 1-D patterns have none: ``n``)."""
        return n


class LocalAttention2d(SparseAttention):
    """The Image Transformer's local 2-D attention (module docstring) over a row-major image: the layout's patch
    grid, else rows of ``row_len`` tokens (the LM's sub-pixel sequence: 32 x 32 x 3 -> rows of 96), else one row.
    ``query_shape`` ``(h_q, w_q)``, ``memory_flange`` ``(h_f, w_f)``: each query block's memory spans
    ``h_q + h_f`` rows (``h_q + 2 h_f`` not causal) and ``w_q + 2 w_f`` columns."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        causal: bool = False,
        query_shape: Sequence[int] = (8, 16),
        memory_flange: Sequence[int] = (8, 16),
        row_len: int | None = None,
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias, attn_drop, proj_drop, causal)
        self.query_shape, self.memory_flange = tuple(map(int, query_shape)), tuple(map(int, memory_flange))
        if len(self.query_shape) != 2 or len(self.memory_flange) != 2 or min(self.query_shape) < 1:
            raise ValueError(f"LocalAttention2d: query_shape needs two sizes >= 1, got {query_shape}")
        if min(self.memory_flange) < 0 or (row_len is not None and row_len < 1):
            raise ValueError(f"LocalAttention2d: memory_flange {memory_flange} and row_len {row_len} must be >= 0, 1")
        self.pattern, self.row_len = "local2d", row_len

    def extra_repr(self) -> str:
        return (f"query_shape={self.query_shape}, memory_flange={self.memory_flange}, row_len={self.row_len}, "
                f"causal={self.causal}")  # fmt: skip

    def row_length(self, n: int, layout: TokenLayout | None = None) -> int:
        if layout is not None and layout.grid is not None:
            return layout.grid[1]
        return self.row_len or n

    def allows(self, row_len: int) -> bs.Predicate:
        return bs.local2d_allows(row_len, self.query_shape, self.memory_flange, self.causal)

    def blocks(self, n: int, layout: TokenLayout, device: torch.device) -> bs.Blocks:
        row_len = self.row_length(n, layout)
        return bs.local2d_blocks(n, row_len, self.query_shape, self.memory_flange, self.causal, device)

    def mask(self, n: int, layout: TokenLayout, device: torch.device) -> Tensor:
        p = layout.num_prefix
        pos = torch.arange(n - p, device=device)
        allowed = torch.ones(n, n, dtype=torch.bool, device=device)
        allowed[p:, p:] = self.allows(self.row_length(n - p, layout))(pos[:, None], pos[None, :])
        return with_prefix(allowed, p, self.causal)


def masking_bias(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``allowed``, -inf elsewhere: a mask as additive logits."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


__all__ = [
    "PATTERNS",
    "LocalAttention2d",
    "SparseAttention",
    "masking_bias",
    "pattern_allows",
    "sparse_pattern",
]
