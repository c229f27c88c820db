"""External attention (Guo et al. 2021, arXiv 2105.02358) and its multi-head form (EAMLP).

Tokens attend to two small learnable memories shared by the whole data set
instead of to each other: ``out = M_v(DoubleNorm(M_k(F)))``, linear in N
(O(N·S·d) with S memory slots). Paper Algorithm 1:

    α̃ = F M_kᵀ                               (B, N, S)
    α̂_ij = exp(α̃_ij) / Σ_k exp(α̃_kj)         softmax over the tokens i
    α_ij = α̂_ij / Σ_k α̂_ik                    ℓ1 over the memory slots j
    out = α M_v

docs/semantics.md, Decisions E1/E2: single-head as Algorithm 1 (memories without bias, eps 1e-9
in the ℓ1 step, ``M_v`` initialised as ``M_kᵀ``); multi-head as the official
EAMLP code (query widened ``coef``× with ``coef``× as many heads, one ``M_k`` /
``M_v`` pair shared by all heads, memories with bias, output projection).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.double_norm import double_normalize
from ..ops.fold import can_fold
from ..ops.linear import fused_linear
from ..ops.switch import fx_tracing
from .base import SOFTMAX, TokenLayout, TokenMixer, check_divisible

#: how external attention normalises its map over the memory slots (docs/semantics.md, Decision E3)
MEMORY_NORMS = ("double", "softmax")


def normalize_memory(
    logits: Tensor, norm: str, token_dim: int, memory_dim: int, eps: float = 1e-9, inplace: bool = False
) -> Tensor:
    """EA's map from its logits: ``"double"`` = :func:`double_normalize`; ``"softmax"`` = the paper's softmax-only
    ablation, the double normalisation without its ℓ1 step: a softmax over the tokens for each memory slot
    (computed in fp32 for half-precision logits). A softmax over the slots instead would leave every token
    alone with the memories (no token would see another), so that is not the reading (Decision E3)."""
    if norm == "double":
        return double_normalize(logits, token_dim, memory_dim, eps, inplace)
    low = not fx_tracing() and logits.dtype in (torch.float16, torch.bfloat16)  # fx: a symbol without a dtype
    return logits.softmax(dim=token_dim, dtype=torch.float32 if low else None).to(logits.dtype)


def check_memory_norm(name: str, norm: str) -> str:
    if norm not in MEMORY_NORMS:
        raise ValueError(f"{name}: norm must be one of {', '.join(MEMORY_NORMS)}, got {norm!r}")
    return norm


def memory_norm_flops(norm: str, maps: int, tokens: int, slots: int) -> int:
    """Elementwise FLOPs of :func:`normalize_memory`: :func:`double_norm_flops`, or one softmax per element."""
    return double_norm_flops(maps, tokens, slots) if norm == "double" else maps * SOFTMAX * tokens * slots


def double_norm_flops(maps: int, tokens: int, slots: int) -> int:
    """Elementwise FLOPs of :func:`double_normalize` on ``maps`` (tokens x slots) logits: softmax over the
    tokens (5 per element), then ℓ1 over the slots (sum 1, divide 1 per element, + eps once per row)."""
    return maps * ((SOFTMAX + 2) * tokens * slots + tokens)


class ExternalAttention(TokenMixer):
    """Single-head external attention, paper Algorithm 1.

    ``mk = Linear(dim → S)`` and ``mv = Linear(S → dim)`` are the memories
    (``bias=False`` as the paper); ``aux["memory_attn"]`` is the (B, N, S) normalised
    map. ``num_heads`` exists so that configs can pass it to every mixer; it must
    be 1 (``build("external", dim, num_heads=h > 1)`` gives the multi-head class). ``norm="softmax"`` drops
    the ℓ1 step of the double normalisation (the paper's softmax-only ablation, :func:`normalize_memory`).
    """

    flops_label = "external attention norm"

    def __init__(
        self,
        dim: int,
        memory_size: int = 64,
        bias: bool = False,
        attn_drop: float = 0.0,
        eps: float = 1e-9,
        num_heads: int = 1,
        norm: str = "double",
    ) -> None:
        super().__init__(dim)
        self.memory_norm = check_memory_norm("ExternalAttention", norm)
        if memory_size < 1:
            raise ValueError(f"ExternalAttention: memory_size must be positive, got {memory_size}")
        if num_heads != 1:
            raise ValueError(
                f"ExternalAttention is single-head, got num_heads={num_heads}; use MultiHeadExternalAttention"
            )
        self.memory_size = memory_size
        self.eps = eps
        self.mk = nn.Linear(dim, memory_size, bias=bias)
        self.mv = nn.Linear(memory_size, dim, bias=bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.reset_parameters()

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        return memory_norm_flops(self.memory_norm, batch, tokens, self.memory_size)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``M_v = M_kᵀ`` at init (official EANet), as a copy: the two are trained independently.

        Call again after a model-wide weight init that re-draws ``mv``.
        """
        self.mv.weight.copy_(self.mk.weight.t())
        if self.mv.bias is not None:
            self.mv.bias.zero_()

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        attn = normalize_memory(self.mk(x), self.memory_norm, token_dim=1, memory_dim=2, eps=self.eps, inplace=True)
        out = self.mv(self.attn_drop(attn))
        return out, ({"memory_attn": attn} if return_aux else {})


class MultiHeadExternalAttention(TokenMixer):
    """Multi-head external attention as the official EAMLP code (``Attention`` in transformer_block.py).

    ``t = query(x)`` widens dim → coef·dim and splits it into coef·num_heads heads
    of width ``dim / num_heads``; every head uses the same ``mk`` (d_h → S) and
    ``mv`` (S → d_h) memories; softmax over tokens, ℓ1 over slots (eps 1e-9);
    heads are merged and ``proj`` maps coef·dim → dim. ``memory_size`` defaults
    to 256 // coef (64 for coef 4). ``aux["memory_attn"]`` is the (B, heads, N, S) map. ``norm="softmax"``: the
    softmax-only ablation (:func:`normalize_memory`).
    """

    flops_label = "external attention norm"

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        coef: int = 4,
        memory_size: int | None = None,
        qkv_bias: bool = True,
        memory_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm: str = "double",
    ) -> None:
        super().__init__(dim)
        self.memory_norm = check_memory_norm("MultiHeadExternalAttention", norm)
        head_dim = check_divisible("MultiHeadExternalAttention", dim, num_heads)
        if coef < 1:
            raise ValueError(f"MultiHeadExternalAttention: coef must be a positive integer, got {coef}")
        memory_size = 256 // coef if memory_size is None else memory_size
        if memory_size < 1:
            raise ValueError(f"MultiHeadExternalAttention: memory_size must be positive, got {memory_size}")
        self.num_heads = num_heads * coef
        self.coef = coef
        self.memory_size = memory_size
        self.query = nn.Linear(dim, dim * coef, bias=qkv_bias)
        self.mk = nn.Linear(head_dim, memory_size, bias=memory_bias)
        self.mv = nn.Linear(memory_size, head_dim, bias=memory_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim * coef, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        return memory_norm_flops(self.memory_norm, batch * self.num_heads, tokens, self.memory_size)

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        b, n, _ = x.shape
        # heads as a middle axis, (B, N, heads, d_h): a view of the query, and the memories' output is already
        # the merged (B, N, heads · d_h) layout -- no head split/merge copies (the same function as the
        # official (B, heads, N, d_h) layout; the softmax runs over the token axis 1)
        t = fused_linear(self.query, x).view(b, n, self.num_heads, -1)
        if can_fold(self, x) and self.memory_norm == "double":  # the fold relies on the softmax over the tokens
            attn, out = self._memories_folded(t)
            out = F.linear(out.view(b, n, -1), self.proj.weight, self._proj_bias())
        else:
            # the logits are this call's own: the map overwrites them (one map-sized buffer less a call)
            attn = normalize_memory(self.mk(t), self.memory_norm, token_dim=1, memory_dim=-1, inplace=True)
            out = fused_linear(self.proj, self.mv(self.attn_drop(attn)).view(b, n, -1))
        return self.proj_drop(out), ({"memory_attn": attn.transpose(1, 2)} if return_aux else {})

    def _memories_folded(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """Inference: ``mk``'s bias adds one constant per memory slot to the logits, which the softmax over the
        tokens cancels exactly, so it is skipped; ``mv``'s bias moves into the output projection's bias
        (:meth:`_proj_bias`); the ℓ1 step divides in place. Saves two bias passes and an allocation."""
        attn = double_normalize(F.linear(t, self.mk.weight), token_dim=1, memory_dim=-1, inplace=True)
        return attn, F.linear(attn, self.mv.weight)

    def _proj_bias(self) -> Tensor | None:
        """``proj.b + proj.W · [b_v, ..., b_v]``: ``mv``'s bias (shared by the heads) pushed through ``proj``."""
        if self.mv.bias is None:
            return self.proj.bias
        shift = self.proj.weight @ self.mv.bias.repeat(self.num_heads)
        return shift if self.proj.bias is None else self.proj.bias + shift
