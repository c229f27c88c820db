"""The lambda layer (Bello 2021, LambdaNetworks; the Lambda baselines of AFT's Table 7).

A lambda layer summarises the context into linear functions ("lambdas") and applies them to each query
(paper Eq. 1-3, multi-query form with h heads sharing keys and values)::

    K̄ = softmax over positions m of K            (keys K = X W_K, (m, k))
    λ^c = K̄ᵀ V                                   content lambda (k, v), V = X W_V (m, v)
    λ^p_n = E_nᵀ V                               position lambda of query n (k, v), E_n (m, k)
    y_n^h = (λ^c + λ^p_n)ᵀ q_n^h                 q_n^h: head h's query (k), y_n = concat_h y_n^h (h·v = C)

Queries and values are batch-normalised (the lambda paper's setting and the public implementation AFT used;
AFT's text says queries and keys, which would change its counts by 96 parameters a block, not their rounding).
The position embeddings are relative: ``E_nm = R[Δy, Δx]`` for patch tokens n, m with the 2-D offset clipped
to ±``max_distance`` (a learned (2K+1, 2K+1, k) table); a pair with a prefix token (class token) uses one
learned embedding instead. A plain sequence (no grid) is a 1 x N grid. Not causal: the softmax over all
positions and the batch-normalised values see the whole sequence.

Output projection (``out_proj``, default on): ``out_n = W_O y_n + b_O``, a Linear(C, C) as the attention it
replaces in the DeiT block has. The lambda paper's layer has none (in a ResNet bottleneck a 1x1 convolution
follows it); AFT's Table 7 counts (Lambda tiny 4.8M, small 17.7M; DeiT blocks, L = 12, |k| = 16, |u| = 1,
GAP, no class token) are reproduced only with it and with DeiT's learned position table kept (196 x C; AFT
removed the class token only). Per block, with d = C, h heads and v = C / h::

    W_Q d·16h + W_K d·16 + W_V d·v + BN(q) 2·16h + BN(v) 2v + R 27·27·16      tiny 36,464   small 79,568
    LayerNorms 4d + MLP 8d² + 5d                                               tiny 296,640  small 1,183,104
    W_O d² + d                                                                 tiny 37,056   small 147,840

plus patch embedding 768d + d, final norm 2d, head 1000d + 1000 and the table 196d. Totals:

    no W_O, no table      tiny 4,338,280 (4.3M)   small 15,833,128 (15.8M)
    + W_O                 tiny 4,782,952 (4.8M)   small 17,607,208 (17.6M: not 17.7)
    + table only          tiny 4,375,912 (4.4M)   small 15,908,392 (15.9M)
    + W_O + table         tiny 4,820,584 (4.8M)   small 17,682,472 (17.7M)    <- the paper's counts
    + W_O without bias    tiny 4,818,280 (4.8M)   small 17,677,864 (17.7M)    (also rounds right; DeiT's has one)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import TokenLayout, TokenMixer, check_divisible


def batch_norm_tokens(bn: nn.BatchNorm1d, x: Tensor) -> Tensor:
    """BatchNorm over the channels of tokens (B, N, C)."""
    return bn(x.transpose(1, 2)).transpose(1, 2)


class LambdaLayer(TokenMixer):
    """Lambda layer with content and relative position lambdas (module docstring). ``key_dim`` = |k| (paper
    and AFT's Table 7: 16); values are C / ``num_heads`` wide. ``prefix_embedding=False``: no embedding for pairs
    with a prefix token (models without a class token), and none may come. ``out_proj``: the Linear(C, C) after
    the lambdas that AFT's counts imply (``False``: the lambda paper's layer, ``y`` itself)."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 4,
        key_dim: int = 16,
        max_distance: int = 13,
        prefix_embedding: bool = True,
        out_proj: bool = True,
    ) -> None:
        super().__init__(dim)
        value_dim = check_divisible("LambdaLayer", dim, num_heads)
        if key_dim < 1 or max_distance < 0:
            raise ValueError(f"LambdaLayer: key_dim must be >= 1 and max_distance >= 0, got {key_dim}, {max_distance}")
        self.num_heads, self.key_dim, self.value_dim, self.max_distance = num_heads, key_dim, value_dim, max_distance
        self.to_q = nn.Linear(dim, key_dim * num_heads, bias=False)
        self.to_k = nn.Linear(dim, key_dim, bias=False)
        self.to_v = nn.Linear(dim, value_dim, bias=False)
        self.norm_q = nn.BatchNorm1d(key_dim * num_heads)
        self.norm_v = nn.BatchNorm1d(value_dim)
        size = 2 * max_distance + 1
        self.rel_pos = nn.Parameter(torch.randn(size, size, key_dim) * key_dim**-0.5)
        self.prefix_pos = nn.Parameter(torch.randn(key_dim) * key_dim**-0.5) if prefix_embedding else None
        self.proj = nn.Linear(dim, dim) if out_proj else None

    def no_weight_decay(self) -> set[str]:
        return {"rel_pos", "prefix_pos"} if self.prefix_pos is not None else {"rel_pos"}

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, key_dim={self.key_dim}, max_distance={self.max_distance}, "
            f"out_proj={self.proj is not None}"
        )

    def position_embeddings(self, n: int, layout: TokenLayout) -> Tensor:
        """E (N, N, k): the relative embedding of every (query, context) pair."""
        p = layout.num_prefix
        if p and self.prefix_pos is None:
            raise ValueError(
                f"LambdaLayer: {p} prefix token(s) (class token), but built with prefix_embedding=False; "
                "build it with prefix_embedding=True or drop the class token"
            )
        gh, gw = layout.grid or (1, n - p)
        ys, xs = torch.meshgrid(
            torch.arange(gh, device=self.rel_pos.device), torch.arange(gw, device=self.rel_pos.device), indexing="ij"
        )
        ys, xs = ys.flatten(), xs.flatten()
        k = self.max_distance
        dy = (ys[None] - ys[:, None]).clamp(-k, k) + k
        dx = (xs[None] - xs[:, None]).clamp(-k, k) + k
        if not p:
            return self.rel_pos[dy, dx]
        emb = self.prefix_pos.expand(n, n, -1).clone()
        emb[p:, p:] = self.rel_pos[dy, dx]
        return emb

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        b, n, _ = x.shape
        q = batch_norm_tokens(self.norm_q, self.to_q(x)).view(b, n, self.num_heads, self.key_dim).transpose(1, 2)
        keys = self.to_k(x).softmax(dim=1)  # normalised over the context positions
        v = batch_norm_tokens(self.norm_v, self.to_v(x))  # (B, N, v)
        content = keys.transpose(1, 2) @ v  # λ^c (B, k, v)
        emb = self.position_embeddings(n, layout).to(x.dtype)
        position_logits = torch.einsum("bhnk,nmk->bhnm", q, emb)  # q_n · E_nm
        y = q @ content.unsqueeze(1) + position_logits @ v.unsqueeze(1)  # (B, H, N, v)
        y = y.transpose(1, 2).reshape(b, n, self.dim)
        return (self.proj(y) if self.proj is not None else y), {}


__all__ = ["LambdaLayer", "batch_norm_tokens"]
