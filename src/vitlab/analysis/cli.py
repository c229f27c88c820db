"""``vitlab analyze``: look inside a model (random or a checkpoint) on a few images.

Every analysis writes ``<out>/<name>.json`` (the numbers) and ``<out>/<name>.png`` (the figure):

- ``attention``: the attention maps of one query token (class token or a patch), per block and head;
- ``collapse``: DeepViT's cross-layer similarity of attention maps (DeepViT §3) and its "#similar blocks";
- ``heads``: the similarity between the heads of each block (DeepViT: "below 30%");
- ``evolution``: how similar the token features of consecutive blocks are (Refiner paper Figs. 2 and 4);
- ``aft_bias``: AFT-conv's learned relative position weights ``exp(w) - 1`` per layer and head (AFT Fig. 1);
- ``aft_keys``: AFT's keys as feature maps over the image (AFT Figs. 9-12);
- ``external``: external attention of the patches to memory slots, per head (EA Fig. 5).

Everything is read from ``model.forward_intermediates(x, return_aux=True)`` (attention takes its
explicit path there; the logits are the same, which ``summary.json`` records), except AFT-conv's
kernels, which are parameters. Analyses that do not apply to a model are skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from . import metrics

ANALYSES = ("attention", "collapse", "heads", "evolution", "aft_bias", "aft_keys", "external")
GROUPS = {"all": ANALYSES, "aft": ("aft_bias", "aft_keys")}
PLOT_ROWS = 8  # memory slots drawn in the external-attention figure (the JSON has every one asked for)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registered model name (see `vitlab models`)")
    p.add_argument(
        "--checkpoint",
        help="weights: a `vitlab train` checkpoint, .safetensors, or a state dict (vitlab's or an official "
        "implementation's names); default: random init",
    )
    p.add_argument("--ema", action="store_true", help="use the EMA weights of a `vitlab train` checkpoint")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", help="dataset: mnist | cifar10:DIR | mnist-idx:DIR | folder:DIR (default: mnist)")
    src.add_argument("--images", nargs="+", metavar="FILE", help="image files instead of a dataset")
    p.add_argument("--split", default="test", choices=("train", "test"), help="dataset split (default: test)")
    p.add_argument("--num-images", type=int, default=4, help="images to analyse (default: 4; the first is plotted)")
    p.add_argument(
        "--query",
        default=None,
        help="query token of the attention maps: 'cls' or a patch index (row-major); default: cls, "
        "or the centre patch for models without a class token",
    )
    p.add_argument("--threshold", type=float, default=0.9, help="similarity above which a block is 'similar'")
    p.add_argument(
        "--what", default="all", help=f"comma-separated analyses: {', '.join(ANALYSES)}, aft (both aft_*), or all"
    )
    p.add_argument("--slots", default="0,1", help="external attention memory slots to show (default: 0,1)")
    p.add_argument("--max-heads", type=int, default=24, help="heads / key channels shown per layer (default: 24)")
    p.add_argument("--img-size", type=int, help="build the model for this input size")
    p.add_argument("--in-chans", type=int, help="build the model for this many input channels")
    p.add_argument("--num-classes", type=int, help="classes of the head (default: the checkpoint's, else 1000)")
    p.add_argument("--batch-size", type=int, default=8, help="images per forward pass (default: 8)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random initialisation (default: 0)")
    p.add_argument("--out", default="analysis", help="output folder (default: ./analysis)")


# ------------------------------------------------------------------------------------------- helpers
def parse_what(spec: str) -> list[str]:
    names: list[str] = []
    for part in (s.strip().lower() for s in spec.split(",") if s.strip()):
        if part not in GROUPS and part not in ANALYSES:
            raise ValueError(f"unknown analysis {part!r}; choose from {', '.join(ANALYSES)}, aft, all")
        names += [n for n in GROUPS.get(part, (part,)) if n not in names]
    if not names:
        raise ValueError(f"--what is empty; choose from {', '.join(ANALYSES)}, aft, all")
    return names


def to_json(t: Tensor | np.ndarray) -> Any:
    """Nested lists of a tensor's values: float32 values exactly (as doubles), NaN/inf as null."""
    a = t.detach().float().cpu().numpy() if isinstance(t, Tensor) else np.asarray(t, dtype=np.float32)
    a = a.astype(np.float64)
    if np.isfinite(a).all():
        return a.tolist()
    return np.where(np.isfinite(a), a, None).tolist()


def pad_stack(arrays: Sequence[Tensor]) -> np.ndarray:
    """Stack tensors whose shapes differ (heads, kernel sizes) into one array, NaN-padded."""
    shape = [max(a.shape[d] for a in arrays) for d in range(arrays[0].dim())]
    out = np.full((len(arrays), *shape), np.nan, dtype=np.float32)
    for i, a in enumerate(arrays):
        out[(i, *(slice(0, s) for s in a.shape))] = a.detach().float().cpu().numpy()
    return out


class RunningMean:
    """Mean over images of per-batch means (each batch weighted by its size)."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.count = 0

    def add(self, value: Tensor, n: int) -> None:
        v = value.detach().double().cpu() * n
        self.total = v if self.total is None else self.total + v
        self.count += n

    @property
    def value(self) -> Tensor:
        assert self.total is not None
        return self.total / self.count


def _block_label(i: int) -> str:
    return f"block {i}"


@dataclass
class Context:
    """What every analysis may read besides the model's intermediates."""

    model: nn.Module
    images: Tensor  # (N, C, H, W) in [0, 1], what the model saw before normalisation
    query: str | None
    threshold: float
    slots: list[int]
    max_heads: int
    external_blocks: set[int]  # blocks whose "attn" is external attention (B, heads, N, S)


def _external_blocks(model: nn.Module) -> set[int]:
    from ..mixers import ExternalAttention, MultiHeadExternalAttention

    blocks = getattr(model, "blocks", [])
    return {
        i
        for i, b in enumerate(blocks)
        if any(isinstance(m, ExternalAttention | MultiHeadExternalAttention) for m in b.modules())
    }


def self_attention_maps(out: dict, ctx: Context) -> list[tuple[int, Tensor]]:
    """(block, map (B, H, N, N)) for every block whose mixer materialised a self-attention map."""
    n = out["tokens"][0].shape[1]
    return [
        (i, aux["attn"])
        for i, aux in enumerate(out["aux"])
        if "attn" in aux
        and i not in ctx.external_blocks
        and aux["attn"].dim() == 4
        and aux["attn"].shape[-2:] == (n, n)
    ]


def _needs_grid(out: dict) -> str | None:
    return None if out["layout"].grid is not None else "the tokens have no patch grid"


# ------------------------------------------------------------------------------------------ analyses
class Analysis:
    """One analysis: checked on the first batch, fed every batch, then turned into JSON + PNG."""

    name = ""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def start(self, out: dict) -> str | None:
        """None, or why the analysis does not apply to this model."""
        return None

    def update(self, out: dict, n: int) -> None:
        pass

    def result(self) -> dict[str, Any]:
        raise NotImplementedError

    def plot(self, result: dict[str, Any], path: Path) -> None:
        raise NotImplementedError

    def summary(self, result: dict[str, Any]) -> str:
        return ""


class QueryAttention(Analysis):
    """Attention of one query token over the image, per block and head."""

    name = "attention"

    def start(self, out):
        if (why := _needs_grid(out)) is not None:
            return why
        self.blocks = [i for i, _ in self_attention_maps(out, self.ctx)]
        if not self.blocks:
            return "no block computes a self-attention map (B, H, N, N)"
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
        self.grid, self.maps = (gh, gw), []
        return None

    def update(self, out, n):
        layout = out["layout"]
        per_block = [
            metrics.query_attention(a, self.query, layout.grid, layout.num_prefix)
            for _, a in self_attention_maps(out, self.ctx)
        ]
        self.maps.append([m.float().cpu() for m in per_block])

    def result(self):
        # maps[image][block][head][row][col]
        per_block = [torch.cat([b[j] for b in self.maps]) for j in range(len(self.blocks))]
        images = per_block[0].shape[0]
        gh, gw = self.grid
        where = "cls" if self.patch is None else f"patch {self.patch} (row {self.patch // gw}, col {self.patch % gw})"
        return {
            "definition": "A[h, query, patches]: the attention row of the query token over the patch tokens, "
            "per block and head (attention given to prefix tokens left out)",
            "query": where,
            "query_token": self.query,
            "grid": [gh, gw],
            "blocks": self.blocks,
            "maps": [[to_json(m[i]) for m in per_block] for i in range(images)],
        }

    def plot(self, result, path):
        from . import plots

        maps = pad_stack([torch.tensor(np.array(b, dtype=np.float32)) for b in result["maps"][0]])
        maps = maps[:, : self.ctx.max_heads]
        img = self.ctx.images[0]
        marker = None
        if self.patch is not None:
            (gh, gw), (h, w) = self.grid, img.shape[-2:]
            marker = ((self.patch % gw + 0.5) * w / gw - 0.5, (self.patch // gw + 0.5) * h / gh - 0.5)
        plots.map_grid(
            maps,
            path,
            row_labels=[_block_label(b) for b in self.blocks],
            col_labels=[f"head {h}" for h in range(maps.shape[1])],
            image=img.numpy(),
            marker=marker,
            title=f"attention of the query {result['query']} (image 0)",
        )

    def summary(self, result):
        return f"query {result['query']}, {len(self.blocks)} blocks"


class Collapse(Analysis):
    """DeepViT's cross-layer attention similarity and its count of similar blocks."""

    name = "collapse"

    def start(self, out):
        found = self_attention_maps(out, self.ctx)
        if len(found) < 2:
            return f"needs self-attention maps in at least 2 blocks, found {len(found)}"
        shapes = {tuple(a.shape) for _, a in found}
        if len(shapes) > 1:
            return f"the blocks' attention maps differ in shape ({sorted(shapes)})"
        self.blocks, self.mean = [i for i, _ in found], RunningMean()
        return None

    def update(self, out, n):
        self.mean.add(metrics.cross_layer_similarity([a for _, a in self_attention_maps(out, self.ctx)]), n)

    def result(self):
        sim = self.mean.value
        t = self.ctx.threshold
        similar = [self.blocks[k] for k in metrics.similar_blocks(sim, t)]
        return {
            "definition": "M[p, q] = mean over heads h, tokens t and images of cos(A^p[h, :, t], A^q[h, :, t]), "
            "the cosine between attention columns of blocks p and q (DeepViT §3)",
            "similar_blocks_definition": "blocks whose similarity with the previous attention block is > threshold",
            "blocks": self.blocks,
            "similarity": to_json(sim),
            "adjacent_similarity": to_json(metrics.adjacent_similarity(sim)),
            "threshold": t,
            "similar_blocks": len(similar),
            "similar_block_indices": similar,
        }

    def plot(self, result, path):
        from . import plots

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
        found = dict(self_attention_maps(out, self.ctx))
        for i in self.ctx.external_blocks:
            if i < len(out["aux"]) and "attn" in out["aux"][i]:
                a = out["aux"][i]["attn"]
                found[i] = a.unsqueeze(1) if a.dim() == 3 else a  # single-head EA: (B, N, S)
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
        from . import plots

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
    """Cosine similarity of token features between consecutive blocks."""

    name = "evolution"

    def start(self, out):
        if len(out["tokens"]) < 2:
            return "needs at least 2 blocks"
        self.mean = RunningMean()
        return None

    def update(self, out, n):
        self.mean.add(metrics.feature_evolution(out["tokens"], out["layout"].num_prefix), n)

    def result(self):
        return {
            "definition": "s[k] = mean over patch tokens n and images of cos(X^{k-1}_n, X^k_n), X^k the output of "
            "block k (Refiner paper Figs. 2 and 4); near 1 = the features barely change",
            "blocks": list(range(1, len(self.mean.value) + 1)),
            "similarity": to_json(self.mean.value),
        }

    def plot(self, result, path):
        from . import plots

        plots.curve(
            result["blocks"],
            result["similarity"],
            path,
            xlabel="block k",
            ylabel="cos(features k-1, k)",
            title="feature evolution",
            ylim=(min(0.0, *result["similarity"]), 1.02),
        )

    def summary(self, result):
        s = result["similarity"]
        return f"similarity of consecutive blocks' features {min(s):.3f}..{max(s):.3f}"


class AFTBias(Analysis):
    """AFT-conv's relative position weights exp(w) - 1 per layer and head (parameters, no images needed)."""

    name = "aft_bias"

    def start(self, out):
        from ..mixers import AFTConv

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
        from . import plots

        kernels = pad_stack([torch.tensor(np.array(k, dtype=np.float32)) for k in result["kernels"]])
        kernels = kernels[:, : self.ctx.max_heads]
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


class AFTKeys(Analysis):
    """AFT keys as feature maps over the patch grid, per layer and head (AFT-conv) or channel."""

    name = "aft_keys"

    def _keys(self, out) -> list[tuple[int, Tensor]]:
        return [(i, aux["keys"]) for i, aux in enumerate(out["aux"]) if "keys" in aux]

    def start(self, out):
        if (why := _needs_grid(out)) is not None:
            return why
        found = self._keys(out)
        if not found:
            return "no block is an AFT layer (no keys)"
        self.blocks, self.maps = [i for i, _ in found], []
        self.channels = [k.shape[-1] for _, k in found]
        return None

    def update(self, out, n):
        layout = out["layout"]
        self.maps.append(
            [
                metrics.token_maps(k[..., : self.ctx.max_heads], layout.grid, layout.num_prefix).float().cpu()
                for _, k in self._keys(out)
            ]
        )

    def result(self):
        per_block = [torch.cat([b[j] for b in self.maps]) for j in range(len(self.blocks))]
        return {
            "definition": "K[n, c] of every patch token n as an image, per layer and key channel (one per head "
            "in AFT-conv); keys before the exponential",
            "blocks": self.blocks,
            "num_channels": self.channels,
            "channels_shown": min(self.ctx.max_heads, max(self.channels)),
            "maps": [[to_json(m[i]) for m in per_block] for i in range(per_block[0].shape[0])],
        }

    def plot(self, result, path):
        from . import plots

        maps = pad_stack([torch.tensor(np.array(b, dtype=np.float32)) for b in result["maps"][0]])
        plots.map_grid(
            maps,
            path,
            row_labels=[_block_label(b) for b in self.blocks],
            col_labels=[f"key {c}" for c in range(maps.shape[1])],
            image=self.ctx.images[0].numpy(),
            title="AFT keys as feature maps (image 0)",
        )

    def summary(self, result):
        return f"{len(self.blocks)} AFT layers, {result['channels_shown']} key channels shown"


class ExternalMaps(Analysis):
    """External attention of the patches to chosen memory slots, per block and head."""

    name = "external"

    def _maps(self, out) -> list[tuple[int, Tensor]]:
        found = []
        for i in sorted(self.ctx.external_blocks):
            if i < len(out["aux"]) and "attn" in out["aux"][i]:
                a = out["aux"][i]["attn"]
                found.append((i, a.unsqueeze(1) if a.dim() == 3 else a))
        return found

    def start(self, out):
        if (why := _needs_grid(out)) is not None:
            return why
        found = self._maps(out)
        if not found:
            return "no block uses external attention"
        size = min(a.shape[-1] for _, a in found)
        if any(s >= size for s in self.ctx.slots):
            raise ValueError(f"--slots {self.ctx.slots}: the external memories have {size} slots")
        self.blocks, self.maps = [i for i, _ in found], []
        return None

    def update(self, out, n):
        layout = out["layout"]
        self.maps.append(
            [
                metrics.slot_maps(a[:, : self.ctx.max_heads], self.ctx.slots, layout.grid, layout.num_prefix)
                .float()
                .cpu()
                for _, a in self._maps(out)
            ]
        )

    def result(self):
        per_block = [torch.cat([b[j] for b in self.maps]) for j in range(len(self.blocks))]
        return {
            "definition": "A[h, patches, s]: the double-normalised external attention of every patch to memory "
            "slot s, per block, slot and head (EA Fig. 5)",
            "blocks": self.blocks,
            "slots": self.ctx.slots,
            "maps": [[to_json(m[i]) for m in per_block] for i in range(per_block[0].shape[0])],
        }

    def plot(self, result, path):
        from . import plots

        # the last EA block as the paper; (slots, heads, gh, gw), at most PLOT_ROWS slots drawn
        last = np.array(result["maps"][0][-1], dtype=np.float32)[:PLOT_ROWS]
        plots.map_grid(
            last,
            path,
            row_labels=[f"slot {s}" for s in self.ctx.slots[:PLOT_ROWS]],
            col_labels=[f"head {h}" for h in range(last.shape[1])],
            image=self.ctx.images[0].numpy(),
            title=f"external attention to memory slots, block {self.blocks[-1]} (image 0)",
        )

    def summary(self, result):
        return f"{len(self.blocks)} external-attention blocks, slots {self.ctx.slots}"


CLASSES: dict[str, type[Analysis]] = {
    c.name: c for c in (QueryAttention, Collapse, HeadSimilarity, FeatureEvolution, AFTBias, AFTKeys, ExternalMaps)
}


# ---------------------------------------------------------------------------------- model and images
def _training_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint dict when ``path`` was written by ``vitlab train``, else None (a plain weights file)."""
    if path.suffix == ".safetensors":
        return None
    try:
        from ..checkpoint import load_checkpoint
    except ImportError:  # training code not installed: every file is read as plain weights
        return None
    try:
        return load_checkpoint(path)
    except ValueError:  # not a training checkpoint (or unreadable: the plain reader explains why)
        return None


def build_model(args: argparse.Namespace) -> tuple[nn.Module, str]:
    """The model of ``args.model`` with random weights (``args.seed``) or those of ``args.checkpoint``.

    A ``vitlab train`` checkpoint rebuilds its own configuration (:func:`vitlab.checkpoint.
    model_from_checkpoint`); any other file is read safely (``weights_only`` / safetensors) and mapped
    from vitlab's or an official implementation's names (:func:`vitlab.convert.load.load_reference`), the
    number of classes taken from its ``head.weight`` unless ``--num-classes`` is given.
    Returns the model in eval mode and a description of its weights.
    """
    from ..models import create_model

    overrides = {
        k: v
        for k, v in (("img_size", args.img_size), ("in_chans", args.in_chans), ("num_classes", args.num_classes))
        if v is not None
    }
    torch.manual_seed(args.seed)
    if not args.checkpoint:
        return create_model(args.model, **overrides).eval().to(args.device), f"random init (seed {args.seed})"
    path = Path(args.checkpoint).expanduser()
    if path.is_dir() and (path / "last.pt").is_file():  # a `vitlab train` output folder
        path = path / "last.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found")
    if (ckpt := _training_checkpoint(path)) is not None:
        from ..checkpoint import check_model_name, model_from_checkpoint

        check_model_name(ckpt, args.model)
        model = model_from_checkpoint(ckpt, ema=args.ema, **overrides)
        what = f"{path} (vitlab checkpoint, epoch {ckpt.get('epoch', '?')}{', EMA' if args.ema else ''})"
        return model.eval().to(args.device), what
    if args.ema:
        raise ValueError(f"--ema needs a checkpoint written by `vitlab train`; {path} holds plain weights")
    from ..convert.load import load_reference, read_checkpoint

    state = read_checkpoint(path)
    head = state.get("head.weight")
    if "num_classes" not in overrides and isinstance(head, Tensor) and head.dim() == 2:
        overrides["num_classes"] = head.shape[0]
    model = create_model(args.model, **overrides)
    try:
        report = load_reference(model, state, source="auto")
    except ValueError as e:
        first = str(e).splitlines()[0]
        raise ValueError(f"{first}; check the model name and --img-size / --in-chans / --num-classes") from None
    return model.eval().to(args.device), f"{path} ({report.source} weights)"


def _match_channels(x: Tensor, mean: Sequence[float], std: Sequence[float], chans: int):
    """Grey -> RGB by repetition, RGB -> grey by luminance (ITU-R 601), statistics alike."""
    c = x.shape[1]
    if c == chans:
        return x, tuple(mean), tuple(std)
    if c == 1:
        return x.expand(-1, chans, -1, -1), tuple(mean) * chans, tuple(std) * chans
    if c == 3 and chans == 1:
        lum = torch.tensor([0.299, 0.587, 0.114])
        return (
            (x * lum.view(1, 3, 1, 1)).sum(1, keepdim=True),
            (float(lum @ torch.tensor(mean)),),
            (float(lum @ torch.tensor(std)),),
        )
    raise ValueError(f"images with {c} channels cannot be fed to a model with {chans} input channels")


def load_images(args: argparse.Namespace, model: nn.Module) -> tuple[Tensor, Tensor, str]:
    """(images in [0, 1] at the model's size, the normalised model input, a description)."""
    from ..data import load_dataset, make_transform, resize
    from ..data.datasets import load_image

    chans, h, w = model.meta["input_size"]
    n = args.num_images
    if n < 1:
        raise ValueError(f"--num-images must be at least 1, got {n}")
    if args.images:
        files = args.images[:n]
        for f in files:
            if not Path(f).expanduser().is_file():
                raise FileNotFoundError(f"image {f} not found")
        raw = torch.stack([load_image(Path(f).expanduser(), max(h, w), chans) for f in files])
        mean, std, what = model.meta["mean"], model.meta["std"], f"{len(files)} image files"
    else:
        spec = args.data or "mnist"
        kind = spec.partition(":")[0].lower()
        if kind == "folder":  # decode only the images used, not the whole tree
            try:
                ds = load_dataset(spec, args.split, img_size=max(h, w), channels=chans, lazy=True)
            except ValueError:  # no train/test subfolders: every image of the folder
                ds = load_dataset(spec, "all", img_size=max(h, w), channels=chans, lazy=True)
        else:
            ds = load_dataset(spec, args.split)
        if len(ds) == 0:
            raise ValueError(f"dataset {spec!r} ({args.split}) has no images")
        raw, _ = ds.get_batch(torch.arange(min(n, len(ds))))
        mean, std, what = ds.mean, ds.std, f"{spec} ({args.split}), {len(raw)} images"
    images = resize(raw.float() / 255, (h, w))
    images, mean, std = _match_channels(images, mean, std, chans)
    images = images.clamp(0, 1).contiguous()
    return images, make_transform(False, (h, w), mean, std)(images), what


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
) -> dict[str, Any]:
    """Run the analyses ``what`` on the model input ``x`` (``images``: the same in [0, 1], for the
    figures); write ``<name>.json`` / ``<name>.png`` and ``summary.json`` to ``out_dir``."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"--threshold must be in [0, 1], got {threshold}")
    if not hasattr(model, "forward_intermediates"):
        raise ValueError(f"{type(model).__name__} has no forward_intermediates(x, return_aux=True) to analyse")
    if max_heads < 1 or batch_size < 1:
        raise ValueError(f"--max-heads and --batch-size must be positive, got {max_heads}, {batch_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(model, images.cpu(), query, threshold, list(slots), max_heads, _external_blocks(model))
    todo = [CLASSES[n](ctx) for n in what]
    skipped: dict[str, str] = {}
    logits_diff = 0.0
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            xb = x[start : start + batch_size].to(device)
            out = model.forward_intermediates(xb, return_aux=True)
            if start == 0:
                # the explicit (map-materialising) path must compute the model's own output
                logits_diff = float((model.forward_head(out["features"]) - model(xb)).abs().max())
                for a in list(todo):
                    if (why := a.start(out)) is not None:
                        skipped[a.name] = why
                        todo.remove(a)
            for a in todo:
                a.update(out, len(xb))
    report: dict[str, Any] = {
        "model": getattr(model, "meta", {}).get("name", type(model).__name__),
        "num_images": len(x),
        "explicit_path_max_abs_logit_diff": logits_diff,
        "analyses": {},
    }
    for a in todo:
        result = a.result()
        json_path, png_path = out_dir / f"{a.name}.json", out_dir / f"{a.name}.png"
        json_path.write_text(json.dumps(result))
        a.plot(result, png_path)
        report["analyses"][a.name] = {"json": str(json_path), "png": str(png_path), "summary": a.summary(result)}
        log(f"{a.name:10s} {a.summary(result)}  -> {json_path}, {png_path.name}")
    for name, why in skipped.items():
        report["analyses"][name] = {"skipped": why}
        log(f"{name:10s} skipped: {why}")
    (out_dir / "summary.json").write_text(json.dumps(report, indent=1))
    return report


def parse_slots(spec: str) -> list[int]:
    try:
        slots = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--slots must be comma-separated slot indices, got {spec!r}") from None
    if not slots or min(slots) < 0:
        raise ValueError(f"--slots must be non-negative slot indices, got {spec!r}")
    return slots


def run(args: argparse.Namespace) -> int:
    what = parse_what(args.what)
    slots = parse_slots(args.slots)
    model, weights = build_model(args)
    images, x, data = load_images(args, model)
    print(f"{args.model} [{weights}] on {data}; analyses: {', '.join(what)}")
    report = analyze(
        model,
        images,
        x,
        what,
        args.out,
        query=args.query,
        threshold=args.threshold,
        slots=slots,
        max_heads=args.max_heads,
        batch_size=args.batch_size,
    )
    diff = report["explicit_path_max_abs_logit_diff"]
    print(f"explicit path vs model(x): max |logit difference| = {diff:.2e}; summary: {Path(args.out) / 'summary.json'}")
    return 0
