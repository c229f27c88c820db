"""Analyses of whole attention matrices, averaged over images (``vitlab analyze --what ...``):

- ``relative_attention``: a self-attention model's attention as a function of the offset between query and key
  patch, per block and head (AFT Figure 1 sets a ViT's beside AFT-conv's learned relative bias ``aft_bias``);
- ``attention_matrix``: the full ``N x N`` attention matrix per block and head (CPVT's attention-matrix plot,
  where PEG models show a local, diagonal band structure).

Both read the maps ``forward_trace`` materialises and average them over every image given.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..mixers.base import TokenLayout
from . import plots
from .base import Analysis, RunningMean, self_attention_maps, to_json


def relative_attention(attn: Tensor, layout: TokenLayout) -> Tensor:
    """The mean attention a query patch pays to the key patch at offset ``(dy, dx)`` (key minus query),
    over the query patches that have such a key: ``R[b, h, dy + gh - 1, dx + gw - 1] = mean_{q : q + d in grid}
    A[b, h, q, q + d]`` for maps ``A`` (B, H, N, N) over ``layout`` (prefix tokens left out). Returns (B, H,
    2 gh - 1, 2 gw - 1) in float64."""
    gh, gw = layout.grid
    p = layout.num_prefix
    patches = attn[..., p:, p:].double()  # (B, H, gh*gw, gh*gw): query patch, key patch
    b, h = patches.shape[:2]
    grid = patches.reshape(b, h, gh, gw, gh, gw)  # [.., qy, qx, ky, kx]
    out = grid.new_zeros(b, h, 2 * gh - 1, 2 * gw - 1)
    for dy in range(-(gh - 1), gh):
        qy = slice(max(0, -dy), gh - max(0, dy))  # queries whose key row qy + dy is on the grid
        for dx in range(-(gw - 1), gw):
            qx = slice(max(0, -dx), gw - max(0, dx))
            ys = torch.arange(qy.start, qy.stop)
            xs = torch.arange(qx.start, qx.stop)
            weights = grid[:, :, ys[:, None], xs[None, :], ys[:, None] + dy, xs[None, :] + dx]
            out[:, :, dy + gh - 1, dx + gw - 1] = weights.mean(dim=(-2, -1))
    return out


class _MeanMapsPerBlock(Analysis):
    """Each block's self-attention maps, reduced per image by :meth:`reduce` and averaged over the images."""

    definition = ""
    title = ""
    min_px = 0  # the plot's smallest cell size (0: the plot's default)

    def start(self, out):
        found = self_attention_maps(out)
        if not found:
            return "the model materialises no self-attention maps"
        self.blocks = [i for i, _ in found]
        self.means = [RunningMean() for _ in found]
        return None

    def reduce(self, attn: Tensor, layout: TokenLayout) -> Tensor:
        raise NotImplementedError

    def update(self, out, n):
        for mean, (_, attn) in zip(self.means, self_attention_maps(out)):
            mean.add(self.reduce(attn, out["layout"]).mean(0), n)

    def result(self) -> dict[str, Any]:
        return {"definition": self.definition, "blocks": self.blocks, "maps": [to_json(m.value) for m in self.means]}

    def plot(self, result, path):
        maps = np.array(result["maps"], dtype=np.float32)[:, : self.ctx.max_heads]
        plots.map_grid(
            maps,
            path,
            row_labels=[f"block {b}" for b in result["blocks"]],
            col_labels=[f"head {h}" for h in range(maps.shape[1])],
            title=self.title,
            **({"min_px": self.min_px} if self.min_px else {}),
        )


class RelativeAttention(_MeanMapsPerBlock):
    """Self-attention by relative offset, per block and head, averaged over the images (AFT Figure 1)."""

    name = "relative_attention"
    definition = (
        "mean over images and query patches of the attention to the key patch at offset (dy, dx); "
        "row dy + gh - 1, column dx + gw - 1 (centre = the query's own patch); prefix tokens left out"
    )
    title = "attention by relative offset (mean over images and queries)"

    def start(self, out):
        return "the tokens have no patch grid" if out["layout"].grid is None else super().start(out)

    def reduce(self, attn: Tensor, layout: TokenLayout) -> Tensor:
        return relative_attention(attn, layout)

    def summary(self, result):
        maps = [np.array(m) for m in result["maps"]]
        centre = [float(m[:, m.shape[1] // 2, m.shape[2] // 2].mean()) for m in maps]
        return f"{len(maps)} blocks; attention to the own patch {min(centre):.3f}..{max(centre):.3f} (mean over heads)"


class AttentionMatrix(_MeanMapsPerBlock):
    """The full attention matrix per block and head, averaged over the images (CPVT's attention-matrix plot)."""

    name = "attention_matrix"
    definition = "attention matrix (query row, key column) per head, mean over images"
    title = "attention matrices (query x key, mean over images)"
    min_px = 128

    def reduce(self, attn: Tensor, layout: TokenLayout) -> Tensor:
        return attn.double()

    def summary(self, result):
        maps = [np.array(m) for m in result["maps"]]
        diag = [float(np.mean([np.trace(h) / h.shape[0] for h in m])) for m in maps]
        return (
            f"{len(maps)} blocks of {maps[0].shape[-1]} tokens; mean diagonal weight {min(diag):.3f}..{max(diag):.3f}"
        )
