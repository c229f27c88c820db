"""The report of a benchmark run, as ``vitlab bench`` and ``vitlab bench-mixers`` write it.

One JSON document (schema, creation time, duration, the machine, the configuration, then the tool's
sections: cases, targets, ...), a text table, and PNG figures of log-scale axes; every file written
atomically. The loop over the cases and the file writers themselves are :mod:`vitlab.measure.sweep`'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..io import atomic_path

Result = dict[str, Any]


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


# --------------------------------------------------------------------------- figures


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only backend (no display needed); imported when a figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
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


def save_figure(fig: Any, path: Path) -> Path:
    """``fig`` as a PNG at ``path`` (atomically), then closed."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
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
