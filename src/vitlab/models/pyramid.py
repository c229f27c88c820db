"""Twins' PCPVT (CPVT-v2): the pyramid in which CPVT's position encoding generator was released.

Four stages (Chu et al. 2021, Twins; the official ``CPVTV2`` class registered as ``pcpvt_*_v0``); stage i:

1. patch embedding: a ``p_i × p_i`` convolution with stride ``p_i`` (``p_0`` = ``patch_size``, later 2) on the
   previous stage's grid, then LayerNorm (eps 1e-5);
2. ``depths[i]`` pre-norm blocks whose mixer is spatial-reduction attention
   (:class:`~vitlab.mixers.SpatialReductionAttention`, keys/values from the grid shrunk ``sr_ratios[i]`` times);
3. a PEG (:class:`~vitlab.layers.PositionEncodingGenerator`, depth-wise 3×3, on every token: there is no class
   token) right after the **first** block of the stage; no position table anywhere.

Then the final LayerNorm (eps 1e-6), the mean over the last stage's tokens and the head. The state dict uses
Twins' names except ``blocks.i.j.attn`` → ``mixer`` and ``pos_block.i.proj.0`` → ``pegs.i.proj``
(:mod:`vitlab.interop`, source ``twins_cpvtv2``). docs/semantics.md, Decision C3.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from torch import Tensor, nn

from ..layers import Block, PatchEmbed, PositionEncodingGenerator
from ..mixers import SpatialReductionAttention
from ..mixers.base import TokenLayout
from .base import OUTPUT_FORMATS, Classifier, FeatureInfo, check_pool, drop_path_rates, feature_take_indices, run_blocks


class NormedPatchEmbed(PatchEmbed):
    """A stage's patch embedding: ``LayerNorm(Conv_{p×p, stride p}(x))`` (Twins' ``PatchEmbed``)."""

    def __init__(self, patch_size: int, in_chans: int, dim: int, norm_eps: float = 1e-5) -> None:
        super().__init__(patch_size, in_chans, dim)
        self.norm = nn.LayerNorm(dim, eps=norm_eps)

    def forward(self, x: Tensor, traced_size: Sequence[int] | None = None) -> tuple[Tensor, tuple[int, int]]:
        tokens, grid = super().forward(x, traced_size)
        return self.norm(tokens), grid


class PyramidCPVT(Classifier):
    """Twins PCPVT / CPVT-v2: a four-stage (any number of stages) pyramid with PEGs and average pooling.

    Args:
        img_size, patch_size, in_chans, num_classes: as ViT; the first stage embeds ``patch_size`` patches.
        embed_dims, num_heads, mlp_ratios, depths, sr_ratios: one entry per stage.
        qkv_bias, norm_eps: the blocks' q/kv bias and LayerNorm eps (the final norm's too).
        peg_kernel: the PEGs' kernel size (3).
    """

    NO_WEIGHT_DECAY = ("pegs",)  # as Twins: the PEG convolutions are not weight-decayed

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dims: Sequence[int] = (64, 128, 320, 512),
        num_heads: Sequence[int] = (1, 2, 5, 8),
        mlp_ratios: Sequence[float] = (8, 8, 4, 4),
        depths: Sequence[int] = (3, 4, 6, 3),
        sr_ratios: Sequence[int] = (8, 4, 2, 1),
        qkv_bias: bool = True,
        norm_eps: float = 1e-6,
        peg_kernel: int = 3,
        global_pool: str = "avg",
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        stages = len(depths)
        if not stages or any(len(s) != stages for s in (embed_dims, num_heads, mlp_ratios, sr_ratios)):
            raise ValueError("embed_dims, num_heads, mlp_ratios, depths and sr_ratios need one entry per stage")
        check_pool(global_pool, has_class_token=False)
        self.num_classes = num_classes
        self.embed_dim = embed_dims[-1]
        self.num_prefix = 0
        self.global_pool = global_pool
        self.depths = tuple(depths)
        self.sr_ratios = tuple(sr_ratios)
        chans = [in_chans, *embed_dims[:-1]]
        self.patch_embeds = nn.ModuleList(
            NormedPatchEmbed(patch_size if i == 0 else 2, chans[i], embed_dims[i]) for i in range(stages)
        )
        self.grid = self.check_size(img_size, sr_ratios)
        dpr = drop_path_rates(drop_path_rate, sum(depths))
        starts = [sum(depths[:i]) for i in range(stages)]

        def block(i: int, j: int) -> Block:
            mixer = SpatialReductionAttention(
                embed_dims[i], num_heads[i], qkv_bias, None, attn_drop_rate, drop_rate, sr_ratios[i]
            )
            return Block(embed_dims[i], mixer, mlp_ratios[i], drop_rate, dpr[starts[i] + j], norm_eps)

        self.blocks = nn.ModuleList(nn.ModuleList(block(i, j) for j in range(depths[i])) for i in range(stages))
        self.pegs = nn.ModuleList(PositionEncodingGenerator(d, peg_kernel) for d in embed_dims)
        self.norm = nn.LayerNorm(self.embed_dim, eps=norm_eps)
        self.head = self.new_head(num_classes)
        self.init_weights()

    def check_size(self, img_size: int | tuple[int, int], sr_ratios: Sequence[int]) -> tuple[int, int]:
        """The last stage's grid; an error when a stage's grid does not divide by its patch or its sr ratio."""
        grid = img_size if isinstance(img_size, tuple) else (img_size, img_size)
        for i, embed in enumerate(self.patch_embeds):
            grid = embed.grid_size(grid)
            if any(g % sr_ratios[i] for g in grid):
                raise ValueError(
                    f"stage {i} grid {grid[0]}x{grid[1]} is not divisible by its spatial-reduction ratio "
                    f"{sr_ratios[i]}; use an image size that is a multiple of {self._multiple(sr_ratios)}"
                )
        return grid

    def _multiple(self, sr_ratios: Sequence[int]) -> int:
        stride, need = 1, 1
        for i, embed in enumerate(self.patch_embeds):
            stride *= embed.patch_size[0]
            need = math.lcm(need, stride * sr_ratios[i])
        return need

    def init_weights(self) -> None:
        """Twins' init: trunc-normal(0.02) Linear weights, zero biases, unit LayerNorms, every convolution
        normal(0, sqrt(2 / fan_out)) with ``fan_out = k·k·C_out / groups``."""
        self.init_trunc_normal()
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    # ------------------------------------------------------------------ the contract (stages are timm's blocks)
    first_conv = "patch_embeds.0.proj"
    STEM = ("patch_embeds.0",)
    # a stage's patch embedding and PEG learn with the stage (timm's Twins groups them the same way)
    BLOCK_GROUPS = ((r"^patch_embeds\.(\d+)\.", None), (r"^pegs\.(\d+)\.", None))

    @property
    def strides(self) -> list[int]:
        """Image pixels per token along a side after each stage."""
        out, stride = [], 1
        for embed in self.patch_embeds:
            stride *= int(embed.patch_size[0])
            out.append(stride)
        return out

    @property
    def reduction(self) -> int:
        return self.strides[-1]

    @property
    def in_chans(self) -> int:
        return int(self.patch_embeds[0].in_chans)

    @property
    def feature_info(self) -> FeatureInfo:
        """One feature per stage, as timm's Twins: its width and its stride."""
        return FeatureInfo(
            dict(num_chs=int(embed.proj.out_channels), reduction=r, module=f"blocks.{i}")
            for i, (embed, r) in enumerate(zip(self.patch_embeds, self.strides))
        )

    def _set_img_size(self, size: tuple[int, int]) -> None:
        self.grid = self.check_size(size, self.sr_ratios)  # no position table: only the grids must divide

    def _prune_after(self, last: int) -> None:
        self.patch_embeds = self.patch_embeds[: last + 1]
        self.pegs = self.pegs[: last + 1]

    def no_weight_decay(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if n.split(".")[0] in self.NO_WEIGHT_DECAY}

    def _stages(self, x: Tensor, return_aux: bool, stop: int | None = None) -> dict[str, Any]:
        """Run the stages (up to ``stop``): every block's tokens and aux, each stage's output and grid."""
        tokens, auxes, stage_out = [], [], []
        b, grid, layout = x.shape[0], None, None
        for i, (embed, stage, peg) in enumerate(zip(self.patch_embeds, self.blocks, self.pegs)):
            if stop is not None and i > stop:
                break
            if grid is not None:  # the previous stage's tokens back to an image
                x = x.transpose(1, 2).reshape(b, -1, *grid)
            x, grid = embed(x, grid or self.img_size)  # (a traced graph's sizes: this stage's input)
            layout = TokenLayout(grid, 0)

            def peg_after_first(j: int, t: Tensor, peg=peg, layout=layout) -> Tensor:
                return peg(t, layout) if j == 0 else t

            x, block_tokens, block_aux = run_blocks(
                stage, x, layout, return_aux, peg_after_first, checkpointing=self.grad_checkpointing
            )
            tokens += block_tokens
            auxes += block_aux
            stage_out.append((x, grid))
        return {"tokens": tokens, "aux": auxes, "last": x, "layout": layout, "stages": stage_out}

    def _trace(
        self, x: Tensor, return_aux: bool, keep: Collection[int] | None = None, stop: int | None = None
    ) -> dict[str, Any]:
        """Every block of every stage in order (``keep`` and ``stop`` count stages, as ``blocks`` does)."""
        trace = self._stages(x, return_aux, stop)
        trace.pop("stages")
        return trace

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | Sequence[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Any] | tuple[Tensor, list[Any]]:
        """timm's feature extraction over the stages (each at its own width and stride); ``norm`` applies the
        final norm to the last stage's output only (the only one at its width), as timm's Twins."""
        if output_fmt not in OUTPUT_FORMATS:
            raise ValueError(f"output_fmt must be one of {', '.join(OUTPUT_FORMATS)}, got {output_fmt!r}")
        if return_prefix_tokens:
            raise ValueError("PCPVT has no prefix tokens (no class token): use return_prefix_tokens=False")
        take, last = feature_take_indices(len(self.blocks), indices)
        run = self._stages(x, False, stop=last if stop_early else None)
        outs = []
        for i in take:
            t, (gh, gw) = run["stages"][i]
            t = self.norm(t) if norm and i == len(self.blocks) - 1 else t
            outs.append(t if output_fmt == "NLC" else t.reshape(t.shape[0], gh, gw, -1).permute(0, 3, 1, 2))
        final = run["last"]  # normed unless stop_early left it at an earlier stage's width
        final = self.norm(final) if final.shape[-1] == self.embed_dim else final
        return outs if intermediates_only else (final, outs)
