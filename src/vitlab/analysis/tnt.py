"""TNT's figures (Han et al. 2021, §4.3): what the outer and inner transformers see, read from ``forward_trace``'s
``tokens`` (sentences), ``inner_tokens`` (words) and the inner blocks' ``inner_attn`` maps.

- ``tnt_features``: per block, feature maps of the patch embeddings (the outer tokens on the patch grid, a fixed
  random sample of channels, as the paper's Fig. 3a) and of the pixel embeddings (the words of every patch placed
  at their pixels, averaged over their channels: Fig. 4);
- ``tnt_tsne``: t-SNE of the last block's feature maps (every channel of the outer tokens is one point, its
  values over the patches of all images the coordinates: Fig. 3b);
- ``tnt_inner_attention``: pixel-level attention: in every patch, where its centre word looks among the patch's
  words, per block and inner head, the patches tiled into one image.

The paper draws the feature maps and the t-SNE of DeiT-S beside TNT-S: ``tnt_features`` and ``tnt_tsne`` also
take a plain ViT (DeiT, or any model whose blocks all give one patch grid of one width), its patch tokens being
the maps. Such a model has no inner words, so there are no pixel embeddings: ``inner`` is None, and the
figure and ``pixel_embeddings`` say so. ``tnt_inner_attention`` needs TNT.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..measure import maps as metrics
from . import plots
from .base import Analysis, pad_stack, to_json
from .tsne import tsne

FEATURE_CHANNELS = 12  # channels drawn per block (the paper samples 12)


def word_image(words: Tensor, grid: tuple[int, int], word_grid: tuple[int, int]) -> Tensor:
    """Words placed at their pixels: ``(B·n, m, ...)`` with ``n = gh·gw`` patches of ``m = mh·mw`` words ->
    ``(B, ..., gh·mh, gw·mw)``: word ``(r, c)`` of patch ``(i, j)`` at row ``i·mh + r``, column ``j·mw + c``."""
    (gh, gw), (mh, mw) = grid, word_grid
    n, m = gh * gw, mh * mw
    if words.dim() < 2 or words.shape[0] % n or words.shape[1] != m:
        raise ValueError(f"word_image: expected (B*{n}, {m}, ...) words of a {gh}x{gw} grid, got {tuple(words.shape)}")
    b, rest = words.shape[0] // n, words.shape[2:]
    x = words.reshape(b, gh, gw, mh, mw, -1).permute(0, 5, 1, 3, 2, 4)  # (B, K, gh, mh, gw, mw)
    return x.reshape(b, *rest, gh * mh, gw * mw)


NO_WORDS = "none: the model has no inner words (a plain ViT / DeiT), only its patch tokens are drawn"


def _tnt_parts(ctx_model: Any, out: dict, words: bool = True) -> tuple[str | None, tuple[int, int] | None]:
    """Why the analyses do not apply (None if they do), and the words' grid in a patch: None for a plain ViT,
    which ``words`` (the analysis needs TNT's inner words) refuses."""
    layout = out["layout"]
    if layout.grid is None:
        return "the tokens have no patch grid", None
    n = layout.num_prefix + layout.grid[0] * layout.grid[1]
    if {(t.shape[1], t.shape[2]) for t in out["tokens"]} != {(n, out["tokens"][0].shape[2])}:
        return "the blocks' tokens are not one patch grid of one width (a pyramid or a CNN)", None
    if "inner_tokens" in out and hasattr(ctx_model, "pixel_embed"):
        return None, tuple(ctx_model.pixel_embed.word_grid)
    return ("not a TNT model (no inner tokens)" if words else None), None


class TNTFeatures(Analysis):
    """Outer feature maps (sampled channels) and the channel mean of the pixel embeddings, per block; a plain
    ViT's patch tokens (no pixel embeddings)."""

    name = "tnt_features"

    def start(self, out):
        why, self.word_grid = _tnt_parts(self.ctx.model, out, words=False)
        if why is not None:
            return why
        dim = out["tokens"][0].shape[-1]
        gen = torch.Generator().manual_seed(0)
        self.channels = sorted(torch.randperm(dim, generator=gen)[: min(FEATURE_CHANNELS, dim)].tolist())
        self.outer: list[list[Tensor]] = []
        self.inner: list[list[Tensor]] = []
        return None

    def update(self, out, n):
        layout = out["layout"]
        self.outer.append(
            [metrics.token_maps(t, layout.grid, layout.num_prefix)[:, self.channels] for t in out["tokens"]]
        )
        if self.word_grid is not None:
            self.inner.append([word_image(w.mean(-1), layout.grid, self.word_grid) for w in out["inner_tokens"]])

    def result(self):
        outer = [torch.cat(blocks) for blocks in zip(*self.outer)]  # per block (images, channels, gh, gw)
        inner = [torch.cat(blocks) for blocks in zip(*self.inner)]  # per block (images, gh·mh, gw·mw)
        return {
            "definition": "outer: the block's patch embeddings as maps over the patch grid, channels 'channels'; "
            "inner: the block's pixel embeddings (words) averaged over their channels, each word at its place in "
            "its patch (TNT Figs. 3a, 4); a plain ViT / DeiT has outer maps only",
            "pixel_embeddings": "TNT's inner words" if inner else NO_WORDS,
            "channels": self.channels,
            "word_grid": None if self.word_grid is None else list(self.word_grid),
            "blocks": list(range(len(outer))),
            "outer": [[to_json(b[i]) for b in outer] for i in range(outer[0].shape[0])],  # [image][block][ch][h][w]
            "inner": [[to_json(b[i]) for b in inner] for i in range(inner[0].shape[0])] if inner else None,
        }

    def plot(self, result, path):
        outer = np.asarray(result["outer"][0], dtype=np.float32)
        cols = [f"ch {c}" for c in self.channels]
        if self.word_grid is None:
            maps = outer
            title = "patch-token feature maps, sampled channels (image 0); no pixel embeddings: no inner words"
        else:
            mh, mw = self.word_grid
            inner = np.asarray(result["inner"][0], dtype=np.float32)[:, None]
            maps = np.concatenate([outer.repeat(mh, -2).repeat(mw, -1), inner], axis=1)  # outer to pixel size
            cols.append("pixel mean")
            title = "TNT feature maps: patch embeddings (sampled channels) and pixel embeddings (image 0)"
        plots.map_grid(
            maps,
            path,
            row_labels=[f"block {b}" for b in result["blocks"]],
            col_labels=cols,
            image=self.ctx.images[0].numpy(),
            title=title,
        )

    def summary(self, result):
        words = "the pixel embeddings" if result["inner"] is not None else "no pixel embeddings (no inner words)"
        return f"{len(result['blocks'])} blocks, {len(self.channels)} channels and {words}"


class TNTTSNE(Analysis):
    """t-SNE of the last block's feature maps: one point per channel of the outer tokens (a plain ViT's tokens)."""

    name = "tnt_tsne"

    def start(self, out):
        why, _ = _tnt_parts(self.ctx.model, out, words=False)
        if why is not None:
            return why
        if out["tokens"][0].shape[-1] < 4:
            return "fewer than 4 channels: nothing to embed"
        self.maps: list[Tensor] = []
        self.block = len(out["tokens"]) - 1
        return None

    def update(self, out, n):
        layout = out["layout"]
        maps = metrics.token_maps(out["tokens"][-1], layout.grid, layout.num_prefix)  # (B, C, gh, gw)
        self.maps.append(maps.flatten(2).transpose(0, 1).flatten(1).double())  # (C, B·gh·gw)

    def result(self):
        points = torch.cat(self.maps, 1)  # (C, images · patches): channel c's map over every image
        perplexity = min(30.0, (points.shape[0] - 1) / 3)
        y, kl = tsne(points, perplexity)
        return {
            "definition": "t-SNE (exact, perplexity 'perplexity') of the last block's feature maps: point c is "
            "channel c of the patch embeddings, its coordinates the channel's values at every patch of every "
            "image (TNT Fig. 3b)",
            "block": self.block,
            "perplexity": perplexity,
            "kl_divergence": kl,
            "points": to_json(y),  # [channel][x, y]
        }

    def plot(self, result, path):
        y = np.asarray(result["points"], dtype=np.float32)
        plots.scatter(y, path, title=f"t-SNE of block {result['block']}'s {len(y)} feature maps (TNT Fig. 3b)")

    def summary(self, result):
        return f"{len(result['points'])} feature maps, KL {result['kl_divergence']:.3f}"


class TNTInnerAttention(Analysis):
    """Pixel-level attention: each patch's centre word over the patch's words, per inner block and head."""

    name = "tnt_inner_attention"

    def start(self, out):
        why, self.word_grid = _tnt_parts(self.ctx.model, out)
        if why is not None:
            return why
        self.blocks = [i for i, aux in enumerate(out["aux"]) if "inner_attn" in aux]
        if not self.blocks:
            return "no block has the inner transformer's attention maps"
        mh, mw = self.word_grid
        self.query = (mh // 2) * mw + mw // 2
        self.maps: list[list[Tensor]] = []
        return None

    def update(self, out, n):
        grid = out["layout"].grid
        rows = [out["aux"][i]["inner_attn"][:, :, self.query] for i in self.blocks]  # (B·n, heads, m)
        self.maps.append([word_image(r.transpose(1, 2), grid, self.word_grid) for r in rows])

    def result(self):
        per_block = [torch.cat(blocks) for blocks in zip(*self.maps)]  # (images, heads, gh·mh, gw·mw)
        mh, mw = self.word_grid
        return {
            "definition": "A[h, q, words]: in every patch, the inner attention row of its centre word q over the "
            "patch's words, per inner block and head, each patch's row placed at its pixels",
            "query_word": [self.query // mw, self.query % mw],
            "word_grid": [mh, mw],
            "blocks": self.blocks,
            "maps": [[to_json(b[i]) for b in per_block] for i in range(per_block[0].shape[0])],
        }

    def plot(self, result, path):
        maps = pad_stack(result["maps"][0])[:, : self.ctx.max_heads]
        plots.map_grid(
            maps,
            path,
            row_labels=[f"block {b}" for b in self.blocks],
            col_labels=[f"head {h}" for h in range(maps.shape[1])],
            image=self.ctx.images[0].numpy(),
            title="TNT pixel-level attention of each patch's centre word (image 0)",
        )

    def summary(self, result):
        return f"{len(self.blocks)} inner blocks, query word {result['query_word']}"
