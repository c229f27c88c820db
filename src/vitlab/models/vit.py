"""The generic Vision Transformer: every paper's model except TNT is a configuration of this class.

One block = one token mixer (any ``vitlab.mixers`` kind, chosen per block) + MLP.
Around the blocks: patch embedding (linear or a CNN stem), prefix tokens
(class / distillation), a position encoding (learned table, 2-D sin-cos, CPVT's
PEG after chosen blocks, or none) and a head (class token, GAP, DeiT's two heads,
Refined-ViT's token-labelling aux head).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..layers import PatchEmbed, PositionEncodingGenerator, resample_pos_embed, sincos_2d
from ..mixers.base import TokenLayout
from .base import Classifier, MixerSpec, build_blocks, check_pool, run_blocks


class VisionTransformer(Classifier):
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
        pos_embed_every_block: CPVT's per-block absolute encoding: every block's input gets the encoding added,
            block 0's being the ``pos_embed`` one: with ``pos_embed="learned"`` a learned table of its own per
            block, with ``"sincos"`` the one fixed 2-D sin-cos table before every block.
        peg_at: block indices whose output passes through a PEG (CPVT); -1 = before block 0.
        peg_kernel, peg_options: the PEGs' kernel size and further options of
            :class:`~vitlab.layers.PositionEncodingGenerator` (kind, layers, padding, frozen: CPVT's ablations).
        global_pool: ``"token"`` (class token), ``"avg"`` / ``"max"`` / ``"avgmax"`` (over the patch tokens),
            or ``""`` (no pooling: every token goes to the head).
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
        pos_embed_every_block: bool = False,
        peg_at: Sequence[int] = (),
        peg_kernel: int = 3,
        peg_options: dict[str, Any] | None = None,
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
        if pos_embed_every_block and pos_embed == "none":
            raise ValueError(
                "pos_embed_every_block adds the position encoding before every block, the first being pos_embed: "
                "it needs pos_embed='learned' or 'sincos', got 'none'"
            )
        check_pool(global_pool, class_token)
        if dist_token and not class_token:
            raise ValueError("a distillation token needs a class token (DeiT)")
        if any(i < -1 or i >= depth for i in peg_at):
            raise ValueError(f"peg_at indices must be in [-1, {depth - 1}], got {list(peg_at)}")

        self.num_classes = num_classes
        self.embed_dim = embed_dim
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
        # block j's own table (j >= 1), keyed by j; added to block j's input
        tables = range(1, depth) if pos_embed_every_block and pos_embed == "learned" else ()
        # blocks j >= 1 whose input gets the fixed sin-cos table again (it has no parameters to key)
        self.block_sincos = tuple(range(1, depth)) if pos_embed_every_block and pos_embed == "sincos" else ()
        self.block_pos_embed = nn.ParameterDict(
            {str(j): nn.Parameter(torch.zeros_like(self.pos_embed)) for j in tables}
        )
        self.pos_drop = nn.Dropout(drop_rate)
        peg_options = peg_options or {}
        self.pegs = nn.ModuleDict(
            {str(i): PositionEncodingGenerator(embed_dim, peg_kernel, **peg_options) for i in peg_at}
        )

        defaults = dict(num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop_rate, max_len=num_tokens)
        self.blocks = build_blocks(
            embed_dim,
            depth,
            mixer,
            defaults,
            drop_path_rate,
            mlp_ratio=mlp_ratio,
            drop=drop_rate,
            norm_eps=norm_eps,
            ls_init=ls_init,
            residual_scale=residual_scale,
        )
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps)
        self.head = self.new_head(num_classes)
        self.head_dist = self.new_head(num_classes) if dist_token else None
        self.aux_head = self.new_head(num_classes) if aux_head else None
        self.distilled_training = False  # DeiT: training returns both heads' logits when True
        self.init_weights()

    def init_weights(self) -> None:
        """DeiT/timm init (trunc-normal 0.02 for Linear weights, tokens and table); the PEG and the patch
        embedding keep their conv init."""
        self.init_trunc_normal(self.pos_embed, self.cls_token, self.dist_token, *self.block_pos_embed.values())

    STEM = ("cls_token", "dist_token", "pos_embed", "patch_embed", "pegs.-1")
    # the PEG after block N learns with block N; block N's own position table with block N
    BLOCK_GROUPS = ((r"^pegs\.(\d+)\.", None), (r"^block_pos_embed\.(\d+)$", None))
    NO_WEIGHT_DECAY = (*Classifier.NO_WEIGHT_DECAY, "block_pos_embed")

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        super().reset_classifier(num_classes, global_pool)
        if self.head_dist is not None:
            self.head_dist = self.new_head(num_classes)
        if self.aux_head is not None:
            self.aux_head = self.new_head(num_classes)

    def get_classifier(self) -> nn.Module | tuple[nn.Module, nn.Module]:
        """The head; DeiT's two heads as a pair (as timm)."""
        return (self.head, self.head_dist) if self.head_dist is not None else self.head

    def classifier_names(self) -> str | tuple[str, ...]:
        return ("head", "head_dist") if self.head_dist is not None else "head"

    def _prune_after(self, last: int) -> None:
        for key in [k for k in self.pegs if int(k) > last]:
            del self.pegs[key]
        # block `last`'s output includes the next block's table (as it includes its PEG): kept
        for key in [k for k in self.block_pos_embed if int(k) > last + 1]:
            del self.block_pos_embed[key]
        self.block_sincos = tuple(j for j in self.block_sincos if j <= last + 1)

    def _set_img_size(self, size: tuple[int, int]) -> None:
        grid = self.patch_embed.grid_size(size)
        if self.pos_embed is not None and grid != self.grid:
            self.pos_embed = nn.Parameter(
                resample_pos_embed(self.pos_embed, grid, self.grid, self.num_prefix), self.pos_embed.requires_grad
            )
            for key, table in self.block_pos_embed.items():
                self.block_pos_embed[key] = nn.Parameter(
                    resample_pos_embed(table, grid, self.grid, self.num_prefix), table.requires_grad
                )
        for blk in self.blocks:  # AFT-full/local: position biases built for a token count are resampled
            if isinstance(getattr(blk.mixer, "resample", None), bool) and grid != self.grid:
                blk.mixer.resample = True
        self.grid = grid

    # --------------------------------------------------------------- forward
    def _embed(self, x: Tensor) -> tuple[Tensor, TokenLayout]:
        x, grid = self.patch_embed(x, self.traced_size)
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
            x = self._add_sincos(x, grid)
        return self.pos_drop(x), layout

    def _add_sincos(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """``x`` with the fixed 2-D sin-cos table added to its patch tokens (prefix tokens get none)."""
        table = sincos_2d(self.embed_dim, grid).to(x)
        return torch.cat([x[:, : self.num_prefix], x[:, self.num_prefix :] + table], dim=1)

    def _trace(
        self, x: Tensor, return_aux: bool, keep: Collection[int] | None = None, stop: int | None = None
    ) -> dict[str, Any]:
        x, layout = self._embed(x)
        if "-1" in self.pegs:
            x = self.pegs["-1"](x, layout)

        def peg(i: int, t: Tensor) -> Tensor:
            t = self.pegs[str(i)](t, layout) if str(i) in self.pegs else t
            if str(i + 1) in self.block_pos_embed:  # block i+1's own table, after any PEG of block i
                t = t + resample_pos_embed(self.block_pos_embed[str(i + 1)], layout.grid, self.grid, self.num_prefix)
            if i + 1 in self.block_sincos:  # the fixed table again before block i+1
                t = self._add_sincos(t, layout.grid)
            return t

        x, tokens, auxes = run_blocks(
            self.blocks, x, layout, return_aux, peg, keep=keep, stop=stop, checkpointing=self.grad_checkpointing
        )
        return {"tokens": tokens, "aux": auxes, "last": x, "layout": layout}

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Pooled features (``pre_logits``) or logits; DeiT's two heads and Refined-ViT's aux head when present.

        With ``global_pool=''`` every token goes through the main head only: the distillation and
        token-labelling heads combine pooled logits, so they have no per-token meaning. DeiT's pre-logits are
        the average of the class and distillation tokens (timm's), so that a model without a head
        (``num_classes=0``) returns them.
        """
        pooled = self.pool(x)
        if pre_logits:
            distilled = self.head_dist is not None and self.global_pool == "token"
            return (pooled + x[:, 1]) / 2 if distilled else pooled
        if not self.global_pool:
            return self.head(pooled)
        logits = self.head(pooled)
        if self.head_dist is not None:
            logits_dist = self.head_dist(x[:, 1])
            if self.training and self.distilled_training:
                return logits, logits_dist
            return (logits + logits_dist) / 2
        if self.aux_head is not None:
            token_logits = self.aux_head(x[:, self.num_prefix :])
            if self.training and getattr(self, "token_label_training", False):  # token labelling's loss needs both
                return logits, token_logits
            logits = logits + 0.5 * token_logits.max(1).values
        return logits
