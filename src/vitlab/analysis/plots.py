"""PNG figures for ``vitlab analyze`` (matplotlib through :mod:`vitlab.common.report`, imported on first use)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..common.report import pyplot, save_figure


def _save(fig, path: str | Path) -> Path:
    return save_figure(fig, path, dpi=100, bbox_inches="tight")


def _title(fig, title: str) -> None:
    """A figure title half an inch above the axes, whatever the figure's height."""
    if title:
        height = fig.get_size_inches()[1]
        fig.subplots_adjust(top=1 - 0.55 / height)
        fig.suptitle(title, fontsize=10, y=1 - 0.15 / height)


def _colour(m: np.ndarray, diverging: bool) -> np.ndarray:
    """One map (h, w) as RGB with its own scale: viridis min..max, or red/blue symmetric around 0; NaN white."""
    from matplotlib import colormaps

    finite = np.isfinite(m)
    lo, hi = (float(m[finite].min()), float(m[finite].max())) if finite.any() else (0.0, 1.0)
    if diverging:
        lim = max(abs(lo), abs(hi), 1e-12)
        t, cmap = (m / lim + 1) / 2, colormaps["RdBu_r"]
    else:
        t, cmap = (m - lo) / max(hi - lo, 1e-12), colormaps["viridis"]
    rgb = cmap(np.nan_to_num(t, nan=0.0))[..., :3]
    rgb[~finite] = 1.0
    return rgb


def _as_rgb(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(C, H, W) in [0, 1] -> (h, w, 3) at ``size`` (bilinear), grey replicated."""
    import torch
    import torch.nn.functional as F

    t = torch.as_tensor(np.asarray(image, dtype=np.float32))[None].clamp(0, 1)
    t = F.interpolate(t, size=size, mode="bilinear", align_corners=False, antialias=True)[0]
    return t.expand(3, -1, -1).permute(1, 2, 0).clamp(0, 1).numpy() if t.shape[0] == 1 else t.permute(1, 2, 0).numpy()


def map_grid(
    maps: np.ndarray,
    path: str | Path,
    *,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str = "",
    image: np.ndarray | None = None,
    marker: tuple[float, float] | None = None,
    diverging: bool = False,
    min_px: int = 64,
) -> Path:
    """A grid of small images ``maps[r, c]`` (R, C, h, w), each with its own colour scale.

    ``image`` (C, H, W in [0, 1]) is shown first, left of row 0, with ``marker`` = (x, y) in its pixels
    (a query patch). ``diverging``: a red/blue scale symmetric around 0 (biases). Drawn as one mosaic
    (each map enlarged to at least ``min_px`` pixels, nearest neighbour) in a single axes: a figure of
    hundreds of maps stays fast to draw.
    """
    plt = pyplot()
    maps = np.asarray(maps, dtype=np.float32)
    r, c, h, w = maps.shape
    k = max(1, math.ceil(min_px / max(h, w)))
    ch, cw, pad = h * k, w * k, max(4, min_px // 12)
    extra = int(image is not None)
    cols = c + extra
    canvas = np.ones((r * (ch + pad) + pad, cols * (cw + pad) + pad, 3), dtype=np.float32)

    def put(i: int, j: int, rgb: np.ndarray) -> None:
        y, x = pad + i * (ch + pad), pad + j * (cw + pad)
        canvas[y : y + ch, x : x + cw] = rgb

    for i in range(r):
        for j in range(c):
            put(i, j + extra, _colour(maps[i, j], diverging).repeat(k, 0).repeat(k, 1))
    if image is not None:
        put(0, 0, _as_rgb(image, (ch, cw)))
    left, top, dpi = 1.0, 0.45 + 0.25 * bool(title), 100
    fig = plt.figure(figsize=(canvas.shape[1] / dpi + left + 0.1, canvas.shape[0] / dpi + top + 0.1), dpi=dpi)
    fw, fh = fig.get_size_inches()
    ax = fig.add_axes((left / fw, 0.1 / fh, canvas.shape[1] / dpi / fw, canvas.shape[0] / dpi / fh))
    ax.imshow(canvas, interpolation="nearest")
    ax.set_axis_off()
    centre = lambda j: pad + j * (cw + pad) + cw / 2  # noqa: E731
    for j, label in enumerate((["input"] if extra else []) + list(col_labels)):
        ax.text(centre(j), pad / 2, label, ha="center", va="bottom", fontsize=8)
    for i, label in enumerate(row_labels):
        ax.text(-pad, pad + i * (ch + pad) + ch / 2, label, ha="right", va="center", fontsize=8)
    if image is not None and marker is not None:
        ih, iw = np.asarray(image).shape[-2:]
        ax.plot(
            pad + (marker[0] + 0.5) * cw / iw - 0.5,
            pad + (marker[1] + 0.5) * ch / ih - 0.5,
            marker="x",
            color="red",
            markersize=8,
            mew=2,
        )
    if title:
        fig.suptitle(title, fontsize=10, y=1 - 0.12 / fh, va="top")
    return _save(fig, path)


def matrices(
    mats: Sequence[np.ndarray],
    path: str | Path,
    *,
    titles: Sequence[str],
    ticks: Sequence[str] | None = None,
    title: str = "",
    vmin: float = 0.0,
    vmax: float = 1.0,
    annotate: bool = False,
    axis: str = "",
) -> Path:
    """Square heatmaps side by side (cross-layer similarity, head similarity per block), one colour bar;
    ``axis`` names what the rows and columns index."""
    plt = pyplot()
    k = len(mats)
    cols = min(k, 6)
    rows = math.ceil(k / cols)
    size = 6.0 if k == 1 else 2.6
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols + 1.0, size * rows + 0.6), squeeze=False)
    im = None
    for ax in axes.flat[k:]:
        ax.axis("off")
    for idx, (ax, m, t) in enumerate(zip(axes.flat, mats, titles)):
        m = np.asarray(m, dtype=np.float32)
        im = ax.imshow(m, cmap="viridis", vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set_title(t, fontsize=9)
        n = m.shape[0]
        labels = list(ticks) if ticks is not None else [str(i) for i in range(n)]
        step = max(1, math.ceil(n / 16))
        ax.set_xticks(range(0, n, step), labels[::step], fontsize=7)
        ax.set_yticks(range(0, n, step), labels[::step], fontsize=7)
        if axis and idx + cols >= k:  # bottom row
            ax.set_xlabel(axis, fontsize=8)
        if axis and idx % cols == 0:  # left column
            ax.set_ylabel(axis, fontsize=8)
        if annotate and n <= 16:
            for (y, x), v in np.ndenumerate(m):
                ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < 0.6 else "k")
    _title(fig, title)  # before the colour bar, which takes its space from the axes as they are then
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    return _save(fig, path)


def curve(
    x: Sequence[float],
    y: Sequence[float],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    ylim: tuple[float, float] | None = None,
) -> Path:
    """One line plot with markers (feature evolution over the blocks)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(list(x), list(y), marker="o")
    ax.xaxis.get_major_locator().set_params(integer=True)  # block indices
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, path)


def scatter(points: np.ndarray, path: str | Path, *, title: str = "") -> Path:
    """Points (n, 2), each labelled with its index (a t-SNE embedding)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(points[:, 0], points[:, 1], s=12)
    if len(points) <= 100:
        for i, (x, y) in enumerate(points):
            ax.annotate(str(i), (x, y), fontsize=6, alpha=0.6)
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, path)
