"""PNG figures for ``vitlab analyze`` (matplotlib with the Agg backend, imported on first use)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display needed; keeps an interactive backend a user already chose
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def _title(fig, title: str) -> None:
    """A figure title half an inch above the axes, whatever the figure's height."""
    if title:
        height = fig.get_size_inches()[1]
        fig.subplots_adjust(top=1 - 0.55 / height)
        fig.suptitle(title, fontsize=10, y=1 - 0.15 / height)


def _image_hwc(image: np.ndarray) -> tuple[np.ndarray, str | None]:
    """(C, H, W) in [0, 1] -> what imshow takes, and the colour map for grey images."""
    image = np.clip(np.asarray(image, dtype=np.float32), 0, 1)
    if image.shape[0] == 1:
        return image[0], "gray"
    return image.transpose(1, 2, 0), None


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
    cell: float = 1.3,
) -> Path:
    """A grid of small images ``maps[r, c]`` (R, C, h, w), each with its own colour scale.

    ``image`` (C, H, W in [0, 1]) is shown first, left of row 0, with ``marker`` = (x, y) pixel
    drawn on it (a query patch). ``diverging``: a red/blue scale symmetric around 0 (biases).
    """
    plt = _pyplot()
    maps = np.asarray(maps, dtype=np.float32)
    r, c = maps.shape[:2]
    extra = int(image is not None)
    fig, axes = plt.subplots(r, c + extra, figsize=(cell * (c + extra), cell * r + 0.6), squeeze=False)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_frame_on(False)
    if image is not None:
        img, cmap = _image_hwc(image)
        axes[0, 0].imshow(img, cmap=cmap)
        axes[0, 0].set_title("input", fontsize=8)
        if marker is not None:
            axes[0, 0].plot(*marker, marker="x", color="red", markersize=8, mew=2)
    for i in range(r):
        for j in range(c):
            ax, m = axes[i, j + extra], maps[i, j]
            finite = np.isfinite(m)
            lo, hi = (float(m[finite].min()), float(m[finite].max())) if finite.any() else (0.0, 1.0)
            if diverging:
                lim = max(abs(lo), abs(hi), 1e-12)
                ax.imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
            else:
                ax.imshow(m, cmap="viridis", vmin=lo, vmax=hi if hi > lo else lo + 1e-12, interpolation="nearest")
            if i == 0:
                ax.set_title(col_labels[j], fontsize=8)
            if j == 0:
                ax.set_ylabel(row_labels[i], fontsize=8)
                ax.set_frame_on(True)
    fig.subplots_adjust(wspace=0.35 if image is not None else 0.15)
    _title(fig, title)
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
    plt = _pyplot()
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
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(list(x), list(y), marker="o")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, path)
