"""TNT: Transformer in Transformer (Han et al., NeurIPS 2021), as the official Huawei code computes it.

An image is cut into ``n`` patches ("visual sentences"); each patch is cut again
into ``m`` "visual words". Every TNT block runs an inner transformer over the
``m`` words of each patch (shared by all patches), adds the flattened words into
their sentence token, then runs the outer transformer over the ``n + 1``
sentence tokens (TNT paper §2.2)::

    Y'_l = Y_{l-1} + MSA(LN(Y_{l-1}));   Y_l = Y'_l + MLP(LN(Y'_l))          (inner, per patch)
    Z^i_{l-1} += LN(FC(LN(Vec(Y^i_l))))                                    (fusion, class token excluded)
    Z'_l = Z_{l-1} + MSA(LN(Z_{l-1}));   Z_l = Z'_l + MLP(LN(Z'_l))          (outer)

This is the official non-legacy variant (huawei-noah/Efficient-AI-Backbones
``tnt_pytorch/tnt.py``; timm's ``legacy=False`` is the same function):

* word embedding: unfold each ``p x p`` patch first, then ``Conv2d(in_chans, c, 7,
  stride=s, padding=3)`` on each patch alone (zero padding at every patch border),
  ``m = ceil(p / s)^2`` words, plus a word position table ``(1, m, c)`` shared by all patches;
* sentence embedding: ``LN_d(Linear_{mc -> d}(LN_{mc}(Vec(Y_0))))`` with bias, class token, position table ``(1, n + 1, d)``;
* the fusion is the same ``LN -> Linear (no bias) -> LN`` per block;
* optional SE on the outer MLP output (paper Table 12), partial TNT (Table 5: the inner
  transformer only in some blocks, the others plain ViT blocks).

Both transformers are the library's pre-norm :class:`~vitlab.layers.Block` with the
:class:`~vitlab.mixers.Attention` mixer; the official separate ``qk`` and ``v``
Linears are our fused ``qkv`` (rows ``[q | k | v]``), see
:mod:`vitlab.interop` (sources ``tnt_huawei``, ``tnt_timm``). The official frozen, unused ``outer_tokens``
tensor is not created (docs/semantics.md, Decision T2), so TNT-S/B have 23.77M / 65.43M parameters.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..layers import Block, Mlp, resample_pos_embed
from ..layers.patch_embed import _as_pair, image_size, patch_grid
from ..layers.recompute import recompute_active, recomputed
from ..mixers import Attention
from ..mixers.base import TokenLayout
from ..ops.switch import no_autograd
from .base import Classifier, check_pool, drop_path_rates


class SqueezeExcite(nn.Module):
    """TNT's SE (paper appendix, Table 12; official ``SE``): a channel gate from the token mean.

    ``g = tanh(W_2 ReLU(W_1 LN(mean_tokens(t)) + b_1) + b_2)``, shape ``(B, 1, C)``;
    the mean runs over all tokens, class token included. Returns ``t * g``.
    """

    def __init__(self, dim: int, hidden_dim: int, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, t: Tensor) -> Tensor:
        g = self.fc2(self.act(self.fc1(self.norm(t.mean(dim=1, keepdim=True)))))
        return t * torch.tanh(g)


class MlpSE(Mlp):
    """The outer MLP of an SE block: ``t + SE(t)`` with ``t = MLP(x)`` (official ``tmp_ + se_layer(tmp_)``)."""

    def __init__(self, dim: int, hidden_dim: int, se_hidden: int, drop: float = 0.0, norm_eps: float = 1e-5) -> None:
        super().__init__(dim, hidden_dim, drop=drop)
        self.se = SqueezeExcite(dim, se_hidden, norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        t = super().forward(x)
        return t + self.se(t)


class WordsToSentence(nn.Module):
    """``LN_d(Linear_{mc -> d}(LN_{mc}(Vec(Y))))``: words ``(B*n, m, c)`` -> sentence features ``(B, n, d)``.

    The flattening is word-major (feature index = word * c + channel), as the official reshape.
    The model's initial projection has a bias, the per-block fusion projections have none.
    """

    def __init__(self, words_dim: int, dim: int, bias: bool, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(words_dim, eps=norm_eps)
        self.fc = nn.Linear(words_dim, dim, bias=bias)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)

    def forward(self, words: Tensor, batch: int) -> Tensor:
        return self.norm2(self.fc(self.norm1(words.reshape(batch, words.shape[0] // batch, -1))))


class PixelEmbed(nn.Module):
    """Image -> visual words ``(B*n, m, c)``: unfold ``p x p`` patches, then one 7x7 conv on each patch.

    The patches are batched, ``(B*n, C, p, p)``, so the conv never sees across a patch
    border (the official non-legacy code; timm's legacy variant convolved the whole image).
    Rows are ``b * n + patch`` with patches row-major; words are row-major over the conv output.
    """

    def __init__(self, patch_size: int | Sequence[int], in_chans: int, inner_dim: int, inner_stride: int) -> None:
        super().__init__()
        if inner_stride <= 0:
            raise ValueError(f"inner_stride must be positive, got {inner_stride}")
        self.patch_size = _as_pair(patch_size)
        self.in_chans = in_chans
        self.word_grid = (math.ceil(self.patch_size[0] / inner_stride), math.ceil(self.patch_size[1] / inner_stride))
        self.num_words = self.word_grid[0] * self.word_grid[1]
        self.proj = nn.Conv2d(in_chans, inner_dim, kernel_size=7, stride=inner_stride, padding=3)

    def grid_size(self, img_size: int | Sequence[int]) -> tuple[int, int]:
        return patch_grid(img_size, self.patch_size)

    def forward(self, x: Tensor, traced_size: Sequence[int] | None = None) -> tuple[Tensor, tuple[int, int]]:
        gh, gw = grid = self.grid_size(image_size(x, self.in_chans, traced_size))
        (ph, pw), b, c = self.patch_size, x.shape[0], self.in_chans
        # (B, C, gh*ph, gw*pw) -> (B*gh*gw, C, ph, pw): the same rows as nn.Unfold + reshape in the official code
        patches = x.reshape(b, c, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5).reshape(b * gh * gw, c, ph, pw)
        # contiguous words: a transposed view would be copied again by every inner LayerNorm and residual add
        return self.proj(patches).flatten(2).transpose(1, 2).contiguous(), grid


def _add_to_patches(outer: Tensor, z: Tensor) -> Tensor:
    """``[outer_cls, outer_patches + z]`` as a new tensor. Without autograd the sum is written straight into the
    new tensor (one pass over the tokens, not an add then a concatenation)."""
    if not no_autograd(outer, z):  # (and with the fast paths off, or while torch.fx traces)
        return torch.cat([outer[:, :1], outer[:, 1:] + z], dim=1)
    out = torch.empty_like(outer)
    out[:, :1] = outer[:, :1]
    torch.add(outer[:, 1:], z, out=out[:, 1:])
    return out


def check_words(inner: Tensor, outer: Tensor, words_shape: tuple[int, int]) -> None:
    """ValueError unless the inner tokens ``(B*n, m, c)`` belong to the outer ones ``(B, n + 1, d)``."""
    b, n1 = outer.shape[:2]
    if inner.dim() != 3 or inner.shape[0] != b * (n1 - 1) or tuple(inner.shape[1:]) != words_shape:
        raise ValueError(
            f"TNTBlock: for outer tokens {tuple(outer.shape)} the inner tokens must be "
            f"(B*n={b * (n1 - 1)}, m={words_shape[0]}, c={words_shape[1]}), got {tuple(inner.shape)}"
        )


torch.fx.wrap("check_words")  # kept as a call in a torch.fx graph


class TNTBlock(nn.Module):
    """One TNT block: inner block on the words, fusion into the sentences, outer block.

    ``has_inner=False`` makes it a plain outer (ViT) block that passes the words
    through unchanged (partial TNT, paper Table 5). ``se`` > 0 gates the outer MLP
    output with :class:`SqueezeExcite` of hidden width ``outer_dim // se``.
    """

    def __init__(
        self,
        outer_dim: int,
        inner_dim: int,
        outer_heads: int,
        inner_heads: int,
        num_words: int,
        mlp_ratio: float = 4.0,
        inner_mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        se: int = 0,
        has_inner: bool = True,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        if not 0 <= se <= outer_dim:
            raise ValueError(f"se (SE reduction) must be 0 (off) or in [1, outer_dim={outer_dim}], got {se}")

        def block(dim: int, heads: int, ratio: float) -> Block:
            mixer = Attention(dim, heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop)
            return Block(dim, mixer, mlp_ratio=ratio, drop=drop, drop_path=drop_path, norm_eps=norm_eps)

        self.has_inner = has_inner
        self.words_shape = (num_words, inner_dim)
        if has_inner:
            self.inner = block(inner_dim, inner_heads, inner_mlp_ratio)
            self.proj = WordsToSentence(num_words * inner_dim, outer_dim, bias=False, norm_eps=norm_eps)
        self.outer = block(outer_dim, outer_heads, mlp_ratio)
        if se > 0:
            self.outer.mlp = MlpSE(outer_dim, int(outer_dim * mlp_ratio), outer_dim // se, drop, norm_eps)

    def forward(
        self,
        inner: Tensor,
        outer: Tensor,
        layout: TokenLayout | None = None,
        inner_layout: TokenLayout | None = None,
        return_aux: bool = False,
    ) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``inner`` (B*n, m, c), ``outer`` (B, n + 1, d) -> updated (inner, outer[, aux])."""
        aux: dict[str, Tensor] = {}
        if self.has_inner:
            check_words(inner, outer, self.words_shape)
            b = outer.shape[0]
            inner = self.inner(inner, inner_layout or TokenLayout(), return_aux=return_aux)
            if return_aux:
                inner, inner_aux = inner
                aux.update({f"inner_{k}": v for k, v in inner_aux.items()})
            # a new tensor, not the official in-place slice update: the caller's outer tokens stay intact
            outer = _add_to_patches(outer, self.proj(inner, b))
        outer = self.outer(outer, layout or TokenLayout(num_prefix=1), return_aux=return_aux)
        if return_aux:
            outer, outer_aux = outer
            aux.update(outer_aux)
            return inner, outer, aux
        return inner, outer


class TNT(Classifier):
    """Transformer in Transformer (Han et al. 2021), the official non-legacy Huawei model.

    Args:
        img_size, patch_size, in_chans, num_classes: as ViT; the image is cut into
            ``patch_size`` sentences.
        outer_dim, inner_dim: sentence width d and word width c.
        depth, outer_heads, inner_heads, mlp_ratio, inner_mlp_ratio, qkv_bias: the two transformers.
        inner_stride: stride s of the 7x7 word-embedding conv; m = ceil(p / s)^2 words per patch.
        se: SE reduction of the outer MLP output (paper Table 12; the official ``se > 0`` is ``se=4``); 0 = off.
        tnt_blocks: 0-based indices of the blocks with the inner transformer; None = all
            (partial TNT of Table 5: TNT-S-1 = ``(0, 3, 7, 11)``).
        global_pool: ``"token"`` (class token), ``"avg"`` / ``"max"`` / ``"avgmax"`` (over the sentence tokens)
            or ``""`` (no pooling).
        dynamic_img_size: resample the sentence position table (bicubic) for another
            patch grid; otherwise another grid is an error.
        patch_pos, pixel_pos: the sentence (patch) and word (pixel) position tables; False removes one
            (paper Table 6).
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        outer_dim: int = 384,
        inner_dim: int = 24,
        depth: int = 12,
        outer_heads: int = 6,
        inner_heads: int = 4,
        mlp_ratio: float = 4.0,
        inner_mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        inner_stride: int = 4,
        se: int = 0,
        tnt_blocks: Sequence[int] | None = None,
        global_pool: str = "token",
        norm_eps: float = 1e-5,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        dynamic_img_size: bool = False,
        patch_pos: bool = True,
        pixel_pos: bool = True,
    ) -> None:
        super().__init__()
        check_pool(global_pool)
        tnt_blocks = tuple(range(depth)) if tnt_blocks is None else tuple(int(i) for i in tnt_blocks)
        if any(not 0 <= i < depth for i in tnt_blocks):
            raise ValueError(f"tnt_blocks must be block indices in [0, {depth - 1}], got {list(tnt_blocks)}")

        self.num_classes = num_classes
        self.embed_dim = self.outer_dim = outer_dim
        self.inner_dim = inner_dim
        self.global_pool = global_pool
        self.num_prefix = 1
        self.dynamic_img_size = dynamic_img_size
        self.tnt_blocks = tnt_blocks

        self.pixel_embed = PixelEmbed(patch_size, in_chans, inner_dim, inner_stride)
        self.patch_size = self.pixel_embed.patch_size
        self.grid = self.pixel_embed.grid_size(img_size)
        num_words = self.pixel_embed.num_words
        self.inner_layout = TokenLayout(self.pixel_embed.word_grid, 0)
        self.proj = WordsToSentence(num_words * inner_dim, outer_dim, bias=True, norm_eps=norm_eps)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, outer_dim))
        num_patches = self.grid[0] * self.grid[1]
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + num_patches, outer_dim)) if patch_pos else None
        self.inner_pos = nn.Parameter(torch.zeros(1, num_words, inner_dim)) if pixel_pos else None
        self.pos_drop = nn.Dropout(drop_rate)

        dpr = drop_path_rates(drop_path_rate, depth)
        self.blocks = nn.ModuleList(
            TNTBlock(
                outer_dim,
                inner_dim,
                outer_heads,
                inner_heads,
                num_words,
                mlp_ratio=mlp_ratio,
                inner_mlp_ratio=inner_mlp_ratio,
                qkv_bias=qkv_bias,
                drop=drop_rate,
                attn_drop=attn_drop_rate,
                drop_path=dpr[i],
                se=se,
                has_inner=i in tnt_blocks,
                norm_eps=norm_eps,
            )
            for i in range(depth)
        )
        self.norm = nn.LayerNorm(outer_dim, eps=norm_eps)
        self.head = self.new_head(num_classes)
        self.init_weights()

    NO_WEIGHT_DECAY = ("pos_embed", "inner_pos", "cls_token")  # the official outer_pos, inner_pos, cls_token
    STEM = ("cls_token", "pos_embed", "inner_pos", "pixel_embed", "proj")
    first_conv = "pixel_embed.proj"

    @property
    def reduction(self) -> int:
        return int(self.patch_size[0])

    @property
    def in_chans(self) -> int:
        return int(self.pixel_embed.in_chans)

    def _set_img_size(self, size: tuple[int, int]) -> None:
        grid = self.pixel_embed.grid_size(size)
        if self.pos_embed is not None and grid != self.grid:  # (the ablations without a patch table: none)
            self.pos_embed = nn.Parameter(
                resample_pos_embed(self.pos_embed, grid, self.grid, self.num_prefix), self.pos_embed.requires_grad
            )
        self.grid = grid

    def init_weights(self) -> None:
        """Official init: trunc-normal(0.02) on Linear weights, class token and both position tables;
        the word-embedding conv keeps PyTorch's default, as the official code."""
        self.init_trunc_normal(self.cls_token, self.pos_embed, self.inner_pos)

    # --------------------------------------------------------------- forward
    def _embed(self, x: Tensor) -> tuple[Tensor, Tensor, TokenLayout]:
        inner, grid = self.pixel_embed(x, self.traced_size)
        if self.pos_embed is not None and grid != self.grid and not self.dynamic_img_size:
            ph, pw = self.patch_size
            raise ValueError(
                f"this model's position table is for a {self.grid[0]}x{self.grid[1]} patch grid "
                f"({self.grid[0] * ph}x{self.grid[1] * pw} px), got {grid[0]}x{grid[1]} "
                f"({x.shape[-2]}x{x.shape[-1]} px); build it with img_size=... or dynamic_img_size=True"
            )
        if self.inner_pos is not None:
            inner = inner + self.inner_pos
        b = x.shape[0]
        outer = torch.cat([self.cls_token.expand(b, -1, -1), self.proj(inner, b)], dim=1)
        if self.pos_embed is not None:
            outer = outer + resample_pos_embed(self.pos_embed, grid, self.grid, self.num_prefix)
        outer = self.pos_drop(outer)
        return inner, outer, TokenLayout(grid, self.num_prefix)

    def _trace(
        self, x: Tensor, return_aux: bool, keep: Collection[int] | None = None, stop: int | None = None
    ) -> dict[str, Any]:
        """The outer tokens of the blocks in ``keep`` (and, in ``"inner_tokens"``, their words) plus, with
        ``return_aux``, each block's ``"attn"`` (outer map, (B, H, n+1, n+1)) and, in blocks with the inner
        transformer, ``"inner_attn"`` ((B*n, h, m, m))."""
        inner, outer, layout = self._embed(x)
        tokens, auxes, inners = [], [], []
        ckpt = recompute_active(self.grad_checkpointing)
        for i, blk in enumerate(self.blocks):
            if stop is not None and i > stop:
                break
            args = (inner, outer, layout, self.inner_layout, return_aux)
            out = recomputed(blk, blk, *args) if ckpt else blk(*args)
            inner, outer = out[:2]
            if keep is None or i in keep:
                tokens.append(outer)
                inners.append(inner)
            if return_aux:
                auxes.append(out[2])
        return {"tokens": tokens, "aux": auxes, "last": outer, "layout": layout, "inner_tokens": inners}
