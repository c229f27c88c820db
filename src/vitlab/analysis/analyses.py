"""The analyses of ``vitlab analyze`` as a library: :func:`analyze` looks inside a model on a few images.

Every analysis writes ``<out>/<name>.json`` (the numbers) and ``<out>/<name>.png`` (the figure):

- ``attention``: the attention maps of one query token (class token or a patch), per block and head;
- ``collapse``: DeepViT's cross-layer similarity of attention maps and its "#similar blocks";
- ``heads``: the similarity between the heads of each block (DeepViT: "below 30%");
- ``evolution``: how similar the token features of consecutive blocks are (Refiner Fig. 2/4);
- ``aft_bias``: AFT-conv's learned relative position weights ``exp(w) - 1`` per layer and head (AFT Fig. 1);
- ``aft_keys``: AFT's keys as feature maps over the image (AFT Figs. 9-12);
- ``external``: external attention of the patches to memory slots, per head (EA Fig. 5);
- ``relative_attention`` / ``attention_matrix``: self-attention by query-key offset (a ViT's side of AFT Fig. 1)
  and whole attention matrices (CPVT's plot), averaged over the images (:mod:`.matrices`);
- ``tnt_features`` / ``tnt_tsne`` / ``tnt_inner_attention``: TNT's feature maps of the patch and pixel embeddings,
  t-SNE of the feature maps and pixel-level attention (:mod:`.tnt`).

Everything is read from ``model.forward_trace(x, return_aux=True)`` (attention takes its
explicit path there; the logits are the same, which ``summary.json`` records), except AFT-conv's
kernels, which are parameters. Analyses that do not apply to a model are skipped with a note.
The numbers are the pure tensor functions of :mod:`vitlab.measure.maps`; the figures come from :mod:`.plots`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from ..common.io import write_json_atomic
from ..common.rundir import RunLock
from ..measure import maps as metrics
from ..mixers import AFTConv
from ..mixers.base import TokenLayout
from . import plots
from .base import Analysis, Context, RunningMean, memory_attention_maps, pad_stack, self_attention_maps, to_json
from .matrices import AttentionMatrix, RelativeAttention
from .tnt import TNTTSNE, TNTFeatures, TNTInnerAttention

ANALYSES = (
    "attention",
    "collapse",
    "heads",
    "evolution",
    "aft_bias",
    "aft_keys",
    "external",
    "relative_attention",
    "attention_matrix",
    "tnt_features",
    "tnt_tsne",
    "tnt_inner_attention",
)
GROUPS = {"all": ANALYSES, "aft": ("aft_bias", "aft_keys"), "tnt": ("tnt_features", "tnt_tsne", "tnt_inner_attention")}
PLOT_ROWS = 8  # memory slots drawn in the external-attention figure (the JSON has every one asked for)


def parse_what(spec: str) -> list[str]:
    """Analysis names from a comma-separated list of names and groups (``aft``, ``all``), in order, once each."""
    names: list[str] = []
    for part in (s.strip().lower() for s in spec.split(",") if s.strip()):
        if part not in GROUPS and part not in ANALYSES:
            raise ValueError(f"unknown analysis {part!r}; choose from {', '.join(ANALYSES)}, aft, tnt, all")
        names += [n for n in GROUPS.get(part, (part,)) if n not in names]
    if not names:
        raise ValueError(f"--what is empty; choose from {', '.join(ANALYSES)}, aft, tnt, all")
    return names


class BlockMaps(Analysis):
    """Per block, maps over the patch grid: gathered batch by batch, stored as ``maps[image][block]`` and
    drawn for image 0 beside it. Subclasses say which blocks have the source tensor (:meth:`found`, else
    ``missing`` says why the analysis is skipped) and how it becomes maps (:meth:`images`)."""

    missing = ""

    def found(self, out: dict) -> list[tuple[int, Tensor]]:
        raise NotImplementedError

    def images(self, a: Tensor, layout: TokenLayout) -> Tensor:
        raise NotImplementedError

    def setup(self, out: dict, found: list[tuple[int, Tensor]]) -> None:
        """Check the options against the model (ValueError on a bad one)."""

    def start(self, out):
        if out["layout"].grid is None:
            return "the tokens have no patch grid"
        found = self.found(out)
        if not found:
            return self.missing
        self.setup(out, found)
        self.blocks, self.maps = [i for i, _ in found], []
        return None

    def update(self, out, n):
        self.maps.append([self.images(a, out["layout"]).float().cpu() for _, a in self.found(out)])

    def per_image(self) -> list[list[Any]]:
        """The maps as JSON, ``[image][block]``."""
        per_block = [torch.cat([b[j] for b in self.maps]) for j in range(len(self.blocks))]
        return [[to_json(m[i]) for m in per_block] for i in range(per_block[0].shape[0])]

    def draw(self, maps: np.ndarray, path: Path, cols: str, title: str, rows: list[str] | None = None, **kw) -> None:
        """``maps`` (rows, columns, h, w), one row per block unless ``rows`` names them, beside image 0."""
        plots.map_grid(
            maps,
            path,
            row_labels=[f"block {b}" for b in self.blocks] if rows is None else rows,
            col_labels=[f"{cols} {c}" for c in range(maps.shape[1])],
            image=self.ctx.images[0].numpy(),
            title=title,
            **kw,
        )


class QueryAttention(BlockMaps):
    """Attention of one query token over the image, per block and head."""

    name = "attention"
    missing = "no block computes a self-attention map (B, H, N, N)"

    def found(self, out):
        return self_attention_maps(out)

    def setup(self, out, found):
        layout = out["layout"]
        gh, gw = layout.grid
        q = self.ctx.query
        if q is None:
            q = "cls" if layout.num_prefix else str((gh // 2) * gw + gw // 2)
        if q.lower() == "cls":
            if not layout.num_prefix:
                raise ValueError("--query cls: this model has no class token; give a patch index instead")
            self.query, self.patch = 0, None
        else:
            try:
                patch = int(q)
            except ValueError:
                raise ValueError(f"--query must be 'cls' or a patch index, got {q!r}") from None
            if not 0 <= patch < gh * gw:
                raise ValueError(
                    f"--query {patch}: the patch grid is {gh}x{gw}, so the index must be in [0, {gh * gw})"
                )
            self.query, self.patch = layout.num_prefix + patch, patch
        self.grid = (gh, gw)

    def images(self, a, layout):
        return metrics.query_attention(a, self.query, layout.grid, layout.num_prefix)

    def result(self):
        gh, gw = self.grid
        where = "cls" if self.patch is None else f"patch {self.patch} (row {self.patch // gw}, col {self.patch % gw})"
        return {
            "definition": "A[h, query, patches]: the attention row of the query token over the patch tokens, "
            "per block and head (attention given to prefix tokens left out)",
            "query": where,
            "query_token": self.query,
            "grid": [gh, gw],
            "blocks": self.blocks,
            "maps": self.per_image(),  # [image][block][head][row][col]
        }

    def plot(self, result, path):
        marker = None
        if self.patch is not None:  # the query patch's centre in image pixels
            (gh, gw), (h, w) = self.grid, self.ctx.images.shape[-2:]
            marker = ((self.patch % gw + 0.5) * w / gw - 0.5, (self.patch // gw + 0.5) * h / gh - 0.5)
        maps = pad_stack(result["maps"][0])[:, : self.ctx.max_heads]
        self.draw(maps, path, "head", f"attention of the query {result['query']} (image 0)", marker=marker)

    def summary(self, result):
        return f"query {result['query']}, {len(self.blocks)} blocks"


class Collapse(Analysis):
    """DeepViT's cross-layer attention similarity and its count of similar blocks."""

    name = "collapse"

    def start(self, out):
        found = self_attention_maps(out)
        if len(found) < 2:
            return f"needs self-attention maps in at least 2 blocks, found {len(found)}"
        shapes = {tuple(a.shape) for _, a in found}
        if len(shapes) > 1:
            return f"the blocks' attention maps differ in shape ({sorted(shapes)})"
        self.blocks, self.mean = [i for i, _ in found], RunningMean()
        return None

    def update(self, out, n):
        self.mean.add(metrics.cross_layer_similarity([a for _, a in self_attention_maps(out)]), n)

    def result(self):
        sim = self.mean.value
        t = self.ctx.threshold
        similar = [self.blocks[k] for k in metrics.similar_blocks(sim, t)]
        return {
            "definition": "M[p, q] = mean over heads h, tokens t and images of cos(A^p[h, :, t], A^q[h, :, t]), "
            "the cosine between attention columns of blocks p and q (DeepViT)",
            "similar_blocks_definition": "blocks whose similarity with the previous attention block is > threshold",
            "blocks": self.blocks,
            "similarity": to_json(sim),
            "adjacent_similarity": to_json(metrics.adjacent_similarity(sim)),
            "threshold": t,
            "similar_blocks": len(similar),
            "similar_block_indices": similar,
        }

    def plot(self, result, path):
        plots.matrices(
            [np.array(result["similarity"])],
            path,
            titles=["cross-layer attention similarity"],
            ticks=[str(b) for b in self.blocks],
            annotate=True,
            axis="block",
            title=f"{result['similar_blocks']} similar blocks (adjacent similarity > {result['threshold']})",
        )

    def summary(self, result):
        adj = result["adjacent_similarity"]
        return f"{result['similar_blocks']} similar blocks (> {result['threshold']}), adjacent similarity " + (
            f"{min(adj):.3f}..{max(adj):.3f}"
        )


class HeadSimilarity(Analysis):
    """Similarity between the heads of each block (self- or external attention)."""

    name = "heads"

    def _maps(self, out) -> list[tuple[int, Tensor]]:
        found = dict(self_attention_maps(out)) | dict(memory_attention_maps(out))
        return sorted((i, a) for i, a in found.items() if a.shape[1] > 1)

    def start(self, out):
        found = self._maps(out)
        if not found:
            return "no block computes attention maps with more than one head"
        self.blocks, self.means = [i for i, _ in found], [RunningMean() for _ in found]
        return None

    def update(self, out, n):
        for mean, (_, a) in zip(self.means, self._maps(out)):
            mean.add(metrics.head_similarity(a), n)

    def result(self):
        sims = [m.value for m in self.means]
        off = [float(s[~torch.eye(len(s), dtype=torch.bool)].mean()) for s in sims]
        return {
            "definition": "S[g, h] = mean over tokens t and images of cos(A[g, :, t], A[h, :, t]), the cosine "
            "between attention columns of heads g and h in one block (DeepViT)",
            "blocks": self.blocks,
            "similarity": [to_json(s) for s in sims],
            "mean_between_heads": off,
        }

    def plot(self, result, path):
        plots.matrices(
            [np.array(s) for s in result["similarity"]],
            path,
            titles=[f"block {b}: mean {m:.2f}" for b, m in zip(self.blocks, result["mean_between_heads"])],
            title="similarity between heads",
            axis="head",
        )

    def summary(self, result):
        m = result["mean_between_heads"]
        return f"mean similarity between heads {min(m):.3f}..{max(m):.3f} over {len(m)} blocks"


class FeatureEvolution(Analysis):
    """Cosine similarity of token features between consecutive blocks. Where blocks change the tokens' shape (a
    CNN's or a pyramid's stage that downsamples or widens) the pair has no similarity (null): the blocks of each
    run of one shape are compared, as a ViT's all are."""

    name = "evolution"

    def start(self, out):
        if len(out["tokens"]) < 2:
            return "needs at least 2 blocks"
        shapes = [tuple(t.shape[1:]) for t in out["tokens"]]
        self.runs = [[0]]  # block indices in runs of one token shape
        for k in range(1, len(shapes)):
            if shapes[k] == shapes[k - 1]:
                self.runs[-1].append(k)
            else:
                self.runs.append([k])
        if all(len(r) < 2 for r in self.runs):
            return "no two consecutive blocks give tokens of one shape (every block changes the resolution or width)"
        self.num_blocks, self.mean = len(shapes), RunningMean()
        return None

    def update(self, out, n):
        tokens, p = out["tokens"], out["layout"].num_prefix
        sims = torch.full((self.num_blocks - 1,), float("nan"), dtype=torch.float64)
        for run in self.runs:
            if len(run) > 1:
                sims[run[1] - 1 : run[-1]] = metrics.feature_evolution([tokens[k] for k in run], p).double()
        self.mean.add(sims, n)

    def result(self):
        return {
            "definition": "s[k] = mean over patch tokens n and images of cos(X^{k-1}_n, X^k_n), X^k the output of "
            "block k (Refiner Fig. 2/4); near 1 = the features barely change; null where block k changes the "
            "tokens' shape (a CNN's downsampling or widening block)",
            "blocks": list(range(1, len(self.mean.value) + 1)),
            "similarity": to_json(self.mean.value),
        }

    def plot(self, result, path):
        s = [float("nan") if v is None else v for v in result["similarity"]]
        plots.curve(
            result["blocks"],
            s,
            path,
            xlabel="block k",
            ylabel="cos(features k-1, k)",
            title="feature evolution",
            ylim=(min(0.0, *(v for v in s if v == v)), 1.02),
        )

    def summary(self, result):
        s = [v for v in result["similarity"] if v is not None]
        gaps = len(result["similarity"]) - len(s)
        where = f" ({gaps} blocks change the tokens' shape: no pair)" if gaps else ""
        return f"similarity of consecutive blocks' features {min(s):.3f}..{max(s):.3f}{where}"


class AFTBias(Analysis):
    """AFT-conv's relative position weights exp(w) - 1 per layer and head (parameters, no images needed)."""

    name = "aft_bias"

    def start(self, out):
        self.layers = [(n, m) for n, m in self.ctx.model.named_modules() if isinstance(m, AFTConv)]
        return None if self.layers else "the model has no AFT-conv layer"

    def result(self):
        with torch.no_grad():
            kernels = [m.effective_kernel() for _, m in self.layers]
        blocks = [int(b.group(1)) if (b := re.search(r"blocks\.(\d+)\.", n + ".")) else None for n, _ in self.layers]
        return {
            "definition": "exp(w) - 1 per head (h, s, s), w the re-parameterised relative bias "
            "(AFT Eq. 8: gamma * standardise(w) + beta); row dy, column dx = offset (dy, dx) - s // 2",
            "layers": [n for n, _ in self.layers],
            "blocks": blocks,
            "kernels": [to_json(k) for k in kernels],
        }

    def plot(self, result, path):
        kernels = pad_stack(result["kernels"])[:, : self.ctx.max_heads]
        plots.map_grid(
            kernels,
            path,
            row_labels=[n.replace(".mixer", "") for n in result["layers"]],
            col_labels=[f"head {h}" for h in range(kernels.shape[1])],
            diverging=True,
            title="AFT-conv relative position weights exp(w) - 1",
        )

    def summary(self, result):
        k = [np.array(x) for x in result["kernels"]]
        return f"{len(k)} AFT-conv layers, |exp(w) - 1| <= {max(float(np.abs(x).max()) for x in k):.3g}"


class AFTKeys(BlockMaps):
    """AFT keys as feature maps over the patch grid, per layer and head (AFT-conv) or channel."""

    name = "aft_keys"
    missing = "no block is an AFT layer (no keys)"

    def found(self, out):
        return [(i, aux["keys"]) for i, aux in enumerate(out["aux"]) if "keys" in aux]

    def setup(self, out, found):
        self.channels = [k.shape[-1] for _, k in found]

    def images(self, a, layout):
        return metrics.token_maps(a[..., : self.ctx.max_heads], layout.grid, layout.num_prefix)

    def result(self):
        return {
            "definition": "K[n, c] of every patch token n as an image, per layer and key channel (one per head "
            "in AFT-conv); keys before the exponential",
            "blocks": self.blocks,
            "num_channels": self.channels,
            "channels_shown": min(self.ctx.max_heads, max(self.channels)),
            "maps": self.per_image(),
        }

    def plot(self, result, path):
        self.draw(pad_stack(result["maps"][0]), path, "key", "AFT keys as feature maps (image 0)")

    def summary(self, result):
        return f"{len(self.blocks)} AFT layers, {result['channels_shown']} key channels shown"


class ExternalMaps(BlockMaps):
    """External attention of the patches to chosen memory slots, per block and head."""

    name = "external"
    missing = "no block uses external attention"

    def found(self, out):
        return memory_attention_maps(out)

    def setup(self, out, found):
        size = min(a.shape[-1] for _, a in found)
        if any(s >= size for s in self.ctx.slots):
            raise ValueError(f"--slots {self.ctx.slots}: the external memories have {size} slots")

    def images(self, a, layout):
        return metrics.slot_maps(a[:, : self.ctx.max_heads], self.ctx.slots, layout.grid, layout.num_prefix)

    def result(self):
        return {
            "definition": "A[h, patches, s]: the double-normalised external attention of every patch to memory "
            "slot s, per block, slot and head (EA Fig. 5)",
            "blocks": self.blocks,
            "slots": self.ctx.slots,
            "maps": self.per_image(),
        }

    def plot(self, result, path):
        # the last EA block as the paper; (slots, heads, gh, gw), at most PLOT_ROWS slots drawn
        last = np.asarray(result["maps"][0][-1], dtype=np.float32)[:PLOT_ROWS]
        rows = [f"slot {s}" for s in self.ctx.slots[:PLOT_ROWS]]
        title = f"external attention to memory slots, block {self.blocks[-1]} (image 0)"
        self.draw(last, path, "head", title, rows=rows)

    def summary(self, result):
        return f"{len(self.blocks)} external-attention blocks, slots {self.ctx.slots}"


CLASSES: dict[str, type[Analysis]] = {
    c.name: c
    for c in (
        QueryAttention,
        Collapse,
        HeadSimilarity,
        FeatureEvolution,
        AFTBias,
        AFTKeys,
        ExternalMaps,
        RelativeAttention,
        AttentionMatrix,
        TNTFeatures,
        TNTTSNE,
        TNTInnerAttention,
    )
}


# --------------------------------------------------------------------------------------------- run
def analyze(
    model: nn.Module,
    images: Tensor,
    x: Tensor,
    what: Sequence[str],
    out_dir: str | Path,
    *,
    query: str | None = None,
    threshold: float = 0.9,
    slots: Sequence[int] = (0, 1),
    max_heads: int = 24,
    batch_size: int = 8,
    log: Callable[[str], None] = print,
    lock: bool = True,
) -> dict[str, Any]:
    """Run the analyses ``what`` (names of :data:`ANALYSES`) on the model input ``x`` (``images``: the same
    in [0, 1], for the figures); write ``<name>.json`` / ``<name>.png`` and ``summary.json`` to ``out_dir``
    and return the summary. ``out_dir`` is owned while it is written (:class:`vitlab.common.rundir.RunLock`:
    a second writer is refused with one line naming this one); ``lock=False`` when the caller holds that lock."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"--threshold must be in [0, 1], got {threshold}")
    if not hasattr(model, "forward_trace"):
        raise ValueError(f"{type(model).__name__} has no forward_trace(x, return_aux=True) to analyse")
    if max_heads < 1 or batch_size < 1:
        raise ValueError(f"--max-heads and --batch-size must be positive, got {max_heads}, {batch_size}")
    out_dir = Path(out_dir)
    ctx = Context(model, images.cpu(), query, threshold, list(slots), max_heads)
    with RunLock(out_dir, "vitlab analyze", log) if lock else contextlib.nullcontext():
        return _run(model, x, [CLASSES[n](ctx) for n in what], out_dir, batch_size, log)


def _run(
    model: nn.Module, x: Tensor, todo: list[Analysis], out_dir: Path, batch_size: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """:func:`analyze`'s work, in the folder it owns."""
    out_dir.mkdir(parents=True, exist_ok=True)
    logits_diff, skipped = _feed(model, x, todo, batch_size)
    report: dict[str, Any] = {
        "model": getattr(model, "meta", {}).get("name", type(model).__name__),
        "num_images": len(x),
        "explicit_path_max_abs_logit_diff": logits_diff,
        "analyses": {},
    }
    for a in todo:
        result = a.result()
        json_path, png_path = out_dir / f"{a.name}.json", out_dir / f"{a.name}.png"
        write_json_atomic(json_path, result, indent=None)
        a.plot(result, png_path)
        report["analyses"][a.name] = {"json": str(json_path), "png": str(png_path), "summary": a.summary(result)}
        log(f"{a.name:10s} {a.summary(result)}  -> {json_path}, {png_path.name}")
    for name, why in skipped.items():
        report["analyses"][name] = {"skipped": why}
        log(f"{name:10s} skipped: {why}")
    write_json_atomic(out_dir / "summary.json", report)
    return report


def _feed(model: nn.Module, x: Tensor, todo: list[Analysis], batch_size: int) -> tuple[float, dict[str, str]]:
    """Run ``x`` through the model in batches and feed every analysis. The first batch starts them: those
    that do not apply leave ``todo`` and come back in the dict (name: why). Also returns the largest
    difference between the logits of the explicit (map-materialising) path and ``model(x)``."""
    skipped: dict[str, str] = {}
    logits_diff = 0.0
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            xb = x[start : start + batch_size].to(device)
            out = model.forward_trace(xb, return_aux=True)
            if start == 0:
                logits_diff = float((model.forward_head(out["features"]) - model(xb)).abs().max())
            out = tree_map(lambda t: t.cpu() if isinstance(t, Tensor) else t, out)  # the analyses work on the CPU
            if start == 0:
                for a in list(todo):
                    if (why := a.start(out)) is not None:
                        skipped[a.name] = why
                        todo.remove(a)
            for a in todo:
                a.update(out, len(xb))
    return logits_diff, skipped
