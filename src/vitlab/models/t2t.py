"""T2T-ViT (Yuan et al. 2021) and EAMLP (Guo et al. 2021): T2T-ViT with every attention replaced.

The tokens-to-token (T2T) module turns the image into tokens progressively:
a soft split (overlapping ``unfold``) makes one token per window, a small
token layer re-mixes and narrows them, they are folded back into a grid and
split again. The backbone is a stack of pre-norm blocks over
``[cls] + tokens`` with a fixed 1-D sinusoid position table, and the class
token feeds the head.

EAMLP (official code: MenghaoGuo/EANet ``EAMLP/models``) keeps this frame
and swaps the mixers: the token layers use single-head external attention
with S = 128 memory slots (``token_performer.py``) and every backbone block
uses multi-head external attention (``transformer_block.py``; vitlab's
``external_mh``). Any vitlab mixer can sit in the backbone blocks.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers import Mlp, sinusoid_1d
from ..layers.patch_embed import image_size
from ..mixers.attention import attention_map, attention_softmax_flops
from ..mixers.base import ElementwiseFlops, TokenLayout
from ..mixers.external import double_norm_flops
from ..ops.double_norm import double_normalize
from ..ops.soft_split import soft_split
from .base import Classifier, MixerSpec, build_blocks, check_pool, run_blocks

# (kernel, stride, padding) of each soft split; T2T-ViT's strides 4·2·2 give a 14x14 grid at 224 px
T2T_SOFT_SPLIT = ((7, 4, 2), (3, 2, 1), (3, 2, 1))
# The official EAMLP attention ignores qkv_bias: its query Linear always has a bias
EAMLP_MIXER = ("external_mh", {"qkv_bias": True})


def _as_pair(v: int | Sequence[int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


class TokenExternalAttention(ElementwiseFlops, nn.Module):
    """EAMLP's token-layer attention: single-head external attention that narrows ``in_dim → out_dim``.

    ``t = q_linear(x)``; ``α = DoubleNorm(t M_kᵀ)`` (softmax over tokens, ℓ1 over
    the S memory slots, eps 1e-9: paper Algorithm 1); ``out = t + proj(α M_vᵀ + b_v)``.
    As the official code: M_k has no bias, M_v has one, and the residual is taken
    from the query because the width changes. ``aux["memory_attn"]`` is the (B, N, S) map.
    """

    flops_label = "external attention norm"

    def __init__(
        self, in_dim: int, out_dim: int, memory_size: int = 128, attn_drop: float = 0.0, proj_drop: float = 0.0
    ) -> None:
        super().__init__()
        self.q_linear = nn.Linear(in_dim, out_dim)
        self.mk = nn.Linear(out_dim, memory_size, bias=False)
        self.mv = nn.Linear(memory_size, out_dim)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(out_dim, out_dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``M_v = M_kᵀ`` and ``b_v = 0``, what the official init leaves (there the two share storage)."""
        self.mv.weight.copy_(self.mk.weight.t())
        nn.init.zeros_(self.mv.bias)

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        """The double normalisation, and the residual ``t + ...`` (1 per output element)."""
        return double_norm_flops(batch, tokens, self.mk.out_features) + batch * tokens * self.q_linear.out_features

    def forward(self, x: Tensor, return_aux: bool = False) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        t = self.q_linear(x)
        # the fresh logits are this call's own: normalised in their buffer
        attn = double_normalize(self.mk(t), token_dim=1, memory_dim=2, inplace=True)
        out = t + self.proj_drop(self.proj(self.mv(self.attn_drop(attn))))
        return (out, {"memory_attn": attn}) if return_aux else out


class TokenSelfAttention(ElementwiseFlops, nn.Module):
    """The original T2T-ViT token-layer attention (``token_transformer.py``): one head, ``in_dim → out_dim``.

    ``q, k, v = qkv(x)`` each ``out_dim`` wide; ``out = v + proj(softmax(q kᵀ·s) v)``.
    The scale is ``in_dim^-1/2`` (the official code takes the head width from the
    *input* width) and the residual comes from ``v`` because the width changes.
    """

    flops_label = "attention softmax"

    def __init__(
        self, in_dim: int, out_dim: int, qkv_bias: bool = False, attn_drop: float = 0.0, proj_drop: float = 0.0
    ) -> None:
        super().__init__()
        self.scale = in_dim**-0.5
        self.qkv = nn.Linear(in_dim, out_dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(out_dim, out_dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        """The one-head softmax, and the residual ``v + ...`` (1 per output element)."""
        return attention_softmax_flops(batch, 1, tokens, tokens) + batch * tokens * self.proj.out_features

    def forward(self, x: Tensor, return_aux: bool = False) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if return_aux:
            attn = attention_map(q, k, self.scale)
            out = self.attn_drop(attn) @ v
        else:
            drop = self.attn_drop.p if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, scale=self.scale)
        out = v + self.proj_drop(self.proj(out))
        return (out, {"attn": attn}) if return_aux else out


class TokenPerformerAttention(ElementwiseFlops, nn.Module):
    """T2T-ViT's default token-layer attention (``token_performer.py``): one-head Performer (FAVOR+), ``in_dim →
    out_dim``, linear in the number of tokens.

    ``k, q, v = kqv(x)`` (that order, each ``out_dim`` wide); positive random features
    ``φ(u) = exp(w u - ‖u‖² / 2) / sqrt(m)`` with ``m = out_dim · kernel_ratio`` fixed orthogonal rows ``w``
    (scaled by sqrt(m), drawn at construction, never trained: a buffer); ``y = φ(q) (φ(k)ᵀ v) / (φ(q) · Σ_t φ(k_t)
    + 1e-8)``; ``out = v + proj(y)`` (the residual from ``v``, the width changes).
    """

    flops_label = "attention softmax"

    def __init__(
        self, in_dim: int, out_dim: int, attn_drop: float = 0.0, proj_drop: float = 0.0, kernel_ratio: float = 0.5
    ) -> None:
        super().__init__()
        self.kqv = nn.Linear(in_dim, 3 * out_dim)
        self.proj = nn.Linear(out_dim, out_dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.num_features = m = int(out_dim * kernel_ratio)
        w = torch.randn(m, out_dim)
        if not w.is_meta:  # counting MACs on the meta device needs no values
            w = nn.init.orthogonal_(w) * m**0.5
        self.register_buffer("w", w)

    def features(self, u: Tensor) -> Tensor:
        """Positive random features ``exp(w u - ‖u‖² / 2) / sqrt(m)``, (B, N, m), in fp32 (or float64 input's)."""
        u = u.to(torch.promote_types(u.dtype, torch.float32))
        return torch.exp(u @ self.w.to(u.dtype).T - u.square().sum(-1, keepdim=True) / 2) / self.num_features**0.5

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        """The features (square, sum, subtract, exp, divide: 5 per feature of q and k), the division and the
        residual (2 per output element); the products are MACs."""
        return 2 * 5 * batch * tokens * self.num_features + 2 * batch * tokens * self.proj.out_features

    def forward(self, x: Tensor, return_aux: bool = False) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        k, q, v = self.kqv(x).chunk(3, dim=-1)
        kp, qp = self.features(k), self.features(q)
        den = qp @ kp.sum(1).unsqueeze(-1)  # (B, N, 1)
        y = (qp @ (kp.transpose(1, 2) @ v.to(kp.dtype))) / (den + 1e-8)
        out = v + self.proj_drop(self.proj(y.to(v.dtype)))
        return (out, {}) if return_aux else out


TOKEN_MIXERS = {
    "external": TokenExternalAttention,
    "attention": TokenSelfAttention,
    "performer": TokenPerformerAttention,
}


class TokenLayer(nn.Module):
    """One T2T token layer: ``x = attn(LN(x))`` (changes the width, no outer residual), ``x += MLP(LN(x))``."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        mixer: str = "external",
        mlp_ratio: float = 1.0,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        if mixer not in TOKEN_MIXERS:
            raise ValueError(f"token_mixer must be one of {', '.join(TOKEN_MIXERS)}, got {mixer!r}")
        self.norm1 = nn.LayerNorm(in_dim, eps=norm_eps)
        self.attn = TOKEN_MIXERS[mixer](in_dim, out_dim, attn_drop=attn_drop, proj_drop=proj_drop)
        self.norm2 = nn.LayerNorm(out_dim, eps=norm_eps)
        self.mlp = Mlp(out_dim, int(out_dim * mlp_ratio))

    def forward(self, x: Tensor) -> Tensor:
        x = self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TokensToToken(nn.Module):
    """T2T module: soft split, then (token layer, re-structurize, soft split) repeated, then a projection.

    ``soft_split`` lists ``(kernel, stride, padding)`` per split (T2T-ViT: 7/4/2,
    3/2/1, 3/2/1); a token layer sits between consecutive splits and maps
    ``channels · k²`` to ``token_dim``. Returns tokens ``(B, N, embed_dim)`` and their grid.
    """

    def __init__(
        self,
        in_chans: int = 3,
        embed_dim: int = 768,
        token_dim: int = 64,
        soft_split: Sequence[tuple[int, int, int]] = T2T_SOFT_SPLIT,
        token_mixer: str = "external",
        token_drop: float = 0.0,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.soft_split = tuple(tuple(int(v) for v in s) for s in soft_split)
        if not self.soft_split or any(len(s) != 3 or s[0] < 1 or s[1] < 1 or s[2] < 0 for s in self.soft_split):
            raise ValueError(
                f"soft_split must be a non-empty list of (kernel >= 1, stride >= 1, padding >= 0), got {soft_split}"
            )
        self.in_chans = in_chans
        self.splits = nn.ModuleList(nn.Unfold(k, padding=p, stride=s) for k, s, p in self.soft_split)
        widths = [in_chans] + [token_dim] * (len(self.soft_split) - 1)
        self.layers = nn.ModuleList(
            TokenLayer(c * k * k, token_dim, token_mixer, 1.0, token_drop, token_drop, norm_eps)
            for c, (k, _, _) in zip(widths[:-1], self.soft_split[:-1])
        )
        self.project = nn.Linear(widths[-1] * self.soft_split[-1][0] ** 2, embed_dim)

    def grids(self, img_size: int | Sequence[int]) -> list[tuple[int, int]]:
        """The grid after each soft split (``floor((H + 2p - k) / s) + 1`` per axis)."""
        size = _as_pair(img_size)
        out = []
        for i, (k, s, p) in enumerate(self.soft_split):
            if min(size) + 2 * p < k:
                first = _as_pair(img_size)
                raise ValueError(
                    f"image size {first[0]}x{first[1]} is too small for the T2T soft splits {list(self.soft_split)}: "
                    f"split {i} (kernel {k}, padding {p}) gets a {size[0]}x{size[1]} grid, needs at least {k - 2 * p}"
                )
            size = ((size[0] + 2 * p - k) // s + 1, (size[1] + 2 * p - k) // s + 1)
            out.append(size)
        return out

    def grid_size(self, img_size: int | Sequence[int]) -> tuple[int, int]:
        return self.grids(img_size)[-1]

    def forward(self, x: Tensor, traced_size: Sequence[int] | None = None) -> tuple[Tensor, tuple[int, int]]:
        grids = self.grids(image_size(x, self.in_chans, traced_size))
        x = soft_split(self.splits[0], x)  # (B, windows, C·k²), channel-major as nn.Unfold
        for layer, split, grid in zip(self.layers, self.splits[1:], grids):
            x = layer(x)
            # re-structurize: the tokens as an image (B, C, H, W), a view the split reads in place
            x = soft_split(split, x.reshape(x.shape[0], *grid, x.shape[2]).permute(0, 3, 1, 2))
        return self.project(x), grids[-1]


class T2TViT(Classifier):
    """T2T-ViT with a pluggable mixer per block; the defaults build EAMLP-14.

    Args:
        img_size: the size the position table is built for; other sizes work
            (the fixed sinusoid is recomputed for their token count).
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: the backbone, as T2T-ViT
            (qkv_bias False; EAMLP's query projection has a bias regardless).
        token_dim: width of the T2T token layers (64).
        token_mixer: ``"external"`` (EAMLP: single-head EA, S = 128),
            ``"attention"`` (T2T-ViT-t: single-head self-attention) or ``"performer"`` (T2T-ViT's default).
        token_drop: dropout on the token layers' map and projection; None = the
            official value: 0.1 for EAMLP and the Performer (hard-coded in token_performer.py), 0 for attention.
        soft_split: ``(kernel, stride, padding)`` per soft split (small variants use
            smaller strides to keep a usable grid at 32 px).
        mixer: one spec for every block or a per-block list (as VisionTransformer);
            num_heads, qkv_bias, attn_drop, proj_drop and max_len are passed to mixers that take them.
        norm_eps: LayerNorm eps (1e-5: the official code uses nn.LayerNorm's default).
        global_pool: ``"token"`` (class token, as T2T-ViT), ``"avg"`` / ``"max"`` / ``"avgmax"`` (over the
            patch tokens) or ``""`` (no pooling).
        norm: ``"layer"``, or ``"batch"`` for BatchNorm in place of the backbone blocks' LayerNorms (the EA
            paper's EAMLP-7 experiment; docs/semantics.md, Decision E4).
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 384,
        depth: int = 14,
        num_heads: int = 6,
        mlp_ratio: float = 3.0,
        qkv_bias: bool = False,
        token_dim: int = 64,
        token_mixer: str = "external",
        token_drop: float | None = None,
        soft_split: Sequence[tuple[int, int, int]] = T2T_SOFT_SPLIT,
        mixer: MixerSpec | Sequence[MixerSpec] = EAMLP_MIXER,
        norm_eps: float = 1e-5,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        global_pool: str = "token",
        norm: str = "layer",
    ) -> None:
        super().__init__()
        check_pool(global_pool)
        if token_drop is None:
            token_drop = 0.0 if token_mixer == "attention" else 0.1
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.global_pool = global_pool
        self.num_prefix = 1

        self.tokens_to_token = TokensToToken(
            in_chans, embed_dim, token_dim, soft_split, token_mixer, token_drop, norm_eps
        )
        self.grid = self.tokens_to_token.grid_size(img_size)
        self._img_size = _as_pair(img_size)
        num_tokens = 1 + self.grid[0] * self.grid[1]
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # fixed table (requires_grad=False in the official code); a function of the token count, so not saved
        self.register_buffer("pos_embed", sinusoid_1d(num_tokens, embed_dim)[None], persistent=False)
        self._table_cache: tuple[Any, Tensor | None] = (None, None)
        self.pos_drop = nn.Dropout(drop_rate)

        defaults = dict(
            num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop_rate, proj_drop=drop_rate, max_len=num_tokens
        )
        self.blocks = build_blocks(
            embed_dim,
            depth,
            mixer,
            defaults,
            drop_path_rate,
            mlp_ratio=mlp_ratio,
            drop=drop_rate,
            norm_eps=norm_eps,
            norm=norm,
        )
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps)
        self.head = self.new_head(num_classes)
        self.init_weights()

    STEM = ("cls_token", "pos_embed", "tokens_to_token")

    @property
    def first_conv(self) -> str:
        """The first layer that sees the image's channels (the first token layer's projection)."""
        if not len(self.tokens_to_token.layers):
            return "tokens_to_token.project"
        attn = self.tokens_to_token.layers[0].attn
        first = next(n for n in ("q_linear", "qkv", "kqv") if hasattr(attn, n))  # EA, attention, Performer
        return f"tokens_to_token.layers.0.attn.{first}"

    @property
    def reduction(self) -> int:
        return math.prod(s for _, s, _ in self.tokens_to_token.soft_split)

    @property
    def in_chans(self) -> int:
        return int(self.tokens_to_token.in_chans)

    @property
    def img_size(self) -> tuple[int, int]:
        return self._img_size

    def _set_img_size(self, size: tuple[int, int]) -> None:
        self.grid = self.tokens_to_token.grid_size(size)
        table = sinusoid_1d(1 + self.grid[0] * self.grid[1], self.embed_dim)[None]
        self.pos_embed = table.to(self.pos_embed)
        self._img_size = size

    def init_weights(self) -> None:
        """As the official T2T-ViT (trunc-normal 0.02 for the class token and Linear weights); then the token
        layers' external attention re-ties ``M_v = M_kᵀ`` as the official code's aliasing leaves it."""
        self.init_trunc_normal(self.cls_token)
        for layer in self.tokens_to_token.layers:
            if hasattr(layer.attn, "reset_parameters"):
                layer.attn.reset_parameters()

    # --------------------------------------------------------------- forward
    def position_table(self, num_tokens: int) -> Tensor:
        """The fixed sinusoid ``(1, num_tokens, C)``: the stored one, or recomputed for another input size."""
        if num_tokens == self.pos_embed.shape[1]:
            return self.pos_embed
        key = (num_tokens, self.pos_embed.device, self.pos_embed.dtype)
        if self._table_cache[0] != key:  # one entry: evaluation at one other size recomputes nothing
            with torch.inference_mode(False):  # an ordinary tensor: the cache outlives an evaluation loop
                self._table_cache = (key, sinusoid_1d(num_tokens, self.embed_dim)[None].to(self.pos_embed))
        return self._table_cache[1]

    def _embed(self, x: Tensor) -> tuple[Tensor, TokenLayout]:
        x, grid = self.tokens_to_token(x, self.traced_size)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.position_table(1 + grid[0] * grid[1]).to(x.dtype)
        return self.pos_drop(x), TokenLayout(grid, self.num_prefix)

    def _trace(
        self, x: Tensor, return_aux: bool, keep: Collection[int] | None = None, stop: int | None = None
    ) -> dict[str, Any]:
        x, layout = self._embed(x)
        x, tokens, auxes = run_blocks(
            self.blocks, x, layout, return_aux, keep=keep, stop=stop, checkpointing=self.grad_checkpointing
        )
        return {"tokens": tokens, "aux": auxes, "last": x, "layout": layout}
