"""What a study is: :class:`Study` (one paper table) of :class:`Row` s (one line each: the named configurations
that train it and the paper's figures), and :func:`rows`, which the tables are written with. The tables
themselves, with each paper's citation and its own row helpers, are in :mod:`vitlab.experiments.papers`, one
file per paper.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PaperValue = float | str | None
#: the held-out measure a study of each task compares its rows by (classification: top-1), and its axis title
TASK_SCORES = {"segmentation": "miou", "detection": "box_ap"}
SCORE_TITLES = {"top1": "held-out top-1 (%)", "miou": "held-out mIoU", "box_ap": "held-out box AP"}


@dataclass(frozen=True)
class Row:
    """One line of a paper table.

    ``key``: a short name (the run's folder); ``label``: the line as the paper states it; ``small`` /
    ``small_args``: the registered small model and the switch as overrides (none where a registered row has it);
    ``full`` / ``full_args``: the registered paper-size model and the switch as overrides; ``paper``: the paper's
    figures by measure key (``top1``, or the study's other measures).
    """

    key: str
    label: str
    small: str
    full: str
    full_args: dict[str, Any] = field(default_factory=dict)
    paper: dict[str, PaperValue] = field(default_factory=dict)
    small_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Study:
    """One paper table: rows, the paper's figures and where they come from.

    ``measures``: the paper's columns ``(key, header, format)``; ``extra``: a measure taken from the trained models
    besides accuracy (``"similarity"``: DeepViT's cross-layer similarity of attention maps); ``recipe``: training
    options of this study that differ from compare's recipe (small scale).
    """

    name: str
    title: str
    paper: str
    source: str
    rows: tuple[Row, ...]
    measures: tuple[tuple[str, str, str], ...] = (("top1", "paper top-1 %", "{:.1f}"),)
    notes: str = ""
    extra: str | None = None
    recipe: dict[str, Any] = field(default_factory=dict)

    @property
    def score(self) -> str:
        """The measure the rows are compared by: ``top1``, ``miou`` for segmentation, ``box_ap`` for detection."""
        return TASK_SCORES.get(self.recipe.get("task", "classification"), "top1")


def rows(*specs: tuple) -> tuple[Row, ...]:
    """Rows from ``(key, label, small, full, full_args, paper top-1 or {measure: value}[, small_args])`` tuples."""
    out = []
    for key, label, small, full, full_args, paper, *small_args in specs:
        figures = paper if isinstance(paper, dict) else {"top1": paper}
        out.append(Row(key, label, small, full, full_args, figures, *small_args))
    return tuple(out)
