"""Reports of the tools: tables (text, Markdown), matplotlib figures, the JSON document of a benchmark run.

One place for what ``vitlab compare``/``study``, ``vitlab bench``/``bench-mixers`` and ``vitlab analyze`` each
set up: pyplot on the file-only backend, figures saved atomically and closed, tables of formatted cells
(``-`` for a missing value, ``mean ± std`` over seeds), and a benchmark's JSON document (schema, creation
time, duration, the machine, the configuration, then the tool's sections: cases, targets, ...). The loop over
a benchmark's cases and its file writers are :mod:`vitlab.measure.sweep`'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .io import write_figure_atomic

Result = dict[str, Any]
Column = tuple[str, str, str]  # (row key, header, format of one value)


def timed_sweep(run: Callable[[], list[Result]], machine: dict[str, Any]) -> tuple[list[Result], float]:
    """``run()``'s results and its duration in seconds; the load average at its start and end go into
    ``machine`` (``loadavg_start``, ``loadavg_end``): timings move with the load of a shared machine."""
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    results = run()
    elapsed = time.perf_counter() - t0
    machine["loadavg_start"], machine["loadavg_end"] = load0, os.getloadavg()
    return results, elapsed


def report_doc(
    schema: str, elapsed: float, machine: dict[str, Any], config: dict[str, Any], **sections: Any
) -> dict[str, Any]:
    """The JSON document of a run: what, when, how long, where, with which options; then ``sections``."""
    return {
        "schema": schema,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_s": elapsed,
        "machine": machine,
        "config": config,
        **sections,
    }


def print_written(paths: Iterable[Path], elapsed: float) -> None:
    print(f"wrote {', '.join(str(p) for p in paths)} ({elapsed:.0f} s)")


# --------------------------------------------------------------------------- tables


def fmt_cell(row: dict[str, Any], key: str, fmt: str) -> str:
    """One cell: ``-`` for a missing value, ``mean ± std`` where the row has the spread over seeds."""
    if row.get(key) is None:
        return "-"
    if row.get(f"{key}_std") is not None:
        return f"{fmt.format(row[key])} ± {fmt.format(row[key + '_std'])}"
    return fmt.format(row[key])


def fmt_row(row: dict[str, Any], columns: Sequence[Column]) -> list[str]:
    return [fmt_cell(row, k, f) for k, _, f in columns]


def aligned(cells: Sequence[Sequence[str]], text_columns: int = 1, rule: bool = False) -> list[str]:
    """Rows of cells as lines of columns two spaces apart: the leading ``text_columns`` left-aligned (text),
    the others right-aligned (numbers); with ``rule``, a line of dashes under the first (the headers)."""
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(c.ljust(w) if i < text_columns else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
        for line in cells
    ]
    return [lines[0], "  ".join("-" * w for w in widths), *lines[1:]] if rule else lines


def render_text(rows: list[dict[str, Any]], columns: Sequence[Column], text_columns: int = 1) -> str:
    """The table as aligned text: the headers, a rule of dashes, a line per row."""
    cells = [[h for _, h, _ in columns]] + [fmt_row(r, columns) for r in rows]
    return "\n".join(aligned(cells, text_columns, rule=True))


def render_markdown(rows: list[dict[str, Any]], note: str, columns: Sequence[Column], text_columns: int = 1) -> str:
    """The table in Markdown (numbers right-aligned), then ``note`` as a paragraph."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" if i < text_columns else "---:" for i in range(len(columns))) + "|"
    body = ["| " + " | ".join(fmt_row(r, columns)) + " |" for r in rows]
    return "\n".join([head, sep, *body, "", note, ""])


# --------------------------------------------------------------------------- figures


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed), imported when a figure is
    drawn; an interactive backend a user already chose is kept (the files are the same)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def figure_grid(rows: int, cols: int, height: float) -> tuple[Any, Any]:
    """A figure of ``rows`` x ``cols`` panels 6.5 wide and ``height`` high; ``axes`` always 2-D."""
    return pyplot().subplots(rows, cols, figsize=(6.5 * cols, height * rows), squeeze=False)


def log_axes(ax: Any, xlabel: str, ylabel: str, x_base: int | None = None) -> None:
    """Label a panel; log y (and log x in ``x_base`` when given), grid on both scales."""
    if x_base is not None:
        ax.set_xscale("log", base=x_base)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 110, **savefig_kwargs: Any) -> Path:
    """``fig`` saved at ``path`` (atomically; the format follows the suffix, PNG by default), then closed."""
    path = write_figure_atomic(fig, path, dpi=dpi, **savefig_kwargs)
    pyplot().close(fig)
    return path


def legend_entries(axes: Any) -> tuple[list, list[str]]:
    """The lines of every panel of ``axes``, each label once, in first-seen order (one legend per figure)."""
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    return handles, labels
