"""The tables and figures of ``vitlab compare`` and ``vitlab study``: ``table.csv`` / ``table.json`` /
``table.md`` (the columns and the caption say what was measured), ``curves.png``, ``acc_vs_speed.png``, a
study's ``study.png`` (each row beside the paper's figure) and DeepViT's ``similarity.png``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..common.io import write_csv_atomic, write_json_atomic, write_text_atomic
from ..common.report import Column, pyplot, render_markdown, save_figure
from .study import SCORE_TITLES, Study

SIMILAR = 0.9  # DeepViT: a block is "similar" above 90 % cross-layer similarity with the previous one


COLUMNS: list[Column] = [
    ("model", "model", "{}"), ("method", "method", "{}"), ("top1", "top-1 %", "{:.2f}"), ("top1_ci", "95% CI", "{}"),
    ("top5", "top-5 %", "{:.2f}"),
    ("params_m", "params (M)", "{:.3f}"), ("mmacs", "MACs (M)", "{:.2f}"), ("train_img_s", "train img/s", "{:.0f}"),
    ("infer_img_s", "infer img/s", "{:.0f}"), ("peak_mib", "peak MiB", "{:.0f}"), ("train_s", "train s", "{:.0f}"),
]  # fmt: skip
TEXT_COLUMNS = 2  # the leading columns that hold text (left-aligned)
# measured per run and averaged over the seeds; the scores also get their standard deviation
SCORES = ("top1", "top5", "miou", "box_ap", "mask_ap")
SEED_MEAN = (*SCORES, "ema_top1", "epoch_img_s", "peak_mib", "train_mem_mib", "train_s", "wall_s")
SEED_SPREAD = SCORES


def compare_note(meta: dict[str, Any], columns: list[Column] = COLUMNS) -> str:
    """The table's caption: what ran (data, epochs, batch, the learning rate that ran) and what each measured
    column means; it names only the columns the table has."""
    keys = {k for k, *_ in columns}
    seeds = f", mean ± std over {meta['seeds']} seeds" if meta["seeds"] > 1 else ""
    lrs = meta["lr"]  # the peak lrs the runs trained at, sorted
    lr = f"peak lr {lrs[0]:.3g}" if len(lrs) == 1 else f"peak lr {lrs[0]:.3g} to {lrs[-1]:.3g}"
    parts = [
        f"Held-out scores after {meta['epochs']} epochs on {meta['data']} at {meta['img_size']} px "
        f"({meta['train_images']} train / {meta['heldout_images']} held-out images{seeds}), batch "
        f"{meta['batch_size']}, {lr}."
    ]
    if "top1_ci" in keys:
        parts.append("95% CI: the Wilson interval of top-1 on the held-out images (one seed's set).")
    if meta.get("speed", True) and keys & {"train_img_s", "infer_img_s"}:
        parts.append(
            f"Speeds timed after training, one variant at a time in a fresh process with "
            f"{meta['threads_per_job']} thread(s): train img/s = forward, backward and AdamW step on a batch of "
            f"{meta['batch_size']} (no data loading); infer img/s = forward of a batch of 256."
        )
    if "peak_mib" in keys:
        parts.append(
            f"peak MiB = peak resident memory of the variant's training process ({meta['jobs']} variant(s) "
            "trained at a time)."
        )
    parts.append(f"Wall time {meta['wall_s']:.0f} s, load average {meta['loadavg']}.")
    return " ".join(parts)


def write_tables(
    out: Path, rows: list[dict[str, Any]], meta: dict[str, Any], columns: list[Column] = COLUMNS, note: str = ""
) -> list[Path]:
    write_csv_atomic(out / "table.csv", [{k: _csv_value(v) for k, v in r.items()} for r in rows])
    write_json_atomic(out / "table.json", {"meta": meta, "rows": rows})
    text_columns = meta.get("text_columns", TEXT_COLUMNS)
    write_text_atomic(
        out / "table.md", render_markdown(rows, note or compare_note(meta, columns), columns, text_columns)
    )
    return [out / "table.csv", out / "table.json", out / "table.md"]


def _csv_value(v: Any) -> Any:
    return json.dumps(v) if isinstance(v, list | dict) else v


def mean_curve(logs: list[list[dict[str, Any]]], key: str) -> tuple[list[int], list[float], list[float]]:
    """Epochs, mean and standard deviation over the runs (seeds) of a per-epoch log value."""
    runs = [{r["epoch"]: r.get(key) for r in log} for log in logs if log]
    epochs = sorted({e for run in runs for e in run})
    values = [[run[e] for run in runs if run.get(e) is not None] for e in epochs]
    keep = [i for i, v in enumerate(values) if v]
    means = [statistics.fmean(values[i]) for i in keep]
    stds = [statistics.stdev(values[i]) if len(values[i]) > 1 else 0.0 for i in keep]
    return [epochs[i] for i in keep], means, stds


def plot(out: Path, rows: list[dict[str, Any]], logs: dict[str, list[list[dict[str, Any]]]]) -> list[Path]:
    """``curves.png`` (held-out top-1 and training loss per epoch: the mean over seeds, shaded ± std) and
    ``acc_vs_speed.png`` (top-1 against inference speed, error bars = std over seeds) when speeds were timed."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows_seen = [r for runs in logs.values() for run in runs for r in run]
    score = next((f"val_{k}" for k in ("miou", "box_ap") if any(f"val_{k}" in r for r in rows_seen)), "val_top1")
    for name, runs in logs.items():
        for ax, key in ((ax1, score), (ax2, "train_loss")):
            ep, mean, std = mean_curve(runs, key)
            if not ep:
                continue
            line = ax.plot(ep, mean, marker="o", ms=3, label=name)[0]
            if any(std):
                ax.fill_between(
                    ep,
                    [m - s for m, s in zip(mean, std)],
                    [m + s for m, s in zip(mean, std)],
                    color=line.get_color(),
                    alpha=0.2,
                )
    what = SCORE_TITLES[score.removeprefix("val_")]
    ax1.set(xlabel="epoch", ylabel=what, title=what.replace(" (%)", ""))
    ax2.set(xlabel="epoch", ylabel="training loss", title="training loss", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out / "curves.png", dpi=120)
    pts = [r for r in rows if r.get("top1") is not None and r.get("infer_img_s")]
    if not pts:
        return [out / "curves.png"]
    fig, ax = plt.subplots(figsize=(7, 5))
    x, y = [r["infer_img_s"] for r in pts], [r["top1"] for r in pts]
    ax.scatter(x, y, s=[40 + 200 * r["params_m"] for r in pts], alpha=0.8, label="dot area: parameters")
    lo = [r["top1"] - r.get("top1_lo", r["top1"]) for r in pts]
    hi = [r.get("top1_hi", r["top1"]) - r["top1"] for r in pts]
    ax.errorbar(x, y, yerr=[lo, hi], fmt="none", ecolor="gray", capsize=3, label="95% CI of top-1 (held-out set)")
    place_labels(ax, x, y, [r["model"] for r in pts])
    ax.set(xlabel="inference throughput (img/s)", ylabel="held-out top-1 (%)", title="accuracy vs inference speed")
    ax.legend(fontsize=8, loc="best", markerscale=0.5)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out / "acc_vs_speed.png", dpi=120)
    return [out / "curves.png", out / "acc_vs_speed.png"]


def place_labels(ax: Any, x: list[float], y: list[float], labels: list[str], height: float = 11.0) -> None:
    """Name each point beside it, moving a name down until it overlaps no name placed before (points close in
    speed and accuracy would print their names on top of each other)."""
    ax.figure.canvas.draw()  # the axes' final limits: positions in pixels
    placed: list[tuple[float, float, float]] = []  # (left, bottom, width) of each name, in pixels
    for i in sorted(range(len(x)), key=lambda i: -y[i]):
        px, py = ax.transData.transform((x[i], y[i]))
        width, dy = 6.5 * len(labels[i]), 5.0
        while any(abs(py + dy - b) < height and px + 5 < left + w and left < px + 5 + width for left, b, w in placed):
            dy -= height
        placed.append((px + 5, py + dy, width))
        ax.annotate(labels[i], (x[i], y[i]), textcoords="offset points", xytext=(5, dy * 72 / ax.figure.dpi),
                    fontsize=8)  # fmt: skip


def plot_study(path: Path, study: Study, rows: list[dict[str, Any]]) -> Path:
    """Our top-1 per row (mean, error bar = std over seeds) and, beside it, the paper's figure of that row."""
    plt = pyplot()
    labels = [r["row"] for r in rows]
    paper_key, paper_header, _ = study.measures[0]
    paper = [r.get(f"paper_{paper_key}") for r in rows]
    numeric = [v if isinstance(v, int | float) else None for v in paper]
    panels = 2 if any(v is not None for v in numeric) else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 0.5 * len(rows) + 2), squeeze=False)
    y = list(range(len(rows)))
    key = study.score
    ours = [r.get(key) or 0.0 for r in rows]
    axes[0][0].barh(y, ours, xerr=[r.get(f"{key}_std") or 0.0 for r in rows], color="tab:blue", capsize=3)
    what = SCORE_TITLES[key]
    axes[0][0].set(yticks=y, yticklabels=labels, xlabel=what, title="vitlab (this run)")
    spread = [(r.get(key) or 0.0, r.get(f"{key}_std") or 0.0) for r in rows]
    axes[0][0].set_xlim(max(0.0, min(m - s for m, s in spread) - 2), min(100.0, max(m + s for m, s in spread) + 2))
    if panels == 2:
        known = [v for v in numeric if v is not None]
        axes[0][1].barh(y, [v if v is not None else 0 for v in numeric], color="tab:gray")
        axes[0][1].set(yticks=y, yticklabels=["" for _ in y], xlabel=paper_header, title="paper")
        axes[0][1].set_xlim(min(known) - (max(known) - min(known) + 1), max(known) + 0.5)
    for ax in axes[0]:
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(study.title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def write_similarity(out: Path, curves: dict[str, list[float]]) -> list[Path]:
    """``similarity.png``: each row's block-to-block similarity curve (the data is ``similarity.json``)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, marker="o", ms=3, label=label, ls="--" if "Deep" in label else "-")
    ax.axhline(SIMILAR, color="gray", lw=0.8)
    ax.set(xlabel="block k", ylabel="similarity of block k's maps with block k-1's", title="cross-layer similarity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return [save_figure(fig, out / "similarity.png", dpi=120)]
