"""The generic Vision Transformer: every paper's model except TNT is a configuration of this class.

One block = one token mixer (any ``vitlab.mixers`` kind, chosen per block) + MLP.
Around the blocks: patch embedding (linear or a CNN stem), prefix tokens
(class / distillation), a position encoding (learned table, 2-D sin-cos, CPVT's
PEG after chosen blocks, or none) and a head (class token, GAP, DeiT's two heads,
Refined-ViT's token-labelling aux head).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..layers import Block, PatchEmbed, PositionEncodingGenerator, resample_pos_embed, sincos_2d
from ..mixers import build as build_mixer
from ..mixers.base import TokenLayout

MixerSpec = str | tuple[str, dict[str, Any]]


def _mixer_specs(mixer: MixerSpec | Sequence[MixerSpec], depth: int) -> list[tuple[str, dict[str, Any]]]:
    """One ``(kind, kwargs)`` per block from a single spec or a per-block list."""
    specs = [mixer] * depth if isinstance(mixer, str | tuple) else list(mixer)
    if len(specs) != depth:
        raise ValueError(f"got {len(specs)} mixer specs for depth {depth}")
    return [(s, {}) if isinstance(s, str) else (s[0], dict(s[1])) for s in specs]


class VisionTransformer(nn.Module):
    """ViT / DeiT with a pluggable token mixer per block.

    Args:
        img_size, patch_size, in_chans, num_classes, embed_dim, depth, num_heads,
        mlp_ratio, qkv_bias: as in ViT (Dosovitskiy et al.) / DeiT.
        mixer: one spec for all blocks or a list with one per block; a spec is a
            kind (``"attention"``) or ``(kind, kwargs)``. num_heads, qkv_bias,
            attn_drop and max_len (the token count) are passed to mixers that take them.
        stem_channels: CNN stem before the patch projection (Refined-ViT, DeepViT-S/L).
        class_token, dist_token: prefix tokens (DeiT distillation adds a second head).
        pos_embed: ``"learned"``, ``"sincos"`` or ``"none"``.
        peg_at: block indices whose output passes through a PEG (CPVT); -1 = before block 0.
        global_pool: ``"token"`` (class token) or ``"avg"`` (mean of patch tokens).
        residual_scale, ls_init: the official Refiner/DeepViT residual rescaling and LayerScale.
        aux_head: Refined-ViT's token-labelling head: logits = head(cls) + 0.5·max_n aux_head(patch_n).
        dynamic_img_size: resample the learned position table (bicubic) when the
            input grid differs from the one it was built for; otherwise that is an error.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        mixer: MixerSpec | Sequence[MixerSpec] = "attention",
        stem_channels: Sequence[int] = (),
        class_token: bool = True,
        dist_token: bool = False,
        pos_embed: str = "learned",
        peg_at: Sequence[int] = (),
        peg_kernel: int = 3,
        global_pool: str = "token",
        norm_eps: float = 1e-6,
        residual_scale: float = 1.0,
        ls_init: tuple[float | None, float | None] = (None, None),
        aux_head: bool = False,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        dynamic_img_size: bool = False,
    ) -> None:
        super().__init__()
        if pos_embed not in ("learned", "sincos", "none"):
            raise ValueError(f"pos_embed must be 'learned', 'sincos' or 'none', got {pos_embed!r}")
        if global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs a class token; use global_pool='avg' without one")
        if dist_token and not class_token:
            raise ValueError("a distillation token needs a class token (DeiT)")
        if any(i < -1 or i >= depth for i in peg_at):
            raise ValueError(f"peg_at indices must be in [-1, {depth - 1}], got {list(peg_at)}")

        self.num_classes = num_classes
        self.num_features = self.embed_dim = embed_dim
        self.global_pool = global_pool
        self.num_prefix = int(class_token) + int(dist_token)
        self.dynamic_img_size = dynamic_img_size
        self.pos_embed_kind = pos_embed

        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim, stem_channels)
        self.grid = self.patch_embed.grid_size(img_size)
        num_tokens = self.num_prefix + self.grid[0] * self.grid[1]
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if dist_token else None
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim)) if pos_embed == "learned" else None
        self.pos_drop = nn.Dropout(drop_rate)
        self.pegs = nn.ModuleDict({str(i): PositionEncodingGenerator(embed_dim, peg_kernel) for i in peg_at})

        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # linear decay rule (DeiT)
        defaults = dict(num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop_rate, max_len=num_tokens)
        self.blocks = nn.ModuleList(
            Block(
                embed_dim,
                build_mixer(kind, embed_dim, defaults=defaults, **kw),
                mlp_ratio=mlp_ratio,
                drop=drop_rate,
                drop_path=dpr[i],
                norm_eps=norm_eps,
                ls_init=ls_init,
                residual_scale=residual_scale,
            )
            for i, (kind, kw) in enumerate(_mixer_specs(mixer, depth))
        )
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = (nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()) if dist_token else None
        self.aux_head = (nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()) if aux_head else None
        self.distilled_training = False  # DeiT: training returns both heads' logits when True
        self.init_weights()

    # ------------------------------------------------------------------ init
    def init_weights(self) -> None:
        """DeiT/timm init: trunc-normal(0.02) for Linear weights, tokens and table; zero biases; unit norms.

        Mixers with their own initialisation (AFT position factors, external
        attention's M_v = M_kᵀ) re-apply it through ``reset_parameters``.
        """
        for t in (self.pos_embed, self.cls_token, self.dist_token):
            if t is not None:
                nn.init.trunc_normal_(t, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for blk in self.blocks:
            if hasattr(blk.mixer, "reset_parameters"):
                blk.mixer.reset_parameters()

    def no_weight_decay(self) -> set[str]:
        """Parameter names AdamW should not decay (DeiT: tokens and the position table)."""
        names = {n for n in ("pos_embed", "cls_token", "dist_token") if getattr(self, n) is not None}
        for i, blk in enumerate(self.blocks):  # mixers name their own (AFT position biases)
            if hasattr(blk.mixer, "no_weight_decay"):
                names |= {f"blocks.{i}.mixer.{n}" for n in blk.mixer.no_weight_decay()}
        return names

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if global_pool is not None:
            if global_pool == "token" and self.cls_token is None:
                raise ValueError("global_pool='token' needs a class token")
            self.global_pool = global_pool
        self.num_classes = num_classes

        def new() -> nn.Module:
            return nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        self.head = new()
        if self.head_dist is not None:
            self.head_dist = new()
        if self.aux_head is not None:
            self.aux_head = new()

    # --------------------------------------------------------------- forward
    def _embed(self, x: Tensor) -> tuple[Tensor, TokenLayout]:
        x, grid = self.patch_embed(x)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token) if t is not None]
        x = torch.cat([*prefix, x], dim=1)
        layout = TokenLayout(grid, self.num_prefix)
        if self.pos_embed is not None:
            if grid != self.grid and not self.dynamic_img_size:
                raise ValueError(
                    f"this model's position table is for a {self.grid[0]}x{self.grid[1]} patch grid "
                    f"({self.grid[0] * self.patch_embed.patch_size[0]} px), got {grid[0]}x{grid[1]}; build it with "
                    f"img_size=... or dynamic_img_size=True to resample the table"
                )
            x = x + resample_pos_embed(self.pos_embed, grid, self.grid, self.num_prefix)
        elif self.pos_embed_kind == "sincos":
            table = sincos_2d(self.embed_dim, grid).to(x)
            x = torch.cat([x[:, : self.num_prefix], x[:, self.num_prefix :] + table], dim=1)
        return self.pos_drop(x), layout

    def forward_intermediates(self, x: Tensor, return_aux: bool = True) -> dict[str, Any]:
        """Run the trunk and return every block's output and its mixer's aux (attention maps, keys...).

        Returns ``{"tokens": [B,N,C per block], "aux": [dict per block], "features":
        final normed tokens, "layout": TokenLayout}``. This is the single path the
        analysis tools read; attention switches from SDPA to its explicit path,
        which computes the same output.
        """
        x, layout = self._embed(x)
        tokens, auxes = [], []
        carry = None  # Refined-ViT hands an attention map from block to block
        if "-1" in self.pegs:
            x = self.pegs["-1"](x, layout)
        for i, blk in enumerate(self.blocks):
            chained = blk.mixer.uses_attn_prev
            if return_aux or chained:
                x, aux = blk(x, layout, attn_prev=carry, return_aux=True)
                carry = aux.get("carry", carry) if chained else carry
            else:
                x, aux = blk(x, layout), {}
            if str(i) in self.pegs:
                x = self.pegs[str(i)](x, layout)
            tokens.append(x)
            auxes.append(aux)
        return {"tokens": tokens, "aux": auxes, "features": self.norm(x), "layout": layout}

    def forward_features(self, x: Tensor) -> Tensor:
        """Tokens ``(B, N, C)`` after the final norm."""
        return self.forward_intermediates(x, return_aux=False)["features"]

    def pool(self, x: Tensor) -> Tensor:
        return x[:, self.num_prefix :].mean(1) if self.global_pool == "avg" else x[:, 0]

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Pooled features (``pre_logits``) or logits from ``forward_features`` output."""
        pooled = self.pool(x)
        if pre_logits:
            return pooled
        logits = self.head(pooled)
        if self.head_dist is not None:
            logits_dist = self.head_dist(x[:, 1])
            if self.training and self.distilled_training:
                return logits, logits_dist
            return (logits + logits_dist) / 2
        if self.aux_head is not None:
            logits = logits + 0.5 * self.aux_head(x[:, self.num_prefix :]).max(1).values
        return logits

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))
